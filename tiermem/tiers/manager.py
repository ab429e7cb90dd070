"""TierManager: where each partition's record lives, and the order a step visits them.

Records of GPU- and host-tier partitions stay resident (device memory; pinned
host memory). NVMe-tier records live in swap files and stream through a
BufferPool driven by a StepPipeline. A step updates the resident partitions
first, while the reads the pipeline issued at the end of the previous step
are landing, then streams the NVMe partitions.

In crash-consistent mode every record also lives on disk, resident ones too:
a host-tier record is written through after its update, and `commit()` ends a
step by waiting for every write, flushing the disk and writing the manifest
that names the copy of each record making up that step.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from tiermem.io.buffers import BufferPool, aligned_empty
from tiermem.config import Settings
from tiermem.swap.integrity import FOOTER_BYTES
from tiermem.io import IOEngine, Request
from tiermem.partition import Partition
from tiermem.signals import deferred, safe_point
from tiermem.tiers.pipeline import StepPipeline, Views
from tiermem.errors import TierMemError, TierMemIOError
from tiermem.swap.manifest import (PREVIOUS, RESIDENT_FILE, VERSION, Manifest, layout_of,
                                    write_manifest)
from tiermem.swap import fsops
from tiermem.swap.store import SwapStore
from tiermem.swap.rundir import remove_run_dir, run_dirs
from tiermem.telemetry.stats import StepStats



@dataclass
class Ready:
    """A record handed out by TierManager.visit(), in host or device memory, to update."""

    part: Partition
    views: Views
    fresh: bool  # never written: build it (zero state) before the update, do not read it
    following: Partition | None  # visited next in this visit: its record may be staged
    released: bool = False  # set by TierManager.release()


class TierManager:
    """Owns every partition record: resident ones, swap files, buffers and the pipeline."""

    def __init__(self, parts: Sequence[Partition], settings: Settings, *,
                 swap_name: str, resume: Manifest | None = None,
                 keep_previous: bool = False) -> None:
        self.settings = settings
        self.swap_name = swap_name
        self._resume = resume
        self.crash = settings.swap.durability == "crash_consistent"
        # Crash-consistent under torch.distributed: each commit first keeps the one before
        # (manifest.PREVIOUS), written from memory, so a rank can go back one step.
        self.keep_previous = keep_previous
        self._committed: Manifest | None = resume
        # Crash-consistent mode: resident records written since the last commit, and
        # resident records changed outside a step that still need writing.
        self._resident_writes: dict[int, Request] = {}
        self._unwritten: set[int] = set()
        self.resident_faults_survived = 0  # write-throughs that succeeded when reissued
        self.parts: list[Partition] = []
        self._by_id: dict[int, Partition] = {}
        self.resident: dict[int, torch.Tensor] = {}
        self._views: dict[int, Views] = {}  # resident records' views (_resident_views)
        self.fresh: set[int] = set()
        self.engine: IOEngine | None = None
        self.store: SwapStore | None = None
        self.pool: BufferPool | None = None
        self.pipeline: StepPipeline | None = None
        try:
            self.add(parts)
            if resume is not None:
                self._load_resident(resume)
        except BaseException:
            # A failed resume must leave the kept state untouched.
            self.close(remove_swap=resume is None)
            raise

    # -- placement -------------------------------------------------------------

    def add(self, parts: Sequence[Partition]) -> None:
        """Give records to new partitions (tiers already assigned)."""
        if self.crash and any(p.tier == "gpu" for p in parts):
            raise TierMemError("swap.durability: crash_consistent does not support the gpu tier "
                               "yet (its records would need a host copy every step); set "
                               "tiers.gpu.capacity: 0 or use durability scratch")
        # Crash-consistent resident records carry their footer too: they are written as is.
        footer = FOOTER_BYTES if self.crash and self.settings.swap.checksums else 0
        for p in parts:
            if p.tier == "host":
                # Pinned so a device copy from it is async; allocated once, kept.
                self.resident[p.id] = aligned_empty(p.record_bytes + footer)
            elif p.tier == "gpu":
                self.resident[p.id] = torch.empty(p.record_bytes, dtype=torch.uint8,
                                                  device="cuda")
            if p.tier != "nvme":
                self.fresh.add(p.id)  # NVMe partitions: the pipeline tracks its own
        nvme = [p for p in parts if p.tier == "nvme"]
        on_disk = list(parts) if self.crash else nvme
        placed = self.store.placement() if self.store is not None else None
        try:
            if on_disk:
                self._add_to_store(on_disk)
            if nvme:
                self._add_to_pipeline(nvme)
        except BaseException:
            # refused (no room on disk, no memory for larger buffers): placed nowhere, so
            # that a retry places them where a resume looks for them
            if self.store is not None:
                self.store.restore_placement(placed)
            raise
        self.parts.extend(parts)
        self._by_id.update((p.id, p) for p in parts)

    def _add_to_store(self, parts: Sequence[Partition]) -> None:
        s = self.settings
        if self.store is None:
            self.engine = IOEngine(s.io.backend, s.io.queue_depth, s.io.block_size)
            self.store = SwapStore(self.engine, s.swap.paths, self.swap_name, parts,
                                   direct=s.io.o_direct, resume=self._resume is not None,
                                   checksums=s.swap.checksums, copies=2 if self.crash else 1)
            if self._resume is not None:
                self.store.restore(records_of(self._resume))
            return
        if self.pipeline is not None:
            self.pipeline.flush()  # every buffer idle: the disk copy of each record is current
        self.store.add(parts)

    def _add_to_pipeline(self, nvme: Sequence[Partition]) -> None:
        s = self.settings
        size = max(p.record_bytes for p in nvme) + self.store.footer
        if self.pipeline is None:
            self.pool = BufferPool(s.pipeline.buffer_count, size, engine=self.engine)
            self.pipeline = StepPipeline(self.store, self.pool.buffers, nvme,
                                         prefetch_depth=s.pipeline.prefetch_depth,
                                         zigzag=s.pipeline.zigzag, retries=s.io.retries,
                                         defer_writes=s.defers_writes)
            if self._resume is not None:
                self.pipeline.fresh &= set(self._resume.fresh)
            self.pipeline.run_ahead()
            return
        if size > self.pool.nbytes:
            # Bigger records than the first groups had: new, larger buffers (the pipeline
            # was flushed when the store grew, so nothing is in flight in the old ones).
            self.pool = BufferPool(s.pipeline.buffer_count, size, engine=self.engine)
            self.pipeline.replace_buffers(self.pool.buffers)
        self.pipeline.add_partitions(nvme)

    @property
    def faults_survived(self) -> int:
        """NVMe transfers that failed and succeeded when reissued (io.retries)."""
        pipeline = self.pipeline.faults_survived if self.pipeline is not None else 0
        return pipeline + self.resident_faults_survived

    def tier_bytes(self) -> dict[str, int]:
        out = {"gpu": 0, "host": 0, "nvme": 0}
        for p in self.parts:
            out[p.tier] += p.record_bytes
        return out

    @property
    def pinned_bytes(self) -> int:
        host = sum(t.numel() for t in self.resident.values() if t.device.type == "cpu")
        return host + (self.pool.mapped_bytes if self.pool else 0)

    # -- steps -----------------------------------------------------------------

    def begin_step(self, stats: StepStats) -> None:
        """Count in `stats` the reads run ahead of the step about to run."""
        if self.pipeline is not None:
            self.pipeline.begin_step(stats)

    def end_step(self, stats: StepStats, *, run_ahead: bool = True) -> None:
        """Close the step: run the next one's reads ahead (unless the caller will, with
        run_ahead()), raise a write-back that failed for good."""
        if self.pipeline is not None:
            self.pipeline.end_step(stats, run_ahead=run_ahead)

    def run_ahead(self, *, fill: bool = False, stop: Callable[[], bool] | None = None) -> None:
        """Issue the next step's first reads now: prefetch_depth + 1 of them, or into every
        buffer with `fill`, then with one I/O queue's worth of them in flight at a time
        (io.queue_depth x io.block_size, one read at least): the disk stays as busy, and
        a read issued meanwhile (a forward's weights) waits behind that much, not behind
        every buffer; stop() is asked before each one that may wait."""
        if self.pipeline is None:
            return
        if not fill:
            self.pipeline.run_ahead(stop=stop)
            return
        io = self.settings.io
        record = self.pipeline.slots[0].buf.numel()
        self.pipeline.run_ahead(depth=len(self.pipeline.slots), stop=stop,
                                in_flight=max(1, io.queue_depth * io.block_size // record))

    def nvme_order(self) -> list[Partition]:
        """The NVMe partitions in the order the step being run visits them."""
        return self.pipeline.order(self.pipeline.steps_done) if self.pipeline else []

    def plan_order(self, planned: Sequence[Partition] | None, *, run_ahead: bool = False
                   ) -> None:
        """Visit NVMe partitions in `planned` order from the next step on (the order
        gradients come in); partitions it leaves out come after, last first."""
        if self.pipeline is not None:
            self.pipeline.planned = None if planned is None else list(planned)
            if run_ahead:
                self.pipeline.run_ahead()

    def order(self, active: Callable[[Partition], bool]) -> list[Partition]:
        """The partitions `active` picks, in the order this step visits them: resident ones
        (their records are at hand while the NVMe reads run ahead land), then NVMe ones in
        the pipeline's order (zig-zag, or the order gradients came in)."""
        resident = [p for p in self.parts if p.tier != "nvme" and active(p)]
        if self.pipeline is None:
            return resident
        return resident + [p for p in self.pipeline.order(self.pipeline.steps_done)
                           if active(p)]

    def visit(self, parts: Sequence[Partition], stats: StepStats, *,
              done: Sequence[Partition] = (), ahead: Sequence[Partition] = ()
              ) -> Iterator[Ready]:
        """Yield each of `parts`, in that order, as a record ready to update; the caller
        updates it and hands it back with release() before asking for the next.

        Reads of the NVMe partitions after the current one are in flight while it is
        updated. done: NVMe partitions this step already visited; ahead: NVMe partitions
        expected after `parts` (read ahead too). A visit abandoned by an exception issues
        no write for the record it was on."""
        seen = {p.id for p in parts}
        nvme = [p for p in parts if p.tier == "nvme"]
        order = [*done, *nvme, *(p for p in ahead if p.id not in seen)]
        i = len(done)
        k = self.pipeline.k if self.pipeline is not None else 0
        for n, part in enumerate(parts):
            # Only a partition of this visit: one merely expected `ahead` may not have its
            # gradients yet (updates during backward), so nothing of it may be staged.
            following = parts[n + 1] if n + 1 < len(parts) else None
            if part.tier == "nvme":
                views, fresh = self.pipeline.acquire(part, order[i: i + k + 1], order, i,
                                                     stats)
                i += 1
            else:
                safe_point()  # between partitions: the previous write-through is issued
                self._settle_resident(part.id)  # never change a record being written
                views, fresh = self._resident_views(part), part.id in self.fresh
            ready = Ready(part, views, fresh, following)
            yield ready
            if not ready.released:
                raise TierMemError(f"partition {part.id} was visited but never released: "
                                   "its update would not reach its tier")

    def hold(self, parts: Sequence[Partition]) -> list[Ready]:
        """The records of resident `parts` (host or GPU tier) all at once, for an update
        that runs them together (NVMe records come one at a time from visit(): they need
        the pipeline's few buffers). The caller updates them and hands each back with
        release(); one it never hands back is never written (a crash-consistent one)."""
        out = []
        for part in parts:
            if part.tier == "nvme":
                raise ValueError(f"partition {part.id} is on NVMe: visit() hands it out")
            safe_point()
            self._settle_resident(part.id)  # never change a record being written
            out.append(Ready(part, self._resident_views(part), part.id in self.fresh, None))
        return out

    def _resident_views(self, part: Partition) -> Views:
        """`part`'s views into its resident record, made once (a record stays where it was
        allocated); a copy of the dict each time, so a caller's change stays its own."""
        views = self._views.get(part.id)
        if views is None:
            views = self._views[part.id] = part.views(self.resident[part.id])
        return dict(views)

    def release(self, ready: Ready, stats: StepStats, digest: int | None = None) -> None:
        """The record of `ready` is updated: issue its write-back (NVMe), or its
        write-through (resident, crash-consistent). digest: the record's CRC32C when the
        update computed it in the same pass."""
        part = ready.part
        ready.released = True
        if part.tier == "nvme":
            self.pipeline.release(part, stats, digest)
            return
        self.fresh.discard(part.id)
        if self.crash:
            self._write_resident(part, stats, digest)
        stats.partitions[part.tier] = stats.partitions.get(part.tier, 0) + 1

    def ready_views(self, part: Partition) -> Views | None:
        """`part`'s record if it is in host memory now (read and checked), without
        waiting; else None (a read in flight, or a record never written)."""
        if part.tier == "nvme":
            return self.pipeline.ready_views(part)
        return None if part.id in self.fresh else self._resident_views(part)

    def is_fresh(self, part: Partition) -> bool:
        """True while `part`'s record was never initialised or written."""
        if part.tier == "nvme":
            return part.id in self.pipeline.fresh
        return part.id in self.fresh

    @contextmanager
    def record(self, part: Partition, *, write: bool) -> Iterator[tuple[Views, bool]]:
        """`part`'s record as (views, fresh) for the block; `write`: the block's changes are
        kept (written back, fresh cleared) unless it raised."""
        with deferred():  # a signal waits until the record's write is fully issued
            if part.tier == "nvme":
                with self.pipeline.record(part, write=write) as got:
                    yield got
                return
            self._settle_resident(part.id)
            yield self._resident_views(part), part.id in self.fresh
            if write:
                self.fresh.discard(part.id)
                if self.crash:
                    self._unwritten.add(part.id)  # on disk by the next commit

    # -- crash-consistent commits ------------------------------------------------

    def _write_resident(self, part: Partition, stats: StepStats | None = None,
                        digest: int | None = None) -> None:
        self._unwritten.discard(part.id)
        self._resident_writes[part.id] = self.store.write(part, self.resident[part.id],
                                                          digest=digest)
        if stats is not None:
            stats.add_bytes("write", "nvme", self.store.slots[part.id].nbytes)

    def _settle_resident(self, pid: int) -> None:
        """Wait for the write-through of a resident record, reissuing it on failure."""
        req = self._resident_writes.pop(pid, None)
        if req is None:
            return
        try:
            self.resident_faults_survived += self.store.finish_write(
                self._by_id[pid], self.resident[pid], req, retries=self.settings.io.retries)
        except TierMemIOError:
            self._unwritten.add(pid)  # the next commit tries again
            raise

    def commit(self, *, step: int, **meta: Any) -> str:
        """Make the state as it is now the one a resume finds: every record written, the
        disk flushed, then the manifest naming each record's copy. Raises (and the
        previous commit stays the valid one) if any of it fails."""
        for p in self.parts:
            if p.id in self._unwritten:
                self._write_resident(p)
        for pid in list(self._resident_writes):
            self._settle_resident(pid)
        if self.pipeline is not None:
            self.pipeline.settle_writes()
        self.store.sync()
        records = self.store.latest_records()
        manifest = self._manifest(step=step, records=records, **meta)
        last = self._committed
        if self.keep_previous and last is not None and last.step < step:
            # Its records stay untouched until the next step writes: see manifest.PREVIOUS.
            write_manifest(self.run_dir(), last, PREVIOUS)
        path = write_manifest(self.run_dir(), manifest)
        self.store.mark_committed(records)
        self._committed = manifest
        return path

    def _manifest(self, *, step: int, steps: Sequence[float], params: list[dict],
                  groups: list[dict], rule: str, records: dict[int, tuple[int, int]] | None = None,
                  resident: list[dict] | None = None, values: dict | None = None,
                  share: dict | None = None, defaults: dict | None = None,
                  stateless: Sequence[int] = (), unstepped_state: Sequence[int] = (),
                  late: Sequence[dict] = (), version: int = VERSION) -> Manifest:
        store = self.store
        fresh = set(self.fresh) | (self.pipeline.fresh if self.pipeline else set())
        records = records if records is not None else (store.latest_records() if store else {})
        return Manifest(
            partitions=layout_of(self.parts), steps=list(steps), fresh=sorted(fresh),
            resident=resident or [], generations={k: g for k, (_, g) in records.items()},
            durability=self.settings.swap.durability, step=step,
            copies={k: c for k, (c, _) in records.items()},
            records=store.locations() if store else {},
            files=[f.path for f in store.files] if store else [],
            checksums=self.settings.swap.checksums, params=params, groups=groups, rule=rule,
            values=values or {}, share=share or {}, defaults=defaults or {},
            stateless=list(stateless), unstepped_state=list(unstepped_state),
            late=[dict(b) for b in late], version=version)

    def moving(self) -> bool:
        """Whether a transfer to or from NVMe is under way now."""
        return self.engine is not None and self.engine.moving()

    def flush(self) -> None:
        """Every write-back on disk (raises the first I/O failure)."""
        if self.pipeline is not None:
            self.pipeline.flush()

    # -- state kept on disk ------------------------------------------------------

    def run_dir(self) -> str | None:
        """Where kept state goes: the first swap path's run directory."""
        return run_dirs(self.settings.swap.paths, self.swap_name)[0]

    def keep_on_disk(self, *, step: int, **meta: Any) -> str:
        """Leave the state on disk with a manifest (resident records too); close, keep them."""
        if self.crash:
            self.commit(step=step, **meta)
            self.close(remove_swap=False)
            return self.run_dir()
        self.flush()
        run_dir = self.run_dir()
        if self.store is None:
            fsops.makedirs(run_dir)
        resident = []

        def pieces():  # through fsops, like every write the kept state depends on
            pos = 0
            for p in self.parts:
                if p.tier != "nvme":
                    data = self.resident[p.id].cpu().numpy().tobytes()
                    resident.append({"id": p.id, "offset": pos, "nbytes": len(data)})
                    pos += len(data)
                    yield data
        fsops.ops().write_file(os.path.join(run_dir, RESIDENT_FILE), pieces(),
                               site="resident.fsync")
        write_manifest(run_dir, self._manifest(step=step, resident=resident, **meta))
        self.close(remove_swap=False)
        return run_dir

    def _load_resident(self, m: Manifest) -> None:
        self.fresh = {p.id for p in self.parts if p.tier != "nvme"} & set(m.fresh)
        if m.durability == "crash_consistent":
            for p in self.parts:
                if p.tier != "nvme" and p.id not in self.fresh:
                    # The committed copy, checked like any NVMe record.
                    self.store.read(p, self.resident[p.id]).wait()
                    self.store.verify(p, self.resident[p.id])
            return
        if not m.resident:
            return
        path = os.path.join(self.run_dir(), RESIDENT_FILE)
        with open(path, "rb") as f:
            for entry in m.resident:
                rec = self.resident[entry["id"]]
                f.seek(entry["offset"])
                data = f.read(entry["nbytes"])
                if len(data) != entry["nbytes"] or entry["nbytes"] != rec.numel():
                    raise TierMemError(f"cannot resume: {path} is truncated or does not match "
                                       f"partition {entry['id']}")
                rec.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def close(self, *, remove_swap: bool, flush: bool = True) -> None:
        """Release buffers and the engine; delete swap files only if `remove_swap`.

        Keeping them, every write-back must land first (flush raises otherwise), unless
        `flush` is off: abandoning a failed step whose writes no manifest names. Removing
        them, the state is already safe elsewhere. Either way transfers still in flight
        are waited for (the engine never frees a ring under them)."""
        if self.pipeline is not None and not remove_swap and flush:
            self.pipeline.flush()
        if self.store is not None:
            if remove_swap:
                self.store.remove()
            else:
                self.store.close()
        elif remove_swap and self._resume is not None:
            remove_run_dir(self.run_dir())  # resumed, resident records only
        if self.engine is not None:
            try:
                self.engine.close()
            except TierMemIOError:
                if not remove_swap and flush:
                    raise
        self.resident.clear()
        self._views.clear()  # (they hold the records too)
        self._resident_writes.clear()
        self.pipeline = self.pool = self.store = self.engine = None


def records_of(m: Manifest) -> dict[int, tuple[int, int]]:
    """(copy, generation) of every record a manifest names."""
    return {int(k): (int(m.copies.get(k, 0)), int(g)) for k, g in m.generations.items()}
