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


# -- reads ahead past the records still in buffers, and the order a step starts in ---------


class FakeRead:
    def __init__(self, issued: float) -> None:
        self.issued = issued

    def done(self) -> bool:
        return False

    def interval(self) -> tuple[float, float]:
        return self.issued, self.issued + 1.0


class FakeStore:
    """Records of 1 byte; every read stays in flight; write-backs that landed are good."""

    def __init__(self) -> None:
        self.reads: list[int] = []
        self.follows: dict = {}  # partition id -> the write its read follows, or None
        self.slots = __import__("collections").defaultdict(lambda: types.SimpleNamespace(nbytes=1))

    def read(self, part, buf, *, after=None, nbytes=None) -> FakeRead:
        self.reads.append(part.id)
        self.follows[part.id] = after
        return FakeRead(100.0 + len(self.reads))

    def finish_write(self, part, buf, req, retries=0) -> int:
        return 0


def zigzag_pipeline(slots: list[tuple[int, bool | None, int]], n: int, k: int,
                    follow_writes: bool = True) -> tuple[StepPipeline, list]:
    """Partitions 0..n-1 in zig-zag order, none fresh; buffers holding `slots` as
    pipeline_with does."""
    from tiermem.telemetry.stats import StepStats

    parts = [types.SimpleNamespace(id=i) for i in range(n)]
    pipe = StepPipeline(FakeStore(), [torch.empty(1) for _ in slots], parts,
                        prefetch_depth=k, zigzag=True, follow_writes=follow_writes)
    pipe.fresh.clear()
    for slot, (pid, landed, issued) in zip(pipe.slots, slots):
        slot.part = parts[pid]
        slot.write = None if landed is None else FakeWrite(landed, issued)
        pipe.where[pid] = slot
    return pipe, StepStats()


@pytest.mark.parametrize("follow", [True, False], ids=["follow", "wait"])
def test_reads_ahead_start_past_the_records_still_in_buffers(follow):
    # Step order 0..9; buffers hold 0, 1, 2 (this step's first: zig-zag), 9's record (done
    # with this step, its write landed) and 8's (write still in flight). Updating 0 with
    # prefetch_depth 2: 1 and 2 need no read, so the read of 3 is issued now, into 9's
    # buffer; 4 goes into 8's buffer, following its write piece by piece. Without
    # following, 8's buffer is not waited for.
    pipe, stats = zigzag_pipeline([(0, None, 0), (1, None, 0), (2, None, 0), (9, True, 1),
                                   (8, False, 2)], n=10, k=2, follow_writes=follow)
    write_of_8 = pipe.slots[4].write
    order = list(pipe.parts)  # the visit: 0..9
    pipe._read_ahead(order, 0, stats)
    assert pipe.where[3] is pipe.slots[3] and 9 not in pipe.where
    assert pipe.store.follows[3] is None  # 9's write had landed
    if follow:
        assert pipe.store.reads == [3, 4]
        assert pipe.where[4] is pipe.slots[4] and 8 not in pipe.where
        assert pipe.store.follows[4] is write_of_8
        assert pipe.slots[4].after is write_of_8 and pipe.slots[4].write is None
    else:
        assert pipe.store.reads == [3]
        assert pipe.where[8] is pipe.slots[4]  # the buffer still writing kept its record


def test_reads_ahead_stop_at_prefetch_depth_and_never_evict_a_record_needed_sooner():
    pipe, stats = zigzag_pipeline([(0, None, 0), (7, True, 1), (8, True, 2), (9, True, 3),
                                   (5, None, 0)], n=10, k=2)
    order = list(pipe.parts)
    pipe._read_ahead(order, 0, stats)
    # 1 and 2 read (depth 2); 5 stays: it is needed before anything read into its buffer
    assert pipe.store.reads == [1, 2]
    assert pipe.where[5] is pipe.slots[4]
    assert 7 in pipe.where  # one buffer done with this step left over: depth reached


def test_a_step_starts_with_the_buffered_records_whose_writes_landed():
    # End of a step that visited ... 6, 7, 8, 9: its last three are in buffers, 9's write
    # issued last. The next step (reversed) starts with them, the landed one first, then
    # by when their write-backs were issued, so the first update waits for no write.
    pipe, _ = zigzag_pipeline([(7, True, 1), (8, False, 2), (9, False, 3)], n=10, k=1)
    pipe.steps_done = 1
    order = [p.id for p in pipe.order(1)]
    assert order == [7, 8, 9, 6, 5, 4, 3, 2, 1, 0]
    # the order is fixed for the step, whatever lands meanwhile
    pipe.slots[2].write.landed = True
    assert [p.id for p in pipe.order(1)] == order
    # without zig-zag the order is the fixed one
    pipe.zigzag = False
    pipe._order = None
    assert [p.id for p in pipe.order(1)] == list(range(10))


def test_a_buffer_holding_a_record_read_ahead_for_this_step_is_kept():
    # Updating 5 (window 5, 6) in a visit 5, 6, 7, 8, 3, 2; buffers: 6, 8 and 3 (read
    # ahead, needed this step), 0 (done with this step, its write still in flight). The
    # write is waited for rather than a record this step still needs dropped and read again.
    pipe, _ = zigzag_pipeline([(6, None, 0), (8, None, 0), (0, False, 4), (3, None, 0)],
                              n=10, k=1)
    visit = [pipe.parts[i] for i in (5, 6, 7, 8, 3, 2)]
    assert pipe.slots.index(pipe._victim(visit[:2], visit, 0)) == 2
    pipe.slots[2].write.landed = True  # landed: still the one taken
    assert pipe.slots.index(pipe._victim(visit[:2], visit, 0)) == 2


class LoggedWrite(FakeWrite):
    """A write-back in flight that notes in `log` when someone waits for it."""

    def __init__(self, pid: int, log: list) -> None:
        super().__init__(False, 2.0)
        self.pid, self.log = pid, log

    def wait(self) -> int:
        self.log.append(f"wait write {self.pid}")
        self.landed = True
        return 1


def test_a_record_is_read_again_only_once_the_write_back_a_read_follows_landed():
    # 8's buffer is taken by the read of 4, which follows 8's write-back in flight. 8 is
    # wanted again before that write has landed: reading it from the disk now could find
    # half of the new record. Its write is waited for first; the read-ahead, which never
    # waits, leaves 8 for later.
    pipe, stats = zigzag_pipeline([(0, None, 0), (1, None, 0), (8, False, 2)], n=10, k=1)
    log: list = []
    pipe.slots[2].write = LoggedWrite(8, log)
    real_read = pipe.store.read

    def read(part, buf, **kw):
        log.append(f"read {part.id}")
        return real_read(part, buf, **kw)

    pipe.store.read = read
    parts = pipe.parts
    pipe._assign(pipe.slots[2], parts[4], stats)
    assert pipe.slots[2].after_part is parts[8] and log == ["read 4"]
    order = [parts[i] for i in (0, 8, 1, 2, 3)]
    pipe._read_ahead(order, 0, stats)
    assert log == ["read 4"]  # 8 not read ahead while its write is landing
    pipe._load(parts[8], order[1:2], order, 1, stats)
    assert log[:3] == ["read 4", "wait write 8", "read 8"]
