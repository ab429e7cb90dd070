"""Record buffers handed out again instead of mapped afresh.

The parameter tier moves every weight and gradient through a buffer of its own
several times an iteration. From malloc, a freed buffer below glibc's mmap
threshold (which rises to 32 MiB as big blocks are freed) stays in the heap,
and the churn of buffers of every size leaves the process holding far more
than the window. Mapped on their own, they go back to the system when freed,
but every new mapping is paid again in page faults (most of the tier's own CPU
time in an iteration). So a buffer whose last view dies comes back here, by
size, and the next buffer of that size reuses it; cached bytes plus bytes in
use stay under `limit` (what the plan counts for the window and its write
buffers), above which a freed buffer is unmapped.
"""

from __future__ import annotations

import threading

import torch

from tiermem._lib import ffi
from tiermem.io.buffers import aligned_empty


class Recycler:
    """Page-aligned uint8 buffers by size, reused once every view of one is gone."""

    def __init__(self, limit: int, *, pinned: bool = False) -> None:
        """pinned: page-locked buffers (cudaHostRegister with CUDA), for copies to and from
        a GPU that run asynchronously; registered once each, reused like the others."""
        self.limit = limit
        self.pinned = pinned
        self.free: dict[int, list[torch.Tensor]] = {}
        self.cached = 0  # bytes in `free`
        self.in_use = 0  # bytes handed out and still viewed
        self.mapped = 0  # fresh mappings made (for tests and benches)
        self._lock = threading.Lock()  # a view can die on an I/O thread

    def get(self, nbytes: int) -> torch.Tensor:
        """A buffer of `nbytes` (contents undefined), page-aligned for O_DIRECT."""
        with self._lock:
            spare = self.free.get(nbytes)
            raw = None
            if spare:
                raw = spare.pop()
                self.cached -= nbytes
                if not spare:
                    del self.free[nbytes]
            self.in_use += nbytes
        if raw is None:
            with self._lock:  # cached buffers of other sizes make room first
                while self.free and self.in_use + self.cached > self.limit:
                    size, spare = next(iter(self.free.items()))
                    spare.pop()
                    self.cached -= size
                    if not spare:
                        del self.free[size]
            # huge pages where whole ones fit: the virtio disk splits a transfer at every
            # physical discontinuity of its buffer, and on 4 KiB pages moved the weights
            # at half the rate (1.4 against 2.7 GB/s reading, one 6.25 MiB weight at a
            # time); the tail on 4 KiB pages keeps the mapping within 4 KiB of the size
            raw = aligned_empty(nbytes, huge_pages="fit", lock=self.pinned)
            self.mapped += 1
        # A storage of its own over raw's memory: when its last view dies, the handle's
        # release gives raw back (raw itself stays referenced, so nothing is unmapped).
        handle = ffi.gc(ffi.cast("char *", raw.data_ptr()),
                        lambda _p, raw=raw: self._back(raw), size=nbytes)
        return torch.frombuffer(ffi.buffer(handle, nbytes), dtype=torch.uint8)

    def _back(self, raw: torch.Tensor) -> None:
        n = raw.numel()
        with self._lock:
            self.in_use -= n
            if self.in_use + self.cached + n <= self.limit:
                self.free.setdefault(n, []).append(raw)
                self.cached += n
                return
        # over the limit: raw goes out of scope here and its mapping with it

    def clear(self) -> None:
        """Unmap every cached buffer."""
        with self._lock:
            self.free.clear()
            self.cached = 0
