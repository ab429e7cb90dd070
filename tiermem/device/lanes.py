"""Host<->device lanes: the streams, events and buffers that move partitions between pinned
host memory and the compute device, created once per OffloadedOptimizer and reused.

optimizer.step_device says where a host- or NVMe-homed partition of a device model is
updated:

cpu (ZeRO-Offload)                                 k = 0, 1, 0, ... per partition
  compute  ──backward──●ev_bwd
  d2h          wait ev_bwd ─ grads -> pinned g[k] ─●ev_grads
  host                        ev_grads.synchronize(); Adam on the record (master, moments);
                              ev_w[k].synchronize(); master -> pinned w[k] (model dtype)
  h2d          wait ev_bwd' ─ w[k] -> param ─●ev_w[k]
  compute  ──wait the step's last ev_w (at its end)── next forward

device                                             k = 0, 1, 0, ... per partition
  h2d      wait ev_back[k] ─ record -> dev[k] ─●ev_in
  compute  wait ev_in ─ fused Adam on dev[k], master -> param ─●ev_done
  d2h      wait ev_done ─ dev[k] -> record ─●ev_back[k]
  host     ev_back[k].synchronize(), then the NVMe write-back is issued

The next partition's record (or grads) is staged on the copy stream while the current one
is updated: `stage()` is called with it before `update` of the current one (the
TierManager and the pipeline call it when that record is already in host memory).

The same code runs without a GPU: for CPU parameters the backend is `DeferredBackend`,
whose streams run their work only when something waits for it (as late as a GPU may), so
a missing wait shows up as a stale value in the parity tests instead of passing by luck.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from tiermem.io.buffers import aligned_empty
from tiermem.errors import TierMemError
from tiermem.partition import Partition, flat, flat_like
from tiermem.telemetry.stats import StepStats, timed

SLOTS = 2  # double buffering: one slot is updated while the other is filled
ALIGN = 64  # bytes: where torch's CPU allocations start
# -- backends ---------------------------------------------------------------------------


class CudaBackend:
    """torch.cuda streams and events on one device."""

    host_is_device = False  # device memory is the GPU's

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def record(self, stream: Any) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        # The caching allocator must not recycle src/dst memory for other streams' work
        # before this copy ran (both are long-lived here, this only guards temporaries).
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def empty(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=self.device)

    def host_sync(self, stream: Any) -> None:
        """Nothing: the host's next work on this stream (the forward) is queued behind."""

    def check_idle(self, streams: Sequence[Any]) -> None:
        """Nothing to check: the GPU runs queued copies whether or not anything waits."""

    def empty_for(self, stream: Any, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A device tensor from `stream`'s pool of the caching allocator: a copy queued on
        `stream` may write it at once (memory freed to that pool is reused only in that
        stream's order, or after the events record_stream asked for)."""
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def used_by(self, t: torch.Tensor, stream: Any) -> None:
        """`t` is read by work queued on `stream`: when its last reference dies, the caching
        allocator hands its memory out again only once that work ran."""
        t.record_stream(stream)


class DeferredStream:
    """An emulated stream: its work runs in order, only once something waits for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque[Callable[[], None]] = deque()
        self.issued = 0
        self.done = 0
        self._draining = False

    def enqueue(self, fn: Callable[[], None]) -> int:
        self.queue.append(fn)
        self.issued += 1
        return self.issued

    def drain(self, upto: int | None = None) -> None:
        upto = self.issued if upto is None else upto
        if self._draining:
            if upto > self.done:
                # A real GPU would hang here: this stream waits for work queued behind it.
                raise RuntimeError(f"emulated stream {self.name} waits on its own later work")
            return
        self._draining = True
        try:
            while self.done < upto:
                fn = self.queue.popleft()
                self.done += 1
                fn()
        finally:
            self._draining = False


@dataclass
class DeferredEvent:
    stream: DeferredStream
    position: int
    seconds: float | None = None  # time.monotonic() when the stream reached it

    def query(self) -> bool:
        return self.stream.done >= self.position


class DeferredBackend:
    """CPU emulation of CudaBackend: 'device' memory is host memory and every stream is a
    DeferredStream (the compute stream too: its work runs when the host waits for it)."""

    device = torch.device("cpu")
    # Injected as tiermem.offload(..., streams=DeferredBackend()): CPU parameters count as
    # device ones, so every device path runs (tests, bench/gpu_check.py --smoke).
    host_is_device = True

    def __init__(self) -> None:
        self.compute = DeferredStream("compute")

    def new_stream(self) -> DeferredStream:
        return DeferredStream("copy")

    def current_stream(self) -> DeferredStream:
        return self.compute

    def record(self, stream: DeferredStream) -> DeferredEvent:
        ev = DeferredEvent(stream, 0)

        def mark() -> None:
            ev.seconds = time.monotonic()
        ev.position = stream.enqueue(mark)
        return ev

    def wait(self, stream: DeferredStream, event: DeferredEvent) -> None:
        stream.enqueue(lambda: event.stream.drain(event.position))

    def run(self, stream: DeferredStream, fn: Callable[[], None]) -> None:
        stream.enqueue(fn)

    def copy(self, stream: DeferredStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        # dst's version counter moves now, as a CUDA copy's does when it is queued: the
        # optimizer reads it after queueing the weights' copies (their last writer), and
        # the deferred run leaves it as it is.
        torch.autograd.graph.increment_version(dst)

        def run() -> None:
            with torch.autograd._unsafe_preserve_version_counter(dst):
                dst.copy_(src)
        stream.enqueue(run)

    def synchronize(self, event: DeferredEvent) -> None:
        event.stream.drain(event.position)

    def elapsed(self, start: DeferredEvent, end: DeferredEvent) -> float:
        return end.seconds - start.seconds

    def empty(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype)

    def host_sync(self, stream: DeferredStream) -> None:
        """The host runs the next forward itself: the stream's work must be done first."""
        stream.drain()

    def check_idle(self, streams: Sequence[DeferredStream]) -> None:
        """Once the compute stream is drained, a copy still queued is one that neither the
        compute stream nor the host waited for: on a GPU it could land after the next
        forward read its destination. A missing event wait, reported here."""
        for stream in streams:
            if stream.done < stream.issued:
                raise TierMemError(f"emulated {stream.name} stream: {stream.issued - stream.done}"
                                   " queued operations nothing waited for by the end of the step")

    def empty_for(self, stream: DeferredStream, shape: Sequence[int],
                  dtype: torch.dtype) -> torch.Tensor:
        """Host memory standing for device memory, NaN until a copy fills it: read before
        that copy ran (a missing wait), it is never right by luck."""
        return torch.full(tuple(shape), float("nan"), dtype=dtype)

    def used_by(self, t: torch.Tensor, stream: DeferredStream) -> None:
        """Nothing: emulated device memory lives as long as a queued operation refers to it."""


# -- the lanes ---------------------------------------------------------------------------


@dataclass(eq=False)  # slots are compared by identity, never by their tensors
class _Slot:
    """One of the SLOTS buffers of a kind, and what guards its reuse."""

    buf: torch.Tensor
    holds: int | None = None  # partition staged into it and not yet updated
    last_use: Any = None  # event of the last copy that read or wrote buf


@dataclass
class _Span:
    """One batch of copies on a copy stream, for the step's H2D/D2H figures."""

    direction: str  # "h2d" or "d2h"
    start: Any
    end: Any
    nbytes: int


@dataclass
class _Staged:
    slot: _Slot
    ready: Any  # event of the copy that filled the slot
    grads: list[torch.Tensor | None] = field(default_factory=list)  # cpu step: per segment
    sources: list[torch.Tensor] = field(default_factory=list)  # what the d2h copies read


def device_of(part: Partition) -> torch.device:
    return part.segments[0].param.device


class DeviceLanes:
    """The copy streams, the pinned and device buffers, and the order between them."""

    def __init__(self, parts: Sequence[Partition], step_device: str,
                 backend: "CudaBackend | DeferredBackend | None" = None) -> None:
        devices = {s.param.device for p in parts for s in p.segments}
        if len(devices) > 1:
            raise TierMemError("the optimizer's parameters live on several devices ("
                               + ", ".join(sorted(map(str, devices))) + "); tiermem's "
                               "host<->device lanes serve one device: one optimizer per device")
        (device,) = devices
        self.step_device = step_device
        self.backend: CudaBackend | DeferredBackend = backend if backend is not None else (
            CudaBackend(device) if device.type == "cuda" else DeferredBackend())
        # Copies get their own streams so they overlap the compute stream's kernels (and each
        # other: one copy engine per direction); every use below orders them by events.
        self.d2h = self.backend.new_stream()
        self.h2d = self.backend.new_stream()
        if isinstance(self.d2h, DeferredStream):
            self.d2h.name, self.h2d.name = "d2h", "h2d"
        self._staged: dict[int, _Staged] = {}
        self._spans: list[_Span] = []
        self._last_h2d: Any = None  # event of the latest weights H2D (cpu step)
        self._numel = 0
        self._record_bytes = 0
        self._width = 0
        self._segments = 0  # the most segments of one partition (each may add ALIGN of skew)
        self._reading: _Slot | None = None  # grads slot the host update is reading (cpu step)
        self.add(parts)

    # -- buffers -----------------------------------------------------------------------

    def add(self, parts: Sequence[Partition]) -> None:
        """Size the buffers for `parts` too (bigger partitions of a new param group). Called
        between steps: no copy is in flight in the old buffers (end_step waited them)."""
        numel = max([self._numel, *(p.numel for p in parts)])
        record = max([self._record_bytes, *(p.record_bytes for p in parts)])
        # Bytes per element that hold any of the parameters' grad or weight dtypes.
        width = max([self._width, *(s.param.element_size() for p in parts for s in p.segments)])
        segments = max([self._segments, *(len(p.segments) for p in parts)])
        if (numel, record, width, segments) == (self._numel, self._record_bytes, self._width,
                                                self._segments):
            return
        self._numel, self._record_bytes, self._width = numel, record, width
        self._segments = segments
        skew = ALIGN * (segments + 1)  # _placed's padding, at most
        self.settle()
        b = self.backend
        if self.step_device == "device":
            # Device copies of records: a slot is refilled only after the D2H that read it
            # back completed (the h2d stream waits its last_use event).
            self.dev = [_Slot(b.empty(record)) for _ in range(SLOTS)]
            # fp32 upcast of low-precision grads on the device, used by compute-stream work
            # only, so each use is ordered after the previous one.
            self.dev_grads = b.empty(numel * 4, torch.float32)
        else:
            # Pinned, so the copies are truly asynchronous. A grads slot is refilled only
            # once the host update that read it is over (weights_to_device frees it); a
            # weights slot only after the H2D that read it completed (the host synchronizes
            # its last_use event first).
            self.grads = [_Slot(aligned_empty(numel * width + skew)) for _ in range(SLOTS)]
            self.weights = [_Slot(aligned_empty(numel * width)) for _ in range(SLOTS)]
            # The fp32 upcast of low-precision grads, read by the host only.
            self.host_grads = aligned_empty(numel * 4 + skew).view(torch.float32)

    def _free_slot(self, slots: list[_Slot]) -> _Slot | None:
        for slot in slots:
            if slot.holds is None:
                return slot
        return None

    # -- ordering ------------------------------------------------------------------------

    def _order(self, stream: Any, event: Any, why: str) -> None:
        """`stream` runs its later work only after `event` (`why`: what that protects)."""
        if event is not None:
            self.backend.wait(stream, event)

    def _host_waits(self, event: Any, why: str) -> None:
        """The host goes on only once `event` completed (`why`: what it is about to touch)."""
        if event is not None:
            self.backend.synchronize(event)

    def _copies(self, stream: Any, direction: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> Any:
        """Queue dst <- src copies on `stream`; returns the event of their end."""
        b = self.backend
        start = b.record(stream)
        for dst, src in pairs:
            b.copy(stream, dst, src)
        end = b.record(stream)
        self._spans.append(_Span(direction, start, end, sum(s.numel() * s.element_size()
                                                            for _, s in pairs)))
        return end

    # -- step_device: device -------------------------------------------------------------

    def stage(self, part: Partition, views: dict[str, torch.Tensor]) -> None:
        """Start moving what `part`'s update needs to where it runs: its record to a device
        slot (device), or its grads to a pinned slot (cpu). No-op when no slot is free."""
        if part.id in self._staged:
            return
        if self.step_device == "device":
            slot = self._free_slot(self.dev)
            if slot is None:
                return
            record = _record(part, views)
            # Implied today by the host having waited that D2H before the record's write-back;
            # kept so a slot is never refilled on that assumption alone.
            self._order(self.h2d, slot.last_use, "the D2H reading this slot's last record")
            ready = self._copies(self.h2d, "h2d", [(slot.buf[: part.record_bytes], record)])
            slot.holds, slot.last_use = part.id, ready
            self._staged[part.id] = _Staged(slot, ready)
            return
        slot = self._free_slot(self.grads)
        if slot is None:
            return
        # Each grad in its parameter's memory order, the order segments address: a grad laid
        # out otherwise (a contiguous one of a channels_last weight) is copied on the
        # compute stream, so before the event the d2h stream waits, and kept alive (in
        # _Staged) until that copy has been read.
        whole: dict[int, torch.Tensor] = {}
        for s in part.segments:
            if s.param.grad is not None and s.index not in whole:
                whole[s.index] = flat_like(s.param.grad.detach(), s.param)
        backward = self.backend.record(self.backend.current_stream())
        self._order(self.d2h, backward, "backward, which writes the grads")
        grads, pairs = [], []
        for s, at in zip(part.segments, _placed(part, self._width)):
            if s.index not in whole:
                grads.append(None)
            else:
                g = whole[s.index][s.start: s.start + s.length]
                host = _slice(slot.buf, at, s.length, g.dtype)
                pairs.append((host, g))
                grads.append(host)
        ready = self._copies(self.d2h, "d2h", pairs)
        slot.holds, slot.last_use = part.id, ready
        self._staged[part.id] = _Staged(slot, ready, grads, list(whole.values()))

    def update_on_device(self, part: Partition, views: dict[str, torch.Tensor],
                         kernel: Callable[[dict[str, torch.Tensor], torch.Tensor], None],
                         stats: StepStats) -> None:
        """step_device device: kernel(device views, fp32 grad scratch) on the compute stream
        over a device copy of `part`'s record, then the record back into `views`' buffer;
        returns once it is there (the NVMe write-back may read it)."""
        b = self.backend
        with timed(stats, "transfer_seconds", f"record in p{part.id}", part.id):
            self.stage(part, views)
            staged = self._staged.pop(part.id, None)
            if staged is None:
                raise TierMemError(f"no device slot free for partition {part.id}: both hold "
                                   "staged records (a step visited partitions out of order)")
        compute = b.current_stream()
        self._order(compute, staged.ready, "the H2D of the record")
        dev_views = part.views(staged.slot.buf)
        with timed(stats, "update_seconds", f"adam p{part.id}", part.id):
            b.run(compute, lambda: kernel(dev_views, self.dev_grads))
            done = b.record(compute)
        with timed(stats, "transfer_seconds", f"record out p{part.id}", part.id):
            self._order(self.d2h, done, "the update of the slot")
            back = self._copies(self.d2h, "d2h", [(_record(part, views),
                                                   staged.slot.buf[: part.record_bytes])])
            staged.slot.holds, staged.slot.last_use = None, back
            self._host_waits(back, "the record, before its NVMe write-back is issued")

    # -- step_device: cpu ------------------------------------------------------------------

    def grads_on_host(self, part: Partition, stats: StepStats) -> list[torch.Tensor | None]:
        """step_device cpu: `part`'s grads in host memory, fp32, one per segment (None
        where a parameter has no grad). They stay valid until the next call."""
        with timed(stats, "transfer_seconds", f"grads in p{part.id}", part.id):
            self.stage(part, {})
            staged = self._staged.pop(part.id, None)
            if staged is None:
                raise TierMemError(f"no pinned grads slot free for partition {part.id}")
            self._host_waits(staged.ready, "the grads, before the host update reads them")
            self._reading = staged.slot  # held until weights_to_device: the update reads it
            out = []
            for s, g, at in zip(part.segments, staged.grads, _placed(part, 4)):
                if g is not None and g.dtype != torch.float32:
                    g = self.host_grads[at // 4: at // 4 + s.length].copy_(g)
                out.append(g)
        return out

    def weights_to_device(self, part: Partition, masters: list[tuple[Any, torch.Tensor]],
                          stats: StepStats) -> None:
        """step_device cpu: the updated fp32 masters [(segment, host view)] into the model's
        weights, through a pinned slot, on the h2d stream; the compute stream waits it."""
        b = self.backend
        with timed(stats, "transfer_seconds", f"weights out p{part.id}", part.id):
            if self._reading is not None:  # the host update is over: its grads slot is free
                self._reading.holds, self._reading = None, None
            slot = self.weights[0]
            # Implied by the grads wait (their D2H followed a compute event recorded after
            # the compute stream waited this slot's H2D), kept so reuse never rests on it.
            self._host_waits(slot.last_use, "the H2D that last read this weights slot")
            pairs, off = [], 0
            for s, master in masters:
                w = flat(s.param.detach())[s.start: s.start + s.length]
                host = _slice(slot.buf, off * self._width, s.length, w.dtype)
                host.copy_(master)  # rounds to the model's dtype, as .copy_ would on the device
                pairs.append((w, host))
                off += s.length
            compute = b.current_stream()
            self._order(self.h2d, b.record(compute), "compute work queued before, which may "
                                                     "still read the old weights")
            slot.last_use = self._last_h2d = self._copies(self.h2d, "h2d", pairs)
            # The compute stream waits for the weights once, in end_step: a wait here would
            # also hold back the backward kernels queued after it (overlap_backward).
            # The other slot goes next: this one's copy overlaps the next update.
            self.weights.reverse()

    def weights_landed(self) -> None:
        """This thread's stream waits the weights copied to the device so far (the h2d
        stream runs in order): work queued on it next reads the updated weights."""
        b = self.backend
        self._order(b.current_stream(), self._last_h2d,
                    "the updated weights, before work queued next reads them")
        b.host_sync(b.current_stream())

    # -- step boundaries ---------------------------------------------------------------------

    def end_step(self, stats: StepStats) -> None:
        """The step's copies are done (the weights on the device before step() returns) and
        counted in `stats`."""
        b = self.backend
        # The h2d stream runs in order: its last weights copy ends after all the others.
        self._order(b.current_stream(), self._last_h2d,
                    "the new weights, before the next forward")
        b.host_sync(b.current_stream())
        b.check_idle([self.d2h, self.h2d])
        # Not for correctness (the compute stream waits the weights): their figures.
        self._host_waits(self._last_h2d, "the figures of the last weights copy")
        for span in self._spans:
            b.synchronize(span.end)
            seconds = b.elapsed(span.start, span.end)
            if span.direction == "h2d":
                stats.h2d_bytes += span.nbytes
                stats.h2d_seconds += seconds
            else:
                stats.d2h_bytes += span.nbytes
                stats.d2h_seconds += seconds
        self._spans.clear()
        for staged in self._staged.values():  # not expected: a wasted copy, nothing worse
            staged.slot.holds = None
        self._staged.clear()

    def settle(self) -> None:
        """Every queued copy and kernel done; nothing staged (a failed step, or resizing)."""
        b = self.backend
        for stream in (b.current_stream(), self.d2h, self.h2d):
            b.synchronize(b.record(stream))
        self._staged.clear()
        self._spans.clear()
        self._reading = None
        for slots in ("dev", "grads", "weights"):
            for slot in getattr(self, slots, []):
                slot.holds = None


def _placed(part: Partition, width: int) -> list[int]:
    """The byte offset of each of `part`'s segments in a host slot of `width` bytes per
    element: where its first element lies in its parameter's own memory, modulo ALIGN. A
    reduction over the host copy (a third-party step's norm or dot product) then adds its
    terms in the order it would over the parameter: vectorised sums split by address."""
    out, end = [], 0
    for s in part.segments:
        at = -(-end // ALIGN) * ALIGN + (s.start * s.param.element_size()) % ALIGN
        out.append(at)
        end = at + s.length * width
    return out


def _slice(buf: torch.Tensor, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` elements of `dtype` at byte `start` of the uint8 `buf`."""
    return buf[start: start + numel * dtype.itemsize].view(dtype)


def _record(part: Partition, views: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole uint8 record in host memory that `views` look into."""
    from tiermem.partition import record_of

    return record_of(part, views)
