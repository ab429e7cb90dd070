"""How many threads tiermem's native update pass takes, decided step by step.

An NVMe-bound step's updates run beside the I/O engine's threads, which submit and reap
the transfers and take the disk's completions. With all of torch's threads in the update
on a machine of few cores, those wait for a core, and the disk idles meanwhile. On the
2-core development VM (docs/dev/benchmarks.md, "The update's thread count on an
NVMe-bound step"), one update thread of two made the 300M SGD-momentum step on NVMe
0.93-0.96x as long (paired with every thread, block by block), but Adagrad's and AdamW's
about as long (their passes compute more per byte and lose more on one thread), and the
int8 AdamW step, whose update is the larger part of it, 1.30x. No fixed count is right
for every rule and machine, and one step's time moves by 10-20% with the disk, so
`optimizer.update_threads: 0` measures the two counts on the run's own steps, in pairs,
and lets the pairs add up:

- a step is transfer-bound when it waited on NVMe longer than its updates ran, or, on one
  thread fewer, at least a quarter as long. Only such steps are measured: an update-bound
  step (int8 Adam's, a host-tier run's) never tries one thread fewer. Nor is a step that
  read nothing from NVMe (a run's first, whose records are built in the buffers): no read
  of it met the update, and a pair opened on its few milliseconds outweighed every pair
  after it;
- a measurement alternates the counts step by step, PAIRS pairs of a step on every thread
  and the next on one fewer (adjacent steps see the same disk), and adds each pair's
  log(time on one fewer / time on every thread) to the evidence, of which what earlier
  measurements left keeps the weight KEEP each time: one thread fewer is kept while the
  evidence is below zero (every thread on a tie), for REVISIT steps, then the counts are
  measured again, so a wrong choice fades and a change in the machine is followed;
- a step on one fewer that is not transfer-bound (the update has become the bound) ends
  the measurement: every thread for REVISIT steps.

An update with no transfer under way beside it takes every thread even on a step that runs
on one fewer: with deferred write-back a step's first update comes before any write can
start and its last after the last read landed, and the disk waits for both (on the 2-core
VM, 300M parameters: the step 0.98-0.99x as long, docs/dev/benchmarks.md, seventeenth
session). A step's reported count is the one beside transfers.

A measurement runs PAIRS of every REVISIT + 2 PAIRS steps on the count that is slower.
The thread count never changes the results: the native kernels' threads split a pass
into chunks of whole elements, and every CRC is assembled in the same order.
"""

from __future__ import annotations

import math

import torch

from tiermem.kernels.native_rules import native_threads
from tiermem.telemetry.stats import StepStats

BOUND_FULL = 1.0  # stall / update above which a step on every thread is transfer-bound
BOUND_REDUCED = 0.25  # ... and at or above which one on a thread fewer still is
PAIRS = 4  # pairs of steps (every thread, one fewer) per measurement
REVISIT = 50  # steps a choice is kept before the counts are measured again
KEEP = 0.8  # weight the evidence of earlier measurements keeps at each new one


class UpdateThreads:
    """The thread count of the next step's native updates (None: torch's own count)."""

    def __init__(self, setting: int) -> None:
        self.setting = int(setting)
        self.reduced = False  # the next step runs on one thread fewer
        # sum of log(step time on one fewer / on every thread) over the pairs measured,
        # earlier measurements weighted down by KEEP each: below zero, one fewer is faster
        self.evidence = 0.0
        self._left = 0  # steps the choice is still kept for; 0: measuring
        self._measure()

    def current(self, *, disk_idle: bool = False) -> int | None:
        """The count of an update about to run; `disk_idle`: no transfer is under way.
        One thread fewer leaves a core to the I/O engine's transfers, so an update with
        none beside it (a step's first, before any record is written back, and its last,
        after the last read landed) takes every thread: the disk waits for it alone."""
        if self.setting > 0:
            return self.setting
        n = torch.get_num_threads()
        return n - 1 if self.reduced and n > 1 and not disk_idle else None

    def count(self) -> int:
        """The number the native kernels run on beside transfers (what a step reports)."""
        return native_threads(self.current())

    def observe(self, stats: StepStats) -> None:
        """Take a finished step's figures into the next step's choice (auto only)."""
        if (self.setting > 0 or stats.update_seconds <= 0 or stats.step_seconds <= 0
                or not stats.read_bytes.get("nvme") or torch.get_num_threads() < 2):
            return
        if self._left > 0:
            self._left -= 1
            if self._left == 0:
                self._measure()
            return
        waited = stats.stall_seconds / stats.update_seconds
        if not self.reduced:
            # a step on every thread opens a pair, if it waited on NVMe
            self._full = stats.step_seconds if waited > BOUND_FULL else None
            self.reduced = self._full is not None
            return
        if waited < BOUND_REDUCED:  # the update is the bound on one thread fewer
            self._hold(False)
            return
        self._pairs.append(math.log(stats.step_seconds / self._full))
        self.reduced, self._full = False, None
        if len(self._pairs) >= PAIRS:
            self.evidence = KEEP * self.evidence + sum(self._pairs)
            self._hold(self.evidence < 0)

    def _measure(self) -> None:
        """Start a measurement: its first step on every thread."""
        self.reduced = False
        self._pairs: list[float] = []  # this measurement's log ratios
        self._full: float | None = None  # the open pair's step time on every thread

    def _hold(self, reduced: bool) -> None:
        self._measure()  # (what a measurement gathered is spent)
        self.reduced, self._left = reduced, REVISIT
