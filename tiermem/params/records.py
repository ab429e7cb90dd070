"""Each managed parameter's weight record and gradient record, on the host or NVMe tier.

A record holds one parameter's elements in the model's dtype, padded to the I/O
block. Host records are pinned buffers allocated once. NVMe records live in a
SwapStore of their own (`<swap path>/tiermem-<name>.params/`), checksummed like
the optimizer's, and move through the same IOEngine: there is no second I/O
path. A read of a record whose write is still in flight waits for that write
first, so a read always returns the latest bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from tiermem.config import Settings
from tiermem.errors import TierMemError
from tiermem.io import IOEngine, Request
from tiermem.io.buffers import aligned_empty
from tiermem.params.recycle import Recycler
from tiermem.partition import Partition, align_up
from tiermem.swap.store import SwapStore
from tiermem.swap.rundir import RunDir, remove_run_dir, run_dirs

WEIGHT, GRAD = "weight", "grad"


@dataclass(frozen=True)
class Meta:
    """What a record holds: one parameter's shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def record_bytes(meta: Meta) -> int:
    """Bytes of a record (data padded to the I/O block; at least one block)."""
    return align_up(max(meta.nbytes, 1))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def drop_run_dirs(paths: Sequence[str], name: str) -> None:
    """Remove the run directories `name` left under `paths` (taken over first: a live run
    holding one is refused by name, never removed)."""
    for d in run_dirs(paths, name):
        if os.path.lexists(d):
            held = RunDir.adopt(d)
            try:
                remove_run_dir(d)
            finally:
                held.release()


class Fetch:
    """A record on its way into a buffer of its own; wait() gives the tensor."""

    def __init__(self, records: "Records", kind: str, index: int, buf: torch.Tensor,
                 req: Request | None) -> None:
        self.records, self.kind, self.index, self.buf, self.req = records, kind, index, buf, req
        self._value: torch.Tensor | None = None

    def landed(self) -> bool:
        """The read is done (wait() returns without waiting for the disk)."""
        return self.req is None or self.req.done()

    def wait(self) -> torch.Tensor:
        if self._value is None:
            r = self.records
            if self.req is not None:
                # waits for the read, hashing the record as it lands
                r.store.verify(r.part(self.kind, self.index), self.buf, landing=self.req)
                self.req = None
            meta = r.metas[self.index]
            self._value = self.buf[: meta.nbytes].view(meta.dtype).view(meta.shape)
        return self._value


class Records:
    """Weight and gradient records of `metas` (one per parameter) on `tier`."""

    def __init__(self, metas: Sequence[Meta], tier: str, settings: Settings,
                 swap_name: str, *, drop_stale: bool = False, pinned: bool = False) -> None:
        """drop_stale: remove the records a crashed run left under `swap_name` first (a
        crash-consistent resume: weights come back from the optimizer's commit, and
        gradients are never durable), instead of refusing the stale directory.
        pinned: the buffers records are fetched into are page-locked (a CUDA model's
        weights are copied to the GPU from them, asynchronously)."""
        if tier not in ("host", "nvme"):
            raise TierMemError(f"parameters.offload: {tier!r} has no records")
        self.metas = list(metas)
        self.tier = tier
        self.settings = settings
        self.host: dict[tuple[str, int], torch.Tensor] = {}
        self.engine: IOEngine | None = None
        self.store: SwapStore | None = None
        # Writes in flight, with the buffer each writes from (kept alive until it lands).
        self.pending: dict[tuple[str, int], tuple[Request, torch.Tensor]] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        # Bytes of write buffers in flight before the oldest is waited for: the step writes
        # every updated weight, which must not add up to a copy of the model in memory.
        self.pending_limit = 256 << 20
        # buffers in use and kept for reuse, at most (the owner sets it with pending_limit)
        self.recycler = Recycler(2 * self.pending_limit, pinned=pinned)
        if tier == "host":
            # One pinned arena per kind, records back to back: huge pages per record would
            # waste most of a 2 MiB page on every small parameter.
            total = sum(record_bytes(m) for m in self.metas)
            for kind in (WEIGHT, GRAD):
                arena = aligned_empty(total)
                off = 0
                for i, m in enumerate(self.metas):
                    self.host[kind, i] = arena[off: off + record_bytes(m)]
                    off += record_bytes(m)
            return
        n = len(self.metas)
        self._parts = {}
        for i, m in enumerate(self.metas):
            for k, kind in enumerate((WEIGHT, GRAD)):
                p = Partition(id=i + k * n, group=0, segments=[], kinds=(), tier="nvme")
                p.record_bytes = record_bytes(m)
                self._parts[kind, i] = p
        s = settings
        if drop_stale:
            drop_run_dirs(s.swap.paths, swap_name)
        self.engine = IOEngine(s.io.backend, s.io.queue_depth, s.io.block_size)
        try:
            self.store = SwapStore(self.engine, s.swap.paths, swap_name,
                                   list(self._parts.values()), direct=s.io.o_direct,
                                   checksums=s.swap.checksums)
        except BaseException:
            self.engine.close()
            raise

    def part(self, kind: str, index: int) -> Partition:
        return self._parts[kind, index]

    @property
    def footer(self) -> int:
        return self.store.footer if self.store is not None else 0

    def slot_bytes(self, index: int) -> int:
        """Bytes of a buffer one record moves through (data, padding, checksum footer)."""
        return record_bytes(self.metas[index]) + self.footer

    def resident_bytes(self) -> int:
        """Host memory the records themselves hold (pinned; 0 on NVMe)."""
        return sum(t.numel() for t in self.host.values())

    def _buffer(self, index: int) -> torch.Tensor:
        # Page-aligned for O_DIRECT, reused by size rather than left to malloc (recycle.py)
        return self.recycler.get(self.slot_bytes(index))

    def _landed(self, key: tuple[str, int]) -> None:
        got = self.pending.pop(key, None)
        if got is not None:
            req, buf = got
            self.store.finish_write(self._parts[key], buf, req,
                                    retries=self.settings.io.retries)

    def settle(self, kind: str, index: int) -> None:
        """The record's write in flight, if any, has landed (its buffer may change now)."""
        self._landed((kind, index))

    def _reap(self) -> None:
        for key in [k for k, (req, _) in self.pending.items() if req.done()]:
            self._landed(key)

    def fetch(self, kind: str, index: int) -> Fetch:
        """Start bringing a record into a buffer of its own (host: copied now)."""
        meta = self.metas[index]
        if self.tier == "host":
            buf = self._buffer(index)
            buf[: meta.nbytes].copy_(self.host[kind, index][: meta.nbytes])
            self.bytes_read += meta.nbytes
            return Fetch(self, kind, index, buf, None)
        self._landed((kind, index))  # the read must see the latest bytes
        buf = self._buffer(index)
        req = self.store.read(self._parts[kind, index], buf)
        self.bytes_read += buf.numel()
        return Fetch(self, kind, index, buf, req)

    def write(self, kind: str, index: int, value: torch.Tensor) -> None:
        """Store `value` (the parameter's shape and dtype) as the record's new contents."""
        meta = self.metas[index]
        if self.tier == "host":
            self.host[kind, index][: meta.nbytes].copy_(as_bytes(value))
            self.bytes_written += meta.nbytes
            return
        self._reap()
        self._landed((kind, index))  # one write per record in flight: they land in order
        buf = self._buffer(index)
        buf[: meta.nbytes].copy_(as_bytes(value))
        self._issue(kind, index, buf)

    def write_buffer(self, kind: str, index: int, buf: torch.Tensor) -> None:
        """Store the contents of `buf`, a buffer a fetch of this record brought in (and
        its owner changed since), without a copy: the record keeps `buf` until the write
        lands, and the caller must not touch it again."""
        if self.tier == "host" or buf.numel() != self.slot_bytes(index):
            self.write(kind, index, buf[: self.metas[index].nbytes].view(
                self.metas[index].dtype).view(self.metas[index].shape))
            return
        self._reap()
        self._landed((kind, index))
        self._issue(kind, index, buf)

    def _issue(self, kind: str, index: int, buf: torch.Tensor) -> None:
        req = self.store.write(self._parts[kind, index], buf)
        self.pending[kind, index] = (req, buf)
        self.bytes_written += buf.numel()
        held = sum(b.numel() for _, b in self.pending.values())
        while held > self.pending_limit and len(self.pending) > 1:
            oldest = next(iter(self.pending))  # dicts keep insertion order
            held -= self.pending[oldest][1].numel()
            self._landed(oldest)

    def accumulate(self, index: int, grad: torch.Tensor, *, add: bool) -> torch.Tensor:
        """Store `grad` as parameter `index`'s gradient, or add it to the stored one; returns
        the stored value (valid until the next operation on this record)."""
        meta = self.metas[index]
        if self.tier == "host":
            rec = self.host[GRAD, index][: meta.nbytes].view(meta.dtype).view(meta.shape)
            rec.add_(grad) if add else rec.copy_(grad)
            self.bytes_written += meta.nbytes
            return rec
        if add:
            fetched = self.fetch(GRAD, index)
            value = fetched.wait()
            value.add_(grad)
            self._issue(GRAD, index, fetched.buf)
            return value
        self._reap()
        self._landed((GRAD, index))
        buf = self._buffer(index)
        value = buf[: meta.nbytes].view(meta.dtype).view(meta.shape)
        value.copy_(grad)
        self._issue(GRAD, index, buf)
        return value

    def drain(self) -> None:
        """Every write landed (or its failure raised)."""
        for key in list(self.pending):
            self._landed(key)

    def close(self) -> None:
        """Drop the records (weights must have been taken back first)."""
        try:
            if self.store is not None:
                for key in list(self.pending):
                    req, _ = self.pending.pop(key)
                    try:
                        req.wait()
                    except TierMemError:
                        pass  # the records are being thrown away
                self.store.remove()
        finally:
            if self.engine is not None:
                self.engine.close()
            self.host.clear()
            self.recycler.clear()
