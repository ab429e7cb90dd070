"""How many threads tiermem's native update pass takes, decided step by step.

An NVMe-bound step's updates run beside the I/O engine's threads, which submit and reap
the transfers and take the disk's completions. With all of torch's threads in the update
on a machine of few cores, those wait for a core, and the disk idles meanwhile. On the
2-core development VM (docs/dev/benchmarks.md, "The update's thread count on an
NVMe-bound step"), one update thread of two made the SGD-momentum step 0.93-0.94x as
long, but Adagrad's 0.99-1.07x and AdamW's 1.01x (their passes compute more per byte and
lose more on one thread), and the int8 step, whose update is the larger part of it, 1.30x.
No fixed count is right for every rule and machine, so `optimizer.update_threads: 0`
measures which is faster, on the run's own steps:

- a step is transfer-bound when it waited on NVMe longer than its updates ran, or, on one
  thread fewer, at least a quarter as long (the figures decide which count is faster; the
  bound only keeps update-bound steps, as int8 Adam's or a host-tier run's, from trying);
- after TRIAL transfer-bound steps on every thread, TRIAL steps run on one fewer; the
  count whose median step time is lower (every thread on a tie) is kept for REVISIT
  steps, then both are measured again, as the disk and the rest of the machine drift;
- a step that is not transfer-bound ends any measurement: every thread, and on one
  fewer (the update has become the bound) for REVISIT steps at least.

A wrong choice costs at most TRIAL of every REVISIT + 2 TRIAL steps' difference. The
thread count never changes the results: the native kernels' threads split a pass into
chunks of whole elements, and every CRC is assembled in the same order.
"""

from __future__ import annotations

import statistics

import torch

from tiermem.telemetry.stats import StepStats

BOUND_FULL = 1.0  # stall / update above which a step on every thread is transfer-bound
BOUND_REDUCED = 0.25  # ... and at or above which one on a thread fewer still is
TRIAL = 3  # steps measured at each count before choosing
REVISIT = 50  # steps a choice is kept before both counts are measured again


class UpdateThreads:
    """The thread count of the next step's native updates (None: torch's own count)."""

    def __init__(self, setting: int) -> None:
        self.setting = int(setting)
        self.reduced = False  # the next step runs on one thread fewer
        self._plan = [False, True]  # counts still to measure, the current one first
        self._times: dict[bool, list[float]] = {}  # step seconds measured at each
        self._left = 0  # steps the choice is kept for (when nothing is measured)

    def current(self) -> int | None:
        if self.setting > 0:
            return self.setting
        n = torch.get_num_threads()
        return n - 1 if self.reduced and n > 1 else None

    def count(self) -> int:
        """The number the native kernels run on now."""
        got = self.current()
        return max(1, torch.get_num_threads()) if got is None else got

    def observe(self, stats: StepStats) -> None:
        """Take a finished step's figures into the next step's choice (auto only)."""
        if self.setting > 0 or stats.update_seconds <= 0:
            return
        waited = stats.stall_seconds / stats.update_seconds
        bound = waited >= BOUND_REDUCED if self.reduced else waited > BOUND_FULL
        if not bound:
            if self.reduced:  # the update is the bound now: keep every thread a while
                self._hold(False)
            else:
                self._measure()
            return
        if not self._plan:
            self._left -= 1
            if self._left <= 0:
                self._measure(first=self.reduced)
            return
        got = self._times.setdefault(self.reduced, [])
        got.append(stats.step_seconds)
        if len(got) < TRIAL:
            return
        self._plan.pop(0)
        if self._plan:
            self.reduced = self._plan[0]
            return
        t = self._times
        self._hold(statistics.median(t[True]) < statistics.median(t[False]))

    def _measure(self, first: bool = False) -> None:
        self.reduced, self._plan, self._times = first, [first, not first], {}

    def _hold(self, reduced: bool) -> None:
        self.reduced, self._plan, self._times, self._left = reduced, [], {}, REVISIT
