"""TierManager: where each partition's record lives, and the order a step visits them.

Records of GPU- and host-tier partitions stay resident (device memory; pinned
host memory). NVMe-tier records live in swap files and stream through a
BufferPool driven by a StepPipeline. A step updates the resident partitions
first, while the reads the pipeline issued at the end of the previous step
are landing, then streams the NVMe partitions.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Sequence

import torch

from tiermem.buffers import BufferPool, aligned_empty
from tiermem.config import Settings
from tiermem.io import IOEngine
from tiermem.partition import Partition
from tiermem.pipeline import StepPipeline, Views
from tiermem.errors import TierMemError, TierMemIOError
from tiermem.manifest import RESIDENT_FILE, Manifest, layout_of, write_manifest
from tiermem.swap import SwapStore
from tiermem.swapdir import run_dirs
from tiermem.telemetry import StepStats

Fn = Callable[[Partition, Views], None]


class TierManager:
    """Owns every partition record: resident ones, swap files, buffers and the pipeline."""

    def __init__(self, parts: Sequence[Partition], settings: Settings, *,
                 swap_name: str, resume: Manifest | None = None) -> None:
        self.settings = settings
        self.swap_name = swap_name
        self._resume = resume
        self.parts: list[Partition] = []
        self.resident: dict[int, torch.Tensor] = {}
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
        nvme = [p for p in parts if p.tier == "nvme"]
        for p in parts:
            if p.tier == "host":
                # Pinned so a device copy from it is async; allocated once, kept.
                self.resident[p.id] = aligned_empty(p.record_bytes)
            elif p.tier == "gpu":
                self.resident[p.id] = torch.empty(p.record_bytes, dtype=torch.uint8,
                                                  device="cuda")
            if p.tier != "nvme":
                self.fresh.add(p.id)  # NVMe partitions: the pipeline tracks its own
        if nvme:
            self._add_nvme(nvme)
        self.parts.extend(parts)

    def _add_nvme(self, nvme: Sequence[Partition]) -> None:
        s = self.settings
        if self.store is None:
            self.engine = IOEngine(s.io.backend, s.io.queue_depth, s.io.block_size)
            self.store = SwapStore(self.engine, s.swap.paths, self.swap_name, nvme,
                                   direct=s.io.o_direct, resume=self._resume is not None,
                                   checksums=s.swap.checksums)
            if self._resume is not None:
                self.store.generation.update(
                    {int(k): v for k, v in self._resume.generations.items()})
            size = max(p.record_bytes for p in nvme) + self.store.footer
            self.pool = BufferPool(s.pipeline.buffer_count, size, engine=self.engine)
            self.pipeline = StepPipeline(self.store, self.pool.buffers, nvme,
                                         prefetch_depth=s.pipeline.prefetch_depth,
                                         zigzag=s.pipeline.zigzag, retries=s.io.retries)
            if self._resume is not None:
                self.pipeline.fresh &= set(self._resume.fresh)
            self.pipeline.run_ahead()
            return
        self.pipeline.flush()  # every buffer idle: the disk copy of each record is current
        size = max(p.record_bytes for p in nvme) + self.store.footer
        if size > self.pool.nbytes:
            # Bigger records than the first groups had: new, larger buffers.
            self.pool = BufferPool(s.pipeline.buffer_count, size, engine=self.engine)
            self.pipeline.replace_buffers(self.pool.buffers)
        self.store.add(nvme)
        self.pipeline.add_partitions(nvme)

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

    def step(self, stats: StepStats, active: Callable[[Partition], bool], init: Fn,
             compute: Fn) -> None:
        for p in self.parts:
            if p.tier != "nvme" and active(p):
                self.step_resident(p, stats, init, compute)
        if self.pipeline is not None:
            self.pipeline.run_step(stats, active, init, compute)

    def step_resident(self, p: Partition, stats: StepStats, init: Fn, compute: Fn) -> None:
        """Update one GPU- or host-tier partition in place."""
        views = p.views(self.resident[p.id])
        if p.id in self.fresh:
            init(p, views)
            self.fresh.discard(p.id)
        compute(p, views)
        stats.partitions[p.tier] = stats.partitions.get(p.tier, 0) + 1

    def with_record(self, part: Partition, fn: Callable[[Views, bool], None], *,
                    write: bool) -> None:
        """fn(views, fresh) on `part`'s record; `write` keeps the changes (and clears fresh)."""
        if part.tier == "nvme":
            self.pipeline.with_record(part, fn, write=write)
            return
        fn(part.views(self.resident[part.id]), part.id in self.fresh)
        if write:
            self.fresh.discard(part.id)

    def flush(self) -> None:
        """Every write-back on disk (raises the first I/O failure)."""
        if self.pipeline is not None:
            self.pipeline.flush()

    # -- state kept on disk ------------------------------------------------------

    def run_dir(self) -> str | None:
        """Where kept state goes: the first swap path's run directory."""
        return run_dirs(self.settings.swap.paths, self.swap_name)[0]

    def keep_on_disk(self, steps: Sequence[float]) -> str:
        """Write resident records and the manifest next to the swap files; close, keep them."""
        self.flush()
        run_dir = self.run_dir()
        if self.store is None:
            os.makedirs(run_dir, mode=0o700, exist_ok=True)
        resident = []
        pos = 0
        with open(os.path.join(run_dir, RESIDENT_FILE), "wb") as f:
            for p in self.parts:
                if p.tier == "nvme":
                    continue
                data = self.resident[p.id].cpu().numpy().tobytes()
                f.write(data)
                resident.append({"id": p.id, "offset": pos, "nbytes": len(data)})
                pos += len(data)
            f.flush()
            os.fsync(f.fileno())
        fresh = set(self.fresh) | (self.pipeline.fresh if self.pipeline else set())
        write_manifest(run_dir, Manifest(
            partitions=layout_of(self.parts), steps=list(steps), fresh=sorted(fresh),
            resident=resident, generations=dict(self.store.generation) if self.store else {}))
        self.close(remove_swap=False)
        return run_dir

    def _load_resident(self, m: Manifest) -> None:
        self.fresh = {p.id for p in self.parts if p.tier != "nvme"} & set(m.fresh)
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

    def close(self, *, remove_swap: bool) -> None:
        """Release buffers and the engine; delete swap files only if `remove_swap`.

        Keeping them, every write-back must land first (flush raises otherwise). Removing
        them, the state is already safe elsewhere: transfers still in flight are waited
        for (the engine never frees a ring under them) and their failures do not matter."""
        if self.pipeline is not None and not remove_swap:
            self.pipeline.flush()
        if self.store is not None:
            if remove_swap:
                self.store.remove()
            else:
                self.store.close()
        elif remove_swap and self._resume is not None:
            shutil.rmtree(self.run_dir(), ignore_errors=True)  # resumed, resident records only
        if self.engine is not None:
            try:
                self.engine.close()
            except TierMemIOError:
                if not remove_swap:
                    raise
        self.resident.clear()
        self.pipeline = self.pool = self.store = self.engine = None
