"""The parameter tier's device side: a device model's weights reach the device through
pinned host buffers, and its gradients come back the same way.

Used when the model lives on a device: CUDA parameters (torch.cuda streams and events),
or CPU parameters under `tiermem.offload(..., streams=DeferredBackend())`, the CPU
emulation whose streams run their work only once something waits for it, as late as a
GPU may (tiermem/device/lanes.py), so a missing wait leaves a stale value (device
buffers start as NaN there) instead of passing by luck. The records stay on the host or
NVMe tier; the device holds only the window.

One weight, parameter i, each time it is materialised for a forward or a backward:

    host     record -> pinned buffer b (the fetch: an NVMe read, or a host copy)
    h2d      b -> dev[i] (allocated from the h2d stream's pool) ─●ready[i]
    host     b kept until ready[i] completed (the copy reads it asynchronously)
    compute  wait ready[i] ─ the module's kernels (forward; backward's unpack) read dev[i]
    host     released: ●done recorded on the compute stream; dev[i] kept until done
             completed, then freed: no queued kernel can still read memory handed out again
    (changed in place since it landed: p.data.mul_(), an EMA written into the model)
    d2h      wait the compute stream ─ dev[i] -> pinned staging ─●; the host waits it,
             then the record is written from the staging copy, before the release above

One gradient, parameter i, each backward (its post-accumulate-grad hook):

    compute  backward's kernels writing g (p.grad) are queued ─●made
    d2h      wait made ─ g -> pinned staging h ─●copied
    host     copied.synchronize() (at the end of backward, or when staging is full);
             h stored or added into the gradient record (model dtype), its norm kept;
             then g (the device gradient the copy read) and h are dropped

The optimizer step runs on the host (optimizer.step_device cpu): each partition's
weights and gradients are materialised in host memory from the records (the device
copies of the weights released first: the records hold the same values), updated, and
written back at the end of the step, when the weights still in the window go to the
device again, ahead of the next forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tiermem.device.lanes import CudaBackend, DeferredBackend, DeferredStream
from tiermem.params.recycle import Recycler


@dataclass
class _Landing:
    """A gradient on its way from the device into pinned staging."""

    index: int
    copied: Any  # event of the D2H into `host`
    host: torch.Tensor
    grad: torch.Tensor  # the device gradient: kept until the D2H that reads it ran
    nbytes: int


class DeviceSide:
    """Streams, events, pinned staging and device buffers of a device model's weights."""

    def __init__(self, backend: CudaBackend | DeferredBackend, *, staging_limit: int,
                 stats: Any) -> None:
        """staging_limit: bytes of host buffers the copies may hold at once, per direction
        (past it the host waits for the oldest copy); stats: a ParamStats, whose h2d_bytes
        and d2h_bytes are counted here."""
        self.backend = backend
        self.device = backend.device
        self.emulated = backend.host_is_device
        # Copies get their own streams so they overlap the compute stream's kernels (one
        # copy engine per direction); every use below is ordered by an event.
        self.h2d = backend.new_stream()
        self.d2h = backend.new_stream()
        if isinstance(self.h2d, DeferredStream):
            self.h2d.name, self.d2h.name = "weights h2d", "grads d2h"
        self.limit = staging_limit
        self.ready: dict[int, Any] = {}  # index -> event of the H2D that filled its buffer
        self.uploads: deque[tuple[Any, torch.Tensor, int]] = deque()
        self.upload_bytes = 0
        self.retiring: deque[tuple[Any, torch.Tensor, int]] = deque()
        self.retiring_bytes = 0
        self.landing: deque[_Landing] = deque()
        self.landing_bytes = 0
        # Pinned, so the D2H copies are truly asynchronous; registered once per buffer and
        # reused (the emulation needs no pinning).
        self.staging = Recycler(staging_limit, pinned=not self.emulated)
        self.stats = stats
        self.device_bytes = 0  # device buffers made and not freed yet (retired ones too)

    # -- weights ------------------------------------------------------------------------

    def upload(self, i: int, value: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Parameter i's weights `value` (host memory; in `keep`, a pinned buffer, when
        given) to a device buffer of their own, on the h2d stream; returns that buffer,
        which the compute stream must wait for (compute_waits) before reading it."""
        b = self.backend
        # From the h2d stream's pool: memory a released buffer gave back is handed out
        # only after the compute work that read it ran (release keeps it until then, and
        # record_stream guards references held elsewhere), so the copy may write it now.
        dev = b.empty_for(self.h2d, value.shape, value.dtype)
        b.copy(self.h2d, dev, value)
        self.ready[i] = b.record(self.h2d)
        n = value.numel() * value.element_size()
        self.device_bytes += n
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.device_bytes)
        # The copy reads `value` asynchronously: its buffer is kept until the copy ran.
        self.uploads.append((self.ready[i], value if keep is None else keep, n))
        self.upload_bytes += n
        self.stats.h2d_bytes += n
        self.reap()
        while self.upload_bytes > self.limit and len(self.uploads) > 1:
            self._drop_upload(wait=True)  # bounded staging: the oldest copy's buffer back
        return dev

    def _drop_upload(self, *, wait: bool) -> None:
        ev, _, n = self.uploads[0]
        if wait:
            # Before the pinned buffer goes back for reuse: the H2D reading it completed.
            self.backend.synchronize(ev)
        self.uploads.popleft()
        self.upload_bytes -= n

    def compute_waits(self, i: int, t: torch.Tensor) -> None:
        """The current (compute) stream's work queued next reads `t`, parameter i's device
        weights: it waits the H2D that filled them."""
        b = self.backend
        stream = b.current_stream()
        ev = self.ready.get(i)
        if ev is not None:
            b.wait(stream, ev)  # the module's kernels run after the weights landed
        b.used_by(t, stream)  # a reference kept past release (autograd's) frees it safely

    def compute_runs(self) -> None:
        """The host queues compute work next (a forward, a backward node): on the
        emulation it runs that work itself, so the compute stream's waits run first."""
        b = self.backend
        b.host_sync(b.current_stream())

    def release(self, i: int, dev: torch.Tensor) -> None:
        """Parameter i's device buffer is no longer its weights: kept until the compute
        work queued so far (which may read it) ran, then freed."""
        b = self.backend
        self.ready.pop(i, None)
        done = b.record(b.current_stream())  # after every kernel queued that reads dev
        n = dev.numel() * dev.element_size()
        self.retiring.append((done, dev, n))
        self.retiring_bytes += n

    def bound(self, allowed: int) -> None:
        """Released device buffers hold at most `allowed` bytes: the host waits the compute
        work that reads the oldest ones (the device window counts them until freed)."""
        self.reap()
        while self.retiring and self.retiring_bytes > max(0, allowed):
            done, _, n = self.retiring.popleft()
            self.backend.synchronize(done)  # no queued kernel reads it any more: freed
            self.retiring_bytes -= n
            self.device_bytes -= n

    def reap(self) -> None:
        """Free what completed copies and kernels no longer read (no waiting)."""
        while self.uploads and self.uploads[0][0].query():
            self._drop_upload(wait=False)
        while self.retiring and self.retiring[0][0].query():
            _, _, n = self.retiring.popleft()
            self.retiring_bytes -= n
            self.device_bytes -= n

    def download(self, dev: torch.Tensor) -> torch.Tensor:
        """A device buffer's values as they are after every kernel queued so far (the
        user's in-place change of a live weight among them), in host memory: a weight
        changed on the device, on its way to its record before its buffer is released."""
        b = self.backend
        b.wait(self.d2h, b.record(b.current_stream()))  # the copy reads it after the edit
        n = dev.numel() * dev.element_size()
        host = self.staging.get(n).view(dev.dtype).view(dev.shape)
        if self.emulated:
            host.fill_(float("nan"))  # read before its copy ran: never right by luck
        b.copy(self.d2h, host, dev)
        # The host reads `host` next: the copy completed. `dev` itself is released by the
        # caller after this, so no kernel queued later changes what was copied.
        b.synchronize(b.record(self.d2h))
        self.stats.d2h_bytes += n
        return host

    # -- gradients ------------------------------------------------------------------------

    def grad_out(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's final device gradient (its post-accumulate-grad hook): copied to
        pinned staging on the d2h stream once backward's kernels writing it ran."""
        b = self.backend
        made = b.record(b.current_stream())  # the hook runs once those kernels are queued
        b.wait(self.d2h, made)  # the D2H reads the gradient after backward wrote it
        n = grad.numel() * grad.element_size()
        buf = self.staging.get(n)
        host = buf.view(grad.dtype).view(grad.shape)
        if self.emulated:
            host.fill_(float("nan"))  # read before its copy ran: never right by luck
        b.copy(self.d2h, host, grad)
        self.landing.append(_Landing(i, b.record(self.d2h), host, grad, n))
        self.landing_bytes += n
        self.stats.d2h_bytes += n

    def grad_landed(self, event: Any) -> None:
        """The host reads a gradient's pinned copy next: the D2H that writes it completed."""
        self.backend.synchronize(event)

    def land(self, store: Callable[[int, torch.Tensor], None], *, every: bool) -> None:
        """Hand the copied gradients to `store(index, host gradient)` in the order backward
        produced them (accumulation adds them in that order): all of them (`every`), else
        those whose copy completed and as many as keep staging under its limit."""
        while self.landing:
            first = self.landing[0]
            if not every and self.landing_bytes <= self.limit and not first.copied.query():
                return
            self.grad_landed(first.copied)
            self.landing.popleft()
            self.landing_bytes -= first.nbytes
            store(first.index, first.host)
            # first.grad and first.host go here: the copy that read the one and wrote the
            # other completed (grad_landed), and store() copied the other into the record

    # -- ends ----------------------------------------------------------------------------

    def settle(self) -> None:
        """Every queued copy and kernel done; staging and released buffers freed. (The
        gradients still landing are dropped: call land() first to keep them.)"""
        b = self.backend
        for stream in (b.current_stream(), self.h2d, self.d2h):
            b.synchronize(b.record(stream))
        self.uploads.clear()
        self.upload_bytes = 0
        self.retiring.clear()
        self.device_bytes -= self.retiring_bytes
        self.retiring_bytes = 0
        self.landing.clear()
        self.landing_bytes = 0
        self.ready.clear()

    def close(self) -> None:
        self.settle()
        self.staging.clear()
