"""Per-step counters and timers: what moved, how fast, and how long the step waited."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import ContextManager, Iterator

import torch
from torch.autograd.profiler import record_function


TRACKS = {
    "step_seconds": "step",
    "update_seconds": "host optimizer",
    "transfer_seconds": "host<->device",
    "stall_seconds": "stall",
}


@dataclass
class Event:
    """One span on a timeline track (time.monotonic() seconds)."""

    track: str  # "nvme read", "nvme write", "host optimizer", "host<->device", "stall", "step"
    name: str  # e.g. "read p12"
    start: float
    end: float
    step: int
    partition: int | None = None


@dataclass
class StepStats:
    """Figures of one optimizer step."""

    step: int = 0
    step_seconds: float = 0.0
    update_seconds: float = 0.0  # host/device Adam arithmetic
    transfer_seconds: float = 0.0  # host<->device copies (grads in, weights out)
    stall_seconds: float = 0.0  # waiting on NVMe reads/writes
    read_bytes: dict[str, int] = field(default_factory=dict)  # per tier
    write_bytes: dict[str, int] = field(default_factory=dict)
    io_seconds: float = 0.0  # wall time NVMe transfers of this step were in flight
    partitions: dict[str, int] = field(default_factory=dict)  # updated, per tier
    reads_skipped: int = 0  # NVMe partitions found still in a buffer
    writes_deferred: int = 0  # NVMe write-backs saved: a record updated again in its buffer
    early_partitions: int = 0  # updated during backward, before step() (overlap_backward)
    update_threads: int = 0  # threads of the step's native updates (optimizer.update_threads)
    # Host<->device copies of the lanes (tiermem/device_lanes.py): bytes, and the time the
    # copy streams spent on them (device-timed on CUDA).
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_seconds: float = 0.0
    d2h_seconds: float = 0.0
    events: list[Event] | None = None  # timeline spans, when recording was asked for

    @property
    def read_gbps(self) -> float:
        return sum(self.read_bytes.values()) / self.io_seconds / 1e9 if self.io_seconds else 0.0

    @property
    def write_gbps(self) -> float:
        return sum(self.write_bytes.values()) / self.io_seconds / 1e9 if self.io_seconds else 0.0

    @property
    def h2d_gbps(self) -> float:
        return self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds else 0.0

    @property
    def d2h_gbps(self) -> float:
        return self.d2h_bytes / self.d2h_seconds / 1e9 if self.d2h_seconds else 0.0

    @property
    def overlap(self) -> float:
        """1 - stall / I/O time: the share of NVMe transfer time hidden behind work."""
        if not self.io_seconds:
            return 1.0
        return max(0.0, 1.0 - self.stall_seconds / self.io_seconds)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("events")
        d.update(read_gbps=self.read_gbps, write_gbps=self.write_gbps, overlap=self.overlap,
                 h2d_gbps=self.h2d_gbps, d2h_gbps=self.d2h_gbps)
        return d

    def add_bytes(self, kind: str, tier: str, n: int) -> None:
        table = self.read_bytes if kind == "read" else self.write_bytes
        table[tier] = table.get(tier, 0) + n


@contextmanager
def timed(stats: StepStats, name: str, label: str | None = None,
          partition: int | None = None, track: str | None = None) -> Iterator[None]:
    """Add the wall time of the block to `stats.<name>`; with recording on, also an Event
    (on `track`, else the one `name` belongs to)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        t1 = time.monotonic()
        setattr(stats, name, getattr(stats, name) + t1 - t0)
        if stats.events is not None:
            stats.events.append(Event(track or TRACKS[name], label or TRACKS[name], t0, t1,
                                      stats.step, partition))


def update_range(partition: int | str) -> ContextManager[object]:
    """The range `tiermem.update p<N>` a torch profiler shows for one partition's update
    (given a label, `tiermem.<label>`: several updated together): a record_function while
    a profiler is on, else nothing (entering one costs ~10 us, a few hundred per step on a
    small-partition run that no one is profiling)."""
    if torch._C._autograd._profiler_enabled():
        return record_function(f"tiermem.update p{partition}" if isinstance(partition, int)
                               else f"tiermem.{partition}")
    return nullcontext()


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time with at least one transfer in flight."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
