"""Turn what callers pass as an I/O buffer into (address, length, owner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tiermem._lib import ffi


@dataclass(frozen=True)
class BufferRef:
    """Raw view of a caller's buffer; `owner` keeps its memory alive while I/O uses it."""

    addr: int
    nbytes: int
    owner: Any


def buffer_ref(buf: Any, *, for_read: bool) -> BufferRef:
    """Validate `buf` (CPU contiguous tensor or buffer-protocol object) and take its address.

    `for_read` means the engine will write into it, so it must be writable.
    """
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"I/O buffer is on {buf.device}; tiermem reads and writes "
                             "CPU tensors (copy to a pinned host buffer first)")
        if not buf.is_contiguous():
            raise ValueError("I/O buffer tensor is not contiguous; pass .contiguous() "
                             "or a slice of an aligned buffer")
        return BufferRef(buf.data_ptr(), buf.numel() * buf.element_size(), buf)
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"I/O buffer must be a CPU torch.Tensor or support the buffer "
                        f"protocol, not {type(buf).__name__}") from None
    with view:  # released at once: only the cffi object below may hold the export
        if not view.c_contiguous:
            raise ValueError("I/O buffer is not C-contiguous")
        if for_read and view.readonly:
            raise ValueError(f"cannot read into a read-only buffer ({type(buf).__name__})")
        nbytes = view.nbytes
    if nbytes == 0:
        return BufferRef(0, 0, buf)
    # One owner of the buffer export (the cffi object, which also keeps `buf`
    # alive): a memoryview held beside it could be cleared first by the cycle
    # collector and crash the interpreter when the cffi object is freed.
    cdata = ffi.from_buffer("char[]", buf, require_writable=for_read)
    return BufferRef(int(ffi.cast("uintptr_t", cdata)), nbytes, cdata)
