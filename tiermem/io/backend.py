"""The interface both I/O backends implement, so IOEngine never cares which one runs.

A backend moves bytes and reports failures; validation, file bookkeeping and
error messages live in IOEngine, above it.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence


class Transfer(Protocol):
    """One submitted read or write, as the backend tracks it."""

    def done(self) -> bool:
        """True once every byte moved or the transfer failed."""

    def wait(self, timeout: float | None) -> bool:
        """Block (GIL released) until done; False on timeout."""

    def failure(self) -> tuple[int, int, int] | None:
        """(positive errno, offset, length) of the first failed piece, or None."""

    @property
    def resubmits(self) -> int:
        """Short transfers and EAGAINs the backend requeued."""

    def interval_ns(self) -> tuple[int, int]:
        """CLOCK_MONOTONIC ns at submission and at completion (valid once done)."""

    def landed(self) -> int:
        """Bytes from its start whose pieces all landed (frozen at a failure)."""


class FailedTransfer:
    """A transfer that 'completed' with an errno without touching the disk: a read the
    engine cancels before it starts (the write it was to follow had failed), or a fault a
    test injects."""

    resubmits = 0

    def __init__(self, err: int, offset: int, length: int) -> None:
        self._failure = (err, offset, length)
        self._t = time.monotonic_ns()

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None) -> bool:
        return True

    def failure(self) -> tuple[int, int, int]:
        return self._failure

    def interval_ns(self) -> tuple[int, int]:
        return self._t, self._t

    def landed(self) -> int:
        return 0


class Backend(Protocol):
    name: str

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        """Register (address, length) regions for fixed-buffer I/O; False if not supported."""

    def unregister_buffers(self) -> None: ...

    def add_file(self, fd: int) -> int:
        """A token for `fd` to pass to submit (a fixed-file slot or the fd itself)."""

    def remove_file(self, token: int) -> None: ...

    def submit(self, *, op: str, file: int, addr: int, nbytes: int, offset: int,
               buf_index: int, after: Transfer | None = None) -> Transfer:
        """Start a transfer; a read with `after` (a write of this backend in flight)
        takes each piece of its memory only once that write has sent it, and is
        cancelled (ECANCELED) where it got to if that write fails."""

    def close(self) -> None:
        """Finish every submitted transfer, then release the backend's resources."""
