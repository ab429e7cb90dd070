"""Which pipeline buffer takes the next read: one whose write-back landed, else the one
whose write-back lands first. Waiting for the write just issued, as next use alone
(Belady) would pick in backward's order, made the disk alternate write and read."""

from __future__ import annotations

import types

import pytest
import torch

from tiermem.tiers.pipeline import StepPipeline


class FakeWrite:
    def __init__(self, landed: bool, issued: float) -> None:
        self.landed, self.issued = landed, issued

    def done(self) -> bool:
        return self.landed

    def interval(self) -> tuple[float, float]:
        return self.issued, self.issued + 1.0


def pipeline_with(slots: list[tuple[int, bool | None, int]], order: list[int]) -> StepPipeline:
    """Buffers holding partition ids, each with its write (None: none; True/False: landed or
    in flight) and when it was issued; `order`: the planned visit."""
    parts = {i: types.SimpleNamespace(id=i) for i in set(order) | {s[0] for s in slots}}
    pipe = StepPipeline(None, [torch.empty(1) for _ in slots], list(parts.values()),
                        prefetch_depth=1, zigzag=False)
    pipe.planned = [parts[i] for i in order]
    for slot, (pid, landed, issued) in zip(pipe.slots, slots):
        slot.part = parts[pid]
        slot.write = None if landed is None else FakeWrite(landed, issued)
        pipe.where[pid] = slot
    return pipe


def victim(pipe: StepPipeline, window: list[int], i: int) -> int:
    order = pipe.order(pipe.steps_done)
    win = [p for p in order if p.id in window]
    return pipe.slots.index(pipe._victim(win, order, i))


@pytest.mark.parametrize("landed_slot", [1, 2])
def test_a_landed_buffer_is_taken_over_one_still_writing(landed_slot):
    # Order 5, 6 | 0, 1, 2, 3: updating 5, reading 6. Buffers: 0 (write just issued, needed
    # last next step: Belady's pick), 1 and 2 (one landed), 3 (window). The landed one wins.
    slots = [(0, False, 9), (1, landed_slot == 1, 5), (2, landed_slot == 2, 6), (6, None, 0)]
    pipe = pipeline_with(slots, order=[5, 6, 3, 2, 1, 0])
    assert victim(pipe, window=[5, 6], i=0) == landed_slot


def test_among_landed_buffers_the_one_needed_last():
    slots = [(0, True, 1), (1, True, 2), (2, None, 0), (6, None, 0)]
    pipe = pipeline_with(slots, order=[5, 6, 2, 1, 0])
    assert victim(pipe, window=[5, 6], i=0) == 0  # 0 is needed last


def test_with_every_write_in_flight_the_first_issued():
    slots = [(0, False, 7), (1, False, 4), (2, False, 5), (6, None, 0)]
    pipe = pipeline_with(slots, order=[5, 6, 2, 1, 0])
    assert victim(pipe, window=[5, 6], i=0) == 1  # issued first, lands first


def test_window_and_failed_writes_are_never_taken():
    slots = [(0, True, 1), (1, True, 2), (6, None, 0), (5, None, 0)]
    pipe = pipeline_with(slots, order=[5, 6, 1, 0])
    pipe.slots[0].dirty = True  # its write-back failed: the only current copy
    assert victim(pipe, window=[5, 6], i=0) == 1
