"""Thread-pool backend: pread/pwrite of block_size pieces on pthreads (native/thread_pool.c).

Used where io_uring is unavailable (old kernels, kernel.io_uring_disabled,
container seccomp) or when asked for. Like the io_uring engine (a ring per
direction) it has threads per direction, so reads never queue behind writes for
a thread; each direction's pieces go in submission order, short transfers and
EAGAIN are requeued, and no Python runs per piece.
"""

from __future__ import annotations

import os
from typing import Sequence

from tiermem._lib import ffi, lib
from tiermem.errors import TierMemIOError
from tiermem.io.native_transfer import NativeTransfer, new_request

MAX_THREADS = 32
OPS = {"read": 0, "write": 1}


class ThreadBackend:
    name = "threads"

    def __init__(self, queue_depth: int, block_size: int) -> None:
        out = ffi.new("tm_pool **")
        # One thread per piece in flight, queue_depth per direction as the io_uring
        # engine keeps queue_depth pieces per ring: each blocks in one pread/pwrite.
        rc = lib.tm_pool_create(min(queue_depth, MAX_THREADS), block_size, out)
        if rc < 0:
            raise TierMemIOError(f"I/O thread pool could not start: {os.strerror(-rc)}",
                                 op="pthread_create", errno=-rc)
        self._pool = out[0]

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        return False

    def unregister_buffers(self) -> None:
        pass

    def add_file(self, fd: int) -> int:
        return fd

    def remove_file(self, token: int) -> None:
        pass

    def submit(self, *, op: str, file: int, addr: int, nbytes: int, offset: int,
               buf_index: int, after: NativeTransfer | None = None) -> NativeTransfer:
        req = new_request(ffi, op=OPS[op], fd=file, fixed_file=False, buf_index=-1,
                          addr=addr, nbytes=nbytes, offset=offset, after=after)
        rc = lib.tm_pool_submit(self._pool, req)
        if rc < 0:
            raise TierMemIOError(f"thread pool submit failed: {os.strerror(-rc)}", op=op,
                                 errno=-rc)
        return NativeTransfer(self._pool, req, lib.tm_pool_wait, after)

    def close(self) -> None:
        if self._pool is not None:
            # Every queued piece runs before the threads exit.
            lib.tm_pool_destroy(self._pool)
            self._pool = None
