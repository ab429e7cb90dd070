"""The weight all-gather of one ZeRO step, started window by window as the update goes.

A window (share offsets [a, b) of one param group, the same offsets on every rank)
can be gathered as soon as this rank's partitions covering it are updated: the step
loop calls `updated(part)` after each partition (OffloadedOptimizer.after_update),
and the windows whose partitions are all done are packed and launched, so the
collective runs while later partitions are read, updated and written back. The
update never blocks on a collective: a window whose turn came while all SLOTS are
in flight is launched at a later partition, once a slot's collective completed, or
by `finish()`, which also waits for the rest.

Every rank must issue the same collectives in the same order, whatever order its
own partitions finish in, so windows are launched strictly in a fixed order: share
order, reversed on the steps the pipeline walks its partitions backwards (zig-zag),
so the first window is also the first to be ready. A window waits for the ones
before it. All the gradients are in before the update starts, so nothing else is
issued on the group between the first and the last window of a step.

A failed wait (a peer died or raised) must not abort the update half-way: that would
leave this rank's share half stepped. The error is kept, nothing more is issued, and
`finish()` raises it once the update is complete.

stats: comm_seconds (packing, launching, unpacking and waiting), comm_wait_seconds
(blocked on a collective), comm_bytes, and this direction's own part of the first two,
weights_seconds and weights_wait_seconds; windows_early (windows launched while the
update still ran).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Sequence

from tiermem.partition import Partition
from tiermem.dist.shard import spans

SLOTS = 3  # staging buffers per direction: windows in flight at once


class WeightGather:
    """One step's all-gather of this rank's updated pieces into every rank's parameters."""

    def __init__(self, layout: Any, covers: dict[int, list[int]], active: Sequence[Partition],
                 backwards: bool, stats: dict,
                 synced: Callable[[int, int, int], None] | None = None) -> None:
        self.lay = layout
        # told (shadow parameter, version before, after) of each parameter the unpacking
        # wrote other ranks' pieces into (OffloadedOptimizer.weights_synced)
        self.synced = synced
        self.covers = covers  # partition id -> the windows it has elements in
        self.stats = stats
        self.order = list(range(len(layout.windows)))
        if backwards:
            self.order.reverse()
        # Partitions still to be updated, per window; inactive ones change no weight.
        self.pending = [0] * len(layout.windows)
        for part in active:
            for w in covers.get(part.id, ()):
                self.pending[w] += 1
        self.next = 0  # position in self.order of the next window to launch
        self.launched = 0
        self.inflight: deque = deque()  # (work, window, recv), oldest first
        self.error: BaseException | None = None

    def updated(self, part: Partition) -> None:
        """`part` is updated: launch every window now complete (in order)."""
        if self.error is not None:
            return
        t0 = time.monotonic()
        try:
            for w in self.covers.get(part.id, ()):
                self.pending[w] -= 1
            # Never block the update here: unpack what has arrived, launch what fits in the
            # free slots; a ready window waits for a slot until the next partition or finish().
            while self.inflight and self.inflight[0][0].is_completed():
                self._unpack(*self.inflight.popleft())
            before = self.launched
            self._launch_ready(block=False)
            self.stats["windows_early"] += self.launched - before
        except Exception as exc:  # kept for finish(): the update must run to its end
            self.error = exc
        self._spent("seconds", time.monotonic() - t0)

    def _spent(self, what: str, seconds: float) -> None:
        self.stats["comm_" + what] += seconds
        self.stats["weights_" + what] += seconds

    def finish(self) -> None:
        """Launch what is left, unpack everything; raise a failure kept from the step."""
        t0 = time.monotonic()
        try:
            if self.error is None:
                left = [w for w in self.order[self.next:] if self.pending[w]]
                if left:
                    raise RuntimeError(f"windows {left} still wait for partitions the step "
                                       "did not update (a step-loop bug)")
                self._launch_ready()
                while self.inflight:
                    self._unpack(*self.inflight.popleft())
        finally:
            self._spent("seconds", time.monotonic() - t0)
        if self.error is not None:
            raise self.error

    def _launch_ready(self, block: bool = True) -> None:
        while self.next < len(self.order) and not self.pending[self.order[self.next]]:
            if not block and len(self.inflight) == SLOTS:
                return
            self._launch(self.order[self.next])
            self.next += 1

    def _launch(self, w: int) -> None:
        lay = self.lay
        g, a, b = lay.windows[w]
        n = b - a
        slot = self.launched % SLOTS
        if len(self.inflight) == SLOTS:
            # The oldest window used this slot: its send buffer is free, and its recv buffer
            # may be refilled, only once that collective completed and was unpacked.
            self._unpack(*self.inflight.popleft())
        send = lay._buffer(lay.dtypes[g], slot, "wsend", n)
        recv = lay._buffer(lay.dtypes[g], slot, "wrecv", lay.coll.world * n)
        for index, start, length, o in spans(lay.pieces[g], a, b):
            send[o: o + length].copy_(lay._flat(index)[start: start + length])
        self.inflight.append((lay.coll.all_gather(recv, send), w, recv))
        self.launched += 1
        self.stats["comm_bytes"] += recv.numel() * recv.element_size()

    def _unpack(self, work: Any, w: int, recv: Any) -> None:
        """Other ranks' pieces of window w into this rank's parameters (its own were updated
        in place; the update never writes another rank's pieces, so this runs beside it)."""
        lay = self.lay
        t0 = time.monotonic()
        lay.coll.wait(work, "the weight all-gather")
        self._spent("wait_seconds", time.monotonic() - t0)
        g, a, b = lay.windows[w]
        n = b - a
        for r in range(lay.coll.world):
            if r == lay.coll.rank:
                continue
            slot = recv[r * n: (r + 1) * n]
            for index, start, length, o in spans(lay.shares[g].pieces(r), a, b):
                flat = lay._flat(index)
                before = flat._version
                flat[start: start + length].copy_(slot[o: o + length])
                mine = lay.shadow_index.get(index)
                if mine is not None and self.synced is not None:
                    # this rank's own piece of the parameter shares its version counter
                    self.synced(mine, before, flat._version)
