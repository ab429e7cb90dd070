"""Page-aligned, huge-page backed, page-locked host buffers, and a pool of them.

Buffers are allocated once and kept: first touch of fresh memory costs about
0.45 GB/s in the VMs we run on, and pinning per step would cost more. The pool
is what the pipeline streams partitions through; an I/O engine registers its
buffers with the ring so the kernel need not map pages per request.
"""

from __future__ import annotations

import errno as _errno
import os
import threading
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tiermem._lib import ffi, lib
from tiermem.errors import TierMemWarning
from tiermem.sysinfo import lockable_bytes

PAGE = 4096
KINDS = {0: "4k", 1: "thp", 2: "hugetlb", 3: "thp-fit"}

_warned_unlocked = False


@dataclass(frozen=True)
class BufferInfo:
    """How one aligned buffer is backed."""

    nbytes: int
    mapped_bytes: int
    # "hugetlb", "thp" (transparent huge pages asked for), "thp-fit" (those over the
    # whole 2 MiB extents, 4 KiB pages for the tail) or "4k"
    pages: str
    locked: bool  # page-locked by mlock or cudaHostRegister


def _warn_unlocked(nbytes: int, err: int, cuda_error: int = 0) -> None:
    global _warned_unlocked
    if _warned_unlocked:
        return
    _warned_unlocked = True
    if cuda_error:
        why = (f"cudaHostRegister failed: {_cuda_error_text(cuda_error)}. Copies between "
               "them and the GPU are staged and synchronous; check the GPU driver's limits "
               "on pinned memory")
    else:
        limit = lockable_bytes()
        limit_txt = "unlimited" if limit is None else f"{limit} bytes"
        why = (f"mlock: {os.strerror(err)}; RLIMIT_MEMLOCK is {limit_txt}. Raise the limit "
               "(`ulimit -l`, LimitMEMLOCK= in systemd) or grant CAP_IPC_LOCK")
    warnings.warn(f"tiermem: could not page-lock {nbytes} bytes of I/O buffers; they stay "
                  f"pageable ({why}).", TierMemWarning, stacklevel=3)


def _cuda_error_text(code: int) -> str:
    try:
        return f"{torch.cuda.cudart().cudaGetErrorString(code)} (cudaError {code})"
    except Exception:  # the message is a nicety; the code says it all
        return f"cudaError {code}"


_cudart: Any = None


def _clear_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error. torch's cudaHostRegister binding returns
    the error without clearing it, and the next kernel launch check in this thread
    (cudaGetLastError) would raise it against some unrelated op. torch does not bind
    cudaGetLastError: call it in the libcudart torch has loaded."""
    global _cudart
    if _cudart is None:
        import ctypes

        _cudart = False
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in sorted(paths):
            try:
                _cudart = ctypes.CDLL(path)
                break
            except OSError:
                continue
    if _cudart:
        _cudart.cudaGetLastError()


def _cuda_register(ptr: int, size: int) -> int:
    """Pin through CUDA (a GPU is present), so device copies from it are asynchronous.
    0, or the cudaError code of the failure (cleared from the thread's last error)."""
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    if rc:
        _clear_cuda_error()
    return rc


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8, *,
                  huge_pages: bool | Literal["fit"] = True, lock: bool = True) -> torch.Tensor:
    """An uninitialised CPU tensor of `nbytes` bytes on page-aligned, pre-touched memory.

    The storage is mapped with mmap (2 MiB huge pages when `huge_pages`, the size
    rounded up to whole ones; "fit": huge pages over its whole 2 MiB extents and 4 KiB
    pages for the rest, nothing mapped beyond the next 4 KiB), touched
    once, and page-locked when `lock` (cudaHostRegister when CUDA is present, else
    mlock; when neither is allowed it stays pageable and one warning says so). It
    is unmapped exactly once, when the last tensor viewing it is freed. The
    tensor's `tiermem_info` attribute is a BufferInfo.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes <= 0 or nbytes % itemsize:
        raise ValueError(f"aligned_empty: nbytes={nbytes} must be a positive multiple of "
                         f"the {dtype} item size ({itemsize})")
    use_cuda = torch.cuda.is_available()
    kind, locked, lock_err = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
    want = 2 if huge_pages == "fit" else int(bool(huge_pages))
    ptr = lib.tm_mem_alloc(nbytes, want, int(lock and not use_cuda),
                           kind, locked, lock_err)
    if ptr == ffi.NULL:
        raise MemoryError(f"aligned_empty: could not map {nbytes} bytes for an I/O buffer")
    mapped = lib.tm_mem_mapped_size(nbytes, kind[0])
    addr = int(ffi.cast("uintptr_t", ptr))
    cuda_error = _cuda_register(addr, mapped) if lock and use_cuda else None
    cuda_pinned = cuda_error == 0
    is_locked = bool(locked[0]) or cuda_pinned
    if lock and not is_locked:
        _warn_unlocked(nbytes, lock_err[0] or _errno.EPERM, cuda_error or 0)

    def _release(p: Any) -> None:
        # Runs once, when the last reference to the storage is gone: no tensor
        # or pending I/O can still point into the range.
        if cuda_pinned:
            torch.cuda.cudart().cudaHostUnregister(addr)
        lib.tm_mem_free(p, mapped)

    owner = ffi.gc(ffi.cast("char *", ptr), _release, size=mapped)
    # ffi.buffer keeps `owner` alive and torch.frombuffer keeps the buffer
    # alive for as long as the storage lives, so _release fires after both.
    flat = torch.frombuffer(ffi.buffer(owner, nbytes), dtype=torch.uint8)
    out = flat.view(dtype)
    out.tiermem_info = BufferInfo(nbytes, mapped, KINDS[kind[0]], is_locked)
    return out


class BufferPool:
    """`count` aligned buffers of `nbytes` each, handed out and taken back by the pipeline.

    The total is checked against `budget` (bytes) before anything is allocated.
    With `engine`, the buffers are registered with its ring as fixed buffers.
    """

    def __init__(self, count: int, nbytes: int, *, budget: int | None = None,
                 engine: Any = None, huge_pages: bool = True, lock: bool = True) -> None:
        if count < 1:
            raise ValueError(f"BufferPool: count={count} must be at least 1")
        if nbytes < PAGE or nbytes % PAGE:
            raise ValueError(f"BufferPool: nbytes={nbytes} must be a positive multiple of {PAGE}")
        # What gets locked is whole pages: a 4 KiB buffer on huge pages pins 2 MiB.
        total = count * lib.tm_mem_mapped_size(nbytes, 1 if huge_pages else 0)
        if budget is not None and total > budget:
            raise ValueError(f"BufferPool: {count} buffers x {nbytes} bytes map {total} bytes "
                             f"({'2 MiB' if huge_pages else '4 KiB'} pages), above the "
                             f"pinned-memory budget of {budget} bytes")
        self.count = count
        self.nbytes = nbytes
        self.buffers: list[torch.Tensor] = [
            aligned_empty(nbytes, huge_pages=huge_pages, lock=lock) for _ in range(count)]
        self._free: deque[int] = deque(range(count))
        self._index = {b.data_ptr(): i for i, b in enumerate(self.buffers)}
        self._cond = threading.Condition()
        self.registered = bool(engine is not None and engine.register_buffers(self.buffers))

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked memory the pool holds."""
        return sum(b.tiermem_info.mapped_bytes for b in self.buffers if b.tiermem_info.locked)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of memory the pool maps, locked or not."""
        return sum(b.tiermem_info.mapped_bytes for b in self.buffers)

    @property
    def available(self) -> int:
        """Buffers not handed out."""
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        """Take a free buffer, waiting up to `timeout` seconds (forever when None)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"BufferPool: no buffer came free within {timeout} s "
                                   f"(all {self.count} in use)")
            return self.buffers[self._free.popleft()]

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer taken with acquire()."""
        i = self._index.get(buf.data_ptr())
        with self._cond:
            if i is None or self.buffers[i] is not buf:
                raise ValueError("BufferPool.release: this tensor is not one of the pool's buffers")
            if i in self._free:
                raise ValueError(f"BufferPool.release: buffer {i} released twice")
            self._free.append(i)
            self._cond.notify()

    def describe(self) -> str:
        """One line: count, size, page kind and lock state."""
        pages = {b.tiermem_info.pages for b in self.buffers}
        locked = all(b.tiermem_info.locked for b in self.buffers)
        return (f"{self.count} x {self.nbytes} bytes, pages={'/'.join(sorted(pages))}, "
                f"locked={locked}, registered={self.registered}")


