"""StepPipeline: the order in which NVMe-homed partitions are read, updated and written back.

With B pool buffers and prefetch depth k < B:
1. before partition i is computed, reads of the next k partitions not already
   in buffers are issued into every buffer free at that moment (its write-back
   landed, its record needed later or not again this step), without waiting for
   one (the first k of a step were issued when the previous step ended);
2. partition i is computed in its buffer;
3. its write-back is issued and the loop goes on; a read into the buffer follows
   that write piece by piece (IOEngine.read(after=...)); the record is changed
   again, or read back from the disk, only after that write completed. With write-back
   deferral (scratch durability, zig-zag order), the records visited last, which
   the next step visits first while they are still in their buffers, are not
   written: the next step updates them again, and only a buffer's eviction,
   flush() or settle_writes() writes a deferred record. The step then writes as
   many records as it reads.
The order reverses every step (zig-zag), so the partitions still in buffers
at the end of a step are the first of the next and are not read again; among
those, the ones whose write-back landed or was issued first come first, so a
step run right after another does not start by waiting for the write the last
one issued last. A buffer the partition at hand must wait for is one whose
write-back has landed, chosen by next use among those (Belady): the partition
needed last, one this step no longer visits before one it still does; with
every write still in flight, the one issued first.
A partition never written yet is initialised in its buffer instead of read.
With pipeline.overlap_backward the order is the one gradients complete in
instead (`planned`, set by optim/overlap.py), visited partition by partition.
The tier manager drives it: acquire() a record, the optimizer updates it,
release() issues its write-back.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from tiermem.errors import TierMemError, TierMemIOError
from tiermem.io import Request
from tiermem.partition import Partition
from tiermem.signals import safe_point
from tiermem.swap.store import SwapStore
from tiermem.telemetry.stats import Event, StepStats, busy_seconds, timed

Views = dict[str, torch.Tensor]


@dataclass
class _Slot:
    """One pool buffer and the partition record it holds."""

    buf: torch.Tensor
    part: Partition | None = None
    read: Request | None = None  # in flight into buf
    write: Request | None = None  # in flight out of buf
    needs_init: bool = False  # part was never written: build its record, do not read
    fetched: bool = False  # read (or built) for the step being run, not left from before
    dirty: bool = False  # its write-back failed: this buffer holds the only current copy
    # Updated, its write-back not issued (the disk copy is older): written before the
    # buffer takes another record, or by flush() / settle_writes().
    deferred: bool = False
    digest: int | None = None  # the deferred record's CRC32C, when its update computed it
    # The write-back of the record buf held before `part`, still in flight: `read` follows
    # it piece by piece (IOEngine.read(after=...)), so it must land before read is used.
    after: Request | None = None
    after_part: Partition | None = None


class StepPipeline:
    """Streams NVMe partitions through a BufferPool's buffers, reads ahead, writes behind."""

    def __init__(self, store: SwapStore, buffers: Sequence[torch.Tensor],
                 parts: Sequence[Partition], *, prefetch_depth: int, zigzag: bool,
                 retries: int = 0, defer_writes: bool = False,
                 follow_writes: bool = True) -> None:
        if len(buffers) < prefetch_depth + 1:
            raise ValueError(f"{len(buffers)} buffers cannot hold prefetch_depth + 1 = "
                             f"{prefetch_depth + 1} partitions")
        self.store = store
        self.parts = list(parts)
        self.k = prefetch_depth
        self.zigzag = zigzag
        self.slots = [_Slot(b) for b in buffers]
        self.where: dict[int, _Slot] = {}
        self.fresh = {p.id for p in parts}
        self.steps_done = 0
        self.retries = retries  # times a failed transfer is reissued before it is an error
        # Scratch swap files only: a crash-consistent step must reach the disk each step.
        self.defer_writes = defer_writes
        # A read into a buffer whose write-back is in flight follows it piece by piece
        # (IOEngine.read(after=...)) instead of waiting for all of it; False waits (the
        # bench's paired measurement of what following gains).
        self.follow_writes = follow_writes
        self._visiting: tuple[Sequence[Partition], int] | None = None  # acquire's (order, i)
        self.faults_survived = 0
        self._write_errors: list[TierMemIOError] = []
        self._open_stats: list[tuple[StepStats, list[tuple[Request, int]]]] = []
        # I/O and counts of the step being run, or run ahead into.
        self._ahead = StepStats()
        self._reqs: list[tuple[Request, int]] = []  # with the partition each moves
        # Set by tiermem.optim.overlap: the visiting order the gradients dictate, in place of
        # the zig-zag one.
        self.planned: list[Partition] | None = None
        self._order: tuple[int, list[Partition]] | None = None  # (step, its order)
        self._pos: tuple[Sequence[Partition], dict[int, int]] | None = None

    def replace_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Stream through new buffers; call after flush() (nothing in flight, disk current)."""
        self.slots = [_Slot(b) for b in buffers]
        self.where.clear()
        self._order = None

    def add_partitions(self, parts: Sequence[Partition]) -> None:
        self.parts.extend(parts)
        self.fresh.update(p.id for p in parts)
        self._order = None

    def order(self, step: int) -> list[Partition]:
        if self.planned is not None:
            # The order gradients became final last step (pipeline.overlap_backward);
            # partitions not seen there yet come after, last parameter first.
            seen = {p.id for p in self.planned}
            return list(self.planned) + [p for p in reversed(self.parts) if p.id not in seen]
        if step != self.steps_done or not self.zigzag:
            return self._zigzag(step)
        # Fixed for the whole step once asked for (the end of the last step, as it runs
        # the reads ahead): every caller sees one order while the buffers change under it.
        if self._order is None or self._order[0] != step:
            self._order = (step, self._buffered_first(self._zigzag(step)))
        return list(self._order[1])

    def _zigzag(self, step: int) -> list[Partition]:
        return self.parts[::-1] if self.zigzag and step % 2 else list(self.parts)

    def _buffered_first(self, order: list[Partition]) -> list[Partition]:
        """`order` with the records still in buffers first (zig-zag puts them there
        already), among them those whose transfers landed, then those whose transfer was
        issued earliest: steps run back to back, the record the last step wrote last is
        still being written when the next one starts, and updating it first would wait
        for that write while the others are ready."""
        def issued(p: Partition) -> float:
            slot = self.where.get(p.id)
            if slot is None:
                return float("inf")
            pending = [r for r in (slot.read, slot.write) if r is not None and not r.done()]
            return max((r.interval()[0] for r in pending), default=float("-inf"))
        return sorted(order, key=issued)  # stable: zig-zag order among equals

    # -- the step --------------------------------------------------------------

    def begin_step(self, stats: StepStats) -> None:
        """Count in `stats` the reads run ahead of this step (issued as the last one ended)."""
        for tier, n in self._ahead.read_bytes.items():
            stats.add_bytes("read", tier, n)
        for tier, n in self._ahead.write_bytes.items():  # deferred records flush() wrote
            stats.add_bytes("write", tier, n)
        if stats.events is not None and self._ahead.events:
            stats.events.extend(self._ahead.events)

    def acquire(self, part: Partition, window: Sequence[Partition],
                order: Sequence[Partition], i: int, stats: StepStats) -> tuple[Views, bool]:
        """`part`'s record (= order[i]) in its buffer, read and checked: (views, fresh).

        window: `part` and the partitions after it whose buffers are not taken for it;
        order[i:]: what this step still visits, in that order (a buffer to reuse is chosen
        by it); the reads of the next prefetch_depth records not in buffers yet are issued
        into buffers free now (see _read_ahead). fresh: never
        written, so the caller builds the record instead of reading it. The caller updates
        the record, then hands it back with release()."""
        safe_point()  # a Ctrl-C leaves here: no write of this partition is half issued yet
        slot = self._load(part, window, order, i, stats)
        self._read_ahead(order, i, stats)
        self._visiting = (order, i)
        with timed(stats, "stall_seconds", f"wait p{part.id}", part.id):
            slot = self._finish_load(slot, part, window, order, i, stats)
            self._settle_write(slot)  # a failure leaves it dirty: it is the latest copy
        stats.reads_skipped += not slot.fetched
        slot.fetched = False
        return part.views(slot.buf), slot.needs_init

    def release(self, part: Partition, stats: StepStats, digest: int | None = None) -> None:
        """Issue the write-back of `part`'s record, updated since acquire(); `digest`: its
        CRC32C if the update computed it in the same pass."""
        slot = self.where[part.id]
        slot.needs_init = False
        # The record this update started from was never written: one write-back saved.
        stats.writes_deferred += slot.deferred
        if self._defer(part):
            slot.deferred, slot.digest = True, digest
        else:
            self._issue_write(slot, stats, digest=digest)
        stats.partitions["nvme"] = stats.partitions.get("nvme", 0) + 1

    def _defer(self, part: Partition) -> bool:
        """Whether `part`'s write-back can wait: it is among the last records this step
        visits, as many as there are buffers. Zig-zag makes those the next step's first,
        reached before any read needs their buffers (every read the rest of this step
        needs takes the buffer of a record visited earlier, which is needed last), so the
        next step updates them again where they are. A guess that proves wrong costs a
        write issued when the buffer is wanted (_load), never a record: nothing takes a
        deferred buffer without writing it first. An order planned from the gradients
        (overlap_backward) visits the last records last again: no deferral there."""
        if not (self.defer_writes and self.zigzag and self.planned is None
                and self._visiting is not None):
            return False
        order, i = self._visiting
        if i >= len(order) or order[i].id != part.id:
            return False
        return i >= len(order) - self._usable()

    def end_step(self, stats: StepStats, *, run_ahead: bool = True) -> None:
        """Close the step, run the next one's reads ahead (unless the caller will, with
        run_ahead()), and raise a failed write-back."""
        errors, self._write_errors = self._write_errors, []
        self._finish_step(stats)
        if run_ahead:
            self.run_ahead()
        if errors:
            # The whole step ran and its records are in buffers; say now that some of
            # them could not be written back.
            raise errors[0]

    def _finish_step(self, stats: StepStats) -> None:
        self.steps_done += 1
        self._open_stats.append((stats, self._reqs))
        self._reqs = []
        self._close_old_stats(keep=1)
        self._ahead = StepStats(step=stats.step + 1,
                                events=[] if stats.events is not None else None)

    def run_ahead(self, depth: int | None = None,
                  stop: Callable[[], bool] | None = None, in_flight: int | None = None
                  ) -> None:
        """Issue the reads of the next step's first `depth` partitions (prefetch_depth + 1
        unless said) now, before step() is called. stop() is asked before each one that
        may have to wait for a buffer (or for a read, below): True ends the run-ahead there.
        in_flight: at most this many of those reads at once, the next issued as one lands.
        The disk serves reads in the order they come: a whole fill issued at once would
        queue every read someone waits for meanwhile (a forward's weights) behind it."""
        nxt = self.order(self.steps_done)
        # A buffer whose write-back failed keeps its record: it cannot take a read.
        window = nxt[: min(self.k + 1 if depth is None else depth, self._usable())]
        reading: list[Request] = []
        for q in window:
            if q.id in self.where:
                continue
            if stop is not None and stop():
                return
            # done() never raises: a failed read is the step's to retry or report
            while in_flight is not None and len(reading) >= in_flight:
                reading = [r for r in reading if not r.done()]
                if len(reading) >= in_flight:
                    if stop is not None and stop():
                        return
                    time.sleep(0.0005)
            slot = self._load(q, window, nxt, 0, self._ahead)
            if slot.read is not None:
                reading.append(slot.read)

    # -- buffers ---------------------------------------------------------------

    def _load(self, part: Partition, window: Sequence[Partition], order: Sequence[Partition],
              i: int, stats: StepStats) -> _Slot:
        """Make sure `part`'s record is in a buffer or on its way there."""
        writing = self._leaving(part)
        if writing is not None:
            # Its write-back, which a read into its old buffer follows, must land before
            # the record is read again (a failure gives that buffer back to it).
            self._settle_followed(writing)
        slot = self.where.get(part.id)
        if slot is not None:
            return slot
        with timed(stats, "stall_seconds", f"free buffer for p{part.id}", part.id):
            while True:
                slot = self._victim(window, order, i)
                if slot.deferred:  # its record's only copy: to disk before the buffer is reused
                    self._issue_write(slot, stats, digest=slot.digest)
                self._finish_read(slot)
                # The old record must be on disk before the buffer takes another (the read
                # follows its write piece by piece); if its write failed for good the
                # buffer stays with it and another is chosen.
                if self._followable(slot) or self._settle_write(slot):
                    break
        return self._assign(slot, part, stats)

    def _assign(self, slot: _Slot, part: Partition, stats: StepStats) -> _Slot:
        """`slot` (idle, its record on disk) takes `part`: its read is issued, or it is
        marked to be built if `part` was never written."""
        follow = None
        if self._followable(slot):
            follow, slot.write = slot.write, None
            slot.after, slot.after_part = follow, slot.part
        if slot.part is not None:
            del self.where[slot.part.id]
        slot.part = part
        slot.fetched = True
        self.where[part.id] = slot
        if part.id in self.fresh:
            slot.needs_init = True
        else:
            slot.needs_init = False
            slot.read = self.store.read(part, slot.buf, after=follow)
            self._reqs.append((slot.read, part.id))
            stats.add_bytes("read", "nvme", self.store.slots[part.id].nbytes)
        return slot

    def _read_ahead(self, order: Sequence[Partition], i: int, stats: StepStats) -> None:
        """Issue the reads of the next `k` records after order[i] that are not in a buffer,
        in order, each into a buffer that is free now (its write-back landed, its record
        needed later than this one or not again this step). Never waits: the record at
        hand is ready, and a write that lands meanwhile frees a buffer for the next call.
        Records already in buffers are skipped, not counted, so the reads start as far
        ahead as the buffers allow (zig-zag leaves the first records of a step in them)."""
        pos = self._positions(order)
        pending = 0
        for j in range(i + 1, len(order)):
            if pending >= self.k:
                return
            q = order[j]
            slot = self.where.get(q.id)
            if slot is not None:
                pending += slot.read is not None and not slot.read.done()
                continue
            if self._leaving(q) is not None:
                return  # its write-back is still landing: read when it has (_load)
            victim = self._free_now(pos, i, j)
            if victim is None:
                return
            self._assign(victim, q, stats)
            pending += victim.read is not None

    def _free_now(self, pos: dict[int, int], i: int, j: int) -> _Slot | None:
        """A buffer that can take the record at order[j] without waiting: no read in
        flight, its write-back landed and good (or in flight, for the read to follow it
        piece by piece), and its record needed after position j (or not again this step).
        A landed one first, as _victim does: a read that follows a write goes no faster
        than the write. Among those, the one needed last (Belady)."""
        n = len(pos)
        best, best_key = None, (False, j)
        for s in self.slots:
            if s.dirty or s.deferred or s.read is not None:
                continue
            writing = s.write is not None and not s.write.done()
            if writing and not self.follow_writes:
                continue
            if s.part is None:
                use = float("inf")
            else:
                at = pos.get(s.part.id, -1)
                # Visited already this step (or not at all): needed next step, where
                # zig-zag visits it at about n - 1 - at.
                use = at if at >= i else 2 * n - 1 - at
            key = (not writing, use)
            if use > j and key > best_key and (writing or self._settle_write(s)):
                best, best_key = s, key
        return best

    def _usable(self) -> int:
        """Buffers that can take a record: not those keeping one whose write-back failed."""
        return sum(not s.dirty for s in self.slots)

    def _positions(self, order: Sequence[Partition]) -> dict[int, int]:
        """Partition id -> position in `order` (kept per order list: a visit asks once per
        partition)."""
        if self._pos is None or self._pos[0] is not order:
            self._pos = (order, {p.id: j for j, p in enumerate(order)})
        return self._pos[1]

    def ready_views(self, part: Partition) -> Views | None:
        """`part`'s record if it is in a buffer, read and checked, without waiting; else None
        (not loaded, read still in flight, or never written: built by init() later)."""
        slot = self.where.get(part.id)
        if slot is None or slot.needs_init:
            return None
        if slot.read is not None:
            if not slot.read.done() or (slot.after is not None and not slot.after.done()):
                return None
            self._finish_read(slot)  # checks the footer; a failure raises as compute would
            if self.where.get(part.id) is not slot:
                return None  # the write-back the read followed failed: loaded again later
        return part.views(slot.buf)

    def _victim(self, window: Sequence[Partition], order: Sequence[Partition], i: int) -> _Slot:
        keep = {p.id for p in window}
        pos = {p.id: j for j, p in enumerate(order) if j >= i}
        nxt = {p.id: len(order) + j for j, p in enumerate(self.order(self.steps_done + 1))}

        def next_use(slot: _Slot) -> float:
            if slot.part is None:
                return float("inf")
            return pos.get(slot.part.id, nxt.get(slot.part.id, float("inf")))

        free = [s for s in self.slots
                if (s.part is None or s.part.id not in keep) and not s.dirty]
        if not free:
            raise TierMemError("no pipeline buffer can be reused: the records they hold could "
                               "not be written back (see the earlier I/O error)")
        # A record this step still visits (read ahead past the window) is given up only
        # when every other buffer holds one too: waiting for a write beats reading again.
        done_with = [s for s in free if s.part is None or s.part.id not in pos]
        pool = done_with or free
        # A buffer whose write-back landed takes the read now; one still writing would hold
        # the read (and every read queued behind it) up by as much as a whole write, so the
        # disk would alternate write, read, write instead of doing both. Among the landed,
        # Belady. With none landed, the write issued first lands first.
        landed = [s for s in pool if not s.deferred and (s.write is None or s.write.done())]
        if landed:
            return max(landed, key=next_use)
        # A deferred record is written only when no write in flight frees a buffer sooner.
        writing = [s for s in pool if s.write is not None]
        if writing:
            return min(writing, key=lambda s: s.write.interval()[0])
        return max(pool, key=next_use)

    def _leaving(self, part: Partition) -> _Slot | None:
        """The buffer `part`'s record just left: its write-back in flight, a read into
        the buffer following it."""
        for s in self.slots:
            if s.after_part is not None and s.after_part.id == part.id:
                return s
        return None

    def _followable(self, slot: _Slot) -> bool:
        """Whether a read into slot's buffer can go without waiting for its write-back:
        it follows it piece by piece. A write that landed meanwhile is no dependency;
        one that failed cancels the read, and _finish_followed gives the buffer back to
        its record."""
        return self.follow_writes and slot.write is not None

    def _finish_followed(self, slot: _Slot) -> TierMemIOError | None:
        """Wait for the write-back the buffer's read follows. If it failed for good, the
        buffer holds that write's record again (its part read back from the disk), kept
        as the only current copy (dirty), and the failure is returned: the record the
        read was for is not in the buffer, and whoever wanted it loads it again."""
        if slot.after is None:
            return None
        req, old = slot.after, slot.after_part
        slot.after = slot.after_part = None
        try:
            req.wait()
            return None
        except TierMemIOError as exc:
            failure = exc
        # The engine stopped the read where the write stopped: the buffer holds the new
        # record's first `landed` bytes (those of the old one reached the disk) and the
        # old record's bytes after them.
        if slot.read is not None:
            read, slot.read = slot.read, None
            try:
                read.wait()
            except TierMemIOError:
                pass  # cancelled (ECANCELED), as said: nothing of it is used
        self.where.pop(slot.part.id, None)
        slot.part, slot.needs_init, slot.fetched = old, False, False
        self.where[old.id] = slot
        self._restore(slot, req.landed, failure)
        # Now as a write-back that failed (_finish_write): reissued up to `retries` times,
        # else the buffer keeps the record for flush() to try again.
        if self.retries == 0:
            slot.dirty = True
            return failure
        slot.write = self.store.rewrite(old, slot.buf)
        try:
            self._finish_write(slot, retries=self.retries - 1)
        except TierMemIOError as exc:
            return exc
        self.faults_survived += 1
        return None

    def _settle_followed(self, slot: _Slot) -> None:
        """_finish_followed, its failure kept for the end of the step (as _settle_write)."""
        failure = self._finish_followed(slot)
        if failure is not None:
            self._write_errors.append(failure)

    def _restore(self, slot: _Slot, landed: int, failure: TierMemIOError) -> None:
        """Read back into slot's buffer the first `landed` bytes of its record, which the
        failed write had sent before a read that followed it took their memory."""
        if not landed:
            return
        for attempt in range(self.retries + 1):  # read again as any failed read is
            try:
                self.store.read(slot.part, slot.buf, nbytes=landed).wait()
                self.faults_survived += attempt
                return
            except TierMemIOError as exc:
                last = exc
        self.where.pop(slot.part.id, None)
        lost, slot.part = slot.part, None
        raise TierMemError(
            f"the optimizer state of partition {lost.id} is lost: its write-back failed "
            f"({failure}) after its first {landed} bytes reached the disk and a read had "
            f"reused their memory, and reading them back failed too ({last})") from last

    def _finish_load(self, slot: _Slot, part: Partition, window: Sequence[Partition],
                     order: Sequence[Partition], i: int, stats: StepStats) -> _Slot:
        """Wait for `part`'s read into `slot` (from _load) and check it; the buffer that
        holds `part` then. If the write-back the read followed failed, the buffer went back
        to that write's record and `part` is loaded again."""
        self._finish_read(slot)
        while self.where.get(part.id) is not slot:
            slot = self._load(part, window, order, i, stats)
            self._finish_read(slot)
        return slot

    def _finish_read(self, slot: _Slot) -> None:
        # A record built in the buffer (never written) waits for the old one's write too.
        self._settle_followed(slot)
        if slot.read is None:
            return
        req, slot.read = slot.read, None
        for attempt in range(self.retries + 1):
            try:
                # waits for the read, hashing the record as it lands
                self.store.verify(slot.part, slot.buf, landing=req)
                self.faults_survived += attempt
                return
            except TierMemError:
                if attempt == self.retries:
                    self._forget(slot)
                    raise
                # The record on disk is still the good one: read it again.
                req = self.store.read(slot.part, slot.buf)
            except BaseException:
                self._forget(slot)
                raise

    def _forget(self, slot: _Slot) -> None:
        """The buffer holds a partial record: make sure nothing uses it."""
        del self.where[slot.part.id]
        slot.part = None

    def _finish_write(self, slot: _Slot, *, retries: int | None = None) -> None:
        """Wait for slot's write-back, reissuing it up to `retries` times (default: the
        pipeline's); on failure the buffer is left dirty and the error raised."""
        if slot.write is None:
            return
        req, slot.write = slot.write, None
        try:
            self.faults_survived += self.store.finish_write(
                slot.part, slot.buf, req,
                retries=self.retries if retries is None else retries)
        except TierMemIOError:
            # The buffer keeps the only current copy; it is never reused for another
            # partition and flush() tries the write again.
            slot.dirty = True
            raise
        slot.dirty = False

    def _settle_write(self, slot: _Slot) -> bool:
        """Finish slot's write-back; a failure is kept for the end of the step. True unless
        that write failed (a deferred record, never written yet, is not on disk either:
        _load writes it before the buffer is reused)."""
        try:
            self._finish_write(slot)
        except TierMemIOError as exc:
            self._write_errors.append(exc)
        return not slot.dirty

    def _issue_write(self, slot: _Slot, stats: StepStats, digest: int | None = None) -> None:
        slot.deferred, slot.digest = False, None
        slot.write = self.store.write(slot.part, slot.buf, digest=digest)
        self.fresh.discard(slot.part.id)
        self._reqs.append((slot.write, slot.part.id))
        stats.add_bytes("write", "nvme", self.store.slots[slot.part.id].nbytes)

    # -- whole-record access (checkpoints, import/export) -----------------------

    @contextmanager
    def record(self, part: Partition, *, write: bool) -> Iterator[tuple[Views, bool]]:
        """`part`'s record in a buffer as (views, fresh); written back after the block if
        `write` and the block did not raise."""
        stats = StepStats()
        slot = self._load(part, [part], [part], 0, stats)
        slot = self._finish_load(slot, part, [part], [part], 0, stats)
        self._finish_write(slot)
        yield part.views(slot.buf), slot.needs_init
        if write:
            slot.needs_init = False
            self._issue_write(slot, stats)

    def settle_writes(self) -> None:
        """Every write-back issued so far is on disk (raises the first that fails); reads
        in flight, the next step's run-ahead, go on."""
        self._write_deferred()
        for slot in self.slots:
            failure = self._finish_followed(slot)
            if failure is not None:
                raise failure
            if slot.dirty and slot.write is None:
                slot.write = self.store.rewrite(slot.part, slot.buf)  # the disk may be back
            self._finish_write(slot)

    def flush(self) -> None:
        """Every write-back on disk (raises the first that fails); reads in flight are
        finished, and a failed one only dropped: its record is still on disk."""
        self._write_deferred()
        for slot in self.slots:
            try:
                self._finish_read(slot)
            except TierMemError:
                pass  # _finish_read forgot the slot; nothing of the state was in it
            if slot.dirty and slot.write is None:
                slot.write = self.store.rewrite(slot.part, slot.buf)  # the disk may be back
            self._finish_write(slot)
        self._close_old_stats(keep=0)

    def deferred_bytes(self) -> int:
        """Bytes of the records whose write-back is deferred: what flush() will write."""
        return sum(self.store.slots[s.part.id].nbytes for s in self.slots if s.deferred)

    def _write_deferred(self) -> None:
        """Issue the write-back of every deferred record (all at once: the disk takes them
        together); counted in the bytes of the next step, as the run-ahead's reads are."""
        for slot in self.slots:
            if slot.deferred:
                self._issue_write(slot, self._ahead, digest=slot.digest)

    def _close_old_stats(self, keep: int) -> None:
        while len(self._open_stats) > keep:
            stats, reqs = self._open_stats.pop(0)
            for r, _ in reqs:
                r._settle()
            spans = [(r, pid, *r.interval()) for r, pid in reqs if r.nbytes]
            stats.io_seconds = busy_seconds([(a, b) for _, _, a, b in spans])
            if stats.events is not None:
                stats.events.extend(Event(f"nvme {r.op}", f"{r.op} p{pid}", a, b, stats.step, pid)
                                    for r, pid, a, b in spans)
