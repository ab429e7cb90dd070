"""io_uring backend: a thin Python face over the C engine in native/io_engine.c."""

from __future__ import annotations

import os
from typing import Sequence

from tiermem._lib import ffi, lib
from tiermem.errors import TierMemIOError
from tiermem.io.native_transfer import NativeTransfer, new_request

FILE_SLOTS = 256
OPS = {"read": 0, "write": 1}


def probe() -> int:
    """0 when io_uring_setup works here, else the positive errno it failed with."""
    return -lib.tm_uring_probe()


class UringBackend:
    name = "io_uring"

    def __init__(self, queue_depth: int, block_size: int) -> None:
        out = ffi.new("tm_engine **")
        rc = lib.tm_engine_create(queue_depth, block_size, FILE_SLOTS, out)
        if rc < 0:
            raise TierMemIOError(f"io_uring engine could not start: io_uring_setup failed with "
                                 f"{os.strerror(-rc)}", op="io_uring_setup", errno=-rc)
        self._engine = out[0]

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        addrs = ffi.new("void *[]", [ffi.cast("void *", a) for a, _ in regions])
        lens = ffi.new("size_t[]", [n for _, n in regions])
        return lib.tm_engine_register_buffers(self._engine, addrs, lens, len(regions)) == 0

    def unregister_buffers(self) -> None:
        lib.tm_engine_unregister_buffers(self._engine)

    def add_file(self, fd: int) -> int:
        slot = lib.tm_engine_register_file(self._engine, fd)
        # Registered files save an fget/fput per request; when the table is
        # full or unsupported the plain fd works the same, a little slower.
        return slot if slot >= 0 else -1 - fd

    def remove_file(self, token: int) -> None:
        if token >= 0:
            lib.tm_engine_unregister_file(self._engine, token)

    def submit(self, *, op: str, file: int, addr: int, nbytes: int, offset: int,
               buf_index: int, after: NativeTransfer | None = None) -> NativeTransfer:
        req = new_request(ffi, op=OPS[op], fd=file if file >= 0 else -1 - file,
                          fixed_file=file >= 0, buf_index=buf_index, addr=addr,
                          nbytes=nbytes, offset=offset, after=after)
        rc = lib.tm_engine_submit(self._engine, req)
        if rc < 0:
            raise TierMemIOError(f"io_uring submit failed: {os.strerror(-rc)}", op=op, errno=-rc)
        return NativeTransfer(self._engine, req, lib.tm_engine_wait, after)

    def close(self) -> None:
        if self._engine is not None:
            # Drains every submitted request before freeing the ring.
            lib.tm_engine_destroy(self._engine)
            self._engine = None
