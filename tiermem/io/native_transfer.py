"""A transfer tracked by a C request struct: what both native backends hand back."""

from __future__ import annotations

from typing import Any, Callable



WAIT_SLICE_MS = 200
MAX_WAIT_MS = 2**31 - 1


class NativeTransfer:
    """A tm_request owned by Python until the C side marks it done."""

    __slots__ = ("_owner", "_req", "_wait", "_after")

    def __init__(self, owner: Any, req: Any, wait: Callable[[Any, Any, int], int],
                 after: "NativeTransfer | None" = None) -> None:
        self._owner = owner  # the C engine or pool
        self._req = req
        self._wait = wait  # lib.tm_engine_wait or lib.tm_pool_wait
        # The write this read follows: the C side reads its landed prefix until this one
        # is done, so its struct must outlive this one.
        self._after = after

    def done(self) -> bool:
        return bool(self._req.done)

    def wait(self, timeout: float | None) -> bool:
        if timeout is not None:
            ms = min(max(0, int(timeout * 1000)), MAX_WAIT_MS)  # the C side takes an int
            return self._wait(self._owner, self._req, ms) == 0
        # Sleep in slices so Python runs signal handlers (Ctrl-C) between them.
        while self._wait(self._owner, self._req, WAIT_SLICE_MS) != 0:
            pass
        return True

    def failure(self) -> tuple[int, int, int] | None:
        r = self._req
        if r.error == 0:
            return None
        return -r.error, r.error_offset, r.error_length

    @property
    def resubmits(self) -> int:
        return self._req.resubmits

    def landed(self) -> int:
        return self._req.landed

    def interval_ns(self) -> tuple[int, int]:
        return self._req.submit_ns, self._req.done_ns


def new_request(ffi: Any, *, op: int, fd: int, fixed_file: bool, buf_index: int, addr: int,
                nbytes: int, offset: int, after: NativeTransfer | None = None) -> Any:
    req = ffi.new("tm_request *")
    req.after = after._req if after is not None else ffi.NULL
    req.op = op
    req.fd = fd
    req.fixed_file = int(fixed_file)
    req.buf_index = buf_index
    req.buf = ffi.cast("char *", addr)
    req.len = nbytes
    req.offset = offset
    return req



