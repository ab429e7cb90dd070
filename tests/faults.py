"""A fault-injecting wrapper around an I/O backend, for tests."""

from __future__ import annotations

import errno as _errno
import time
from collections import Counter
from typing import Any


class FailedTransfer:
    """A transfer that 'completed' with an errno, without touching the disk."""

    def __init__(self, err: int, offset: int, length: int) -> None:
        self._failure = (err, offset, length)
        self._t = time.monotonic_ns()

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None) -> bool:
        return True

    def failure(self) -> tuple[int, int, int]:
        return self._failure

    @property
    def resubmits(self) -> int:
        return 0

    def interval_ns(self) -> tuple[int, int]:
        return self._t, self._t


class FaultyBackend:
    """Delegates to a real backend, but the n-th read or write (0-based, counted per op)
    fails with `err`, and so does each reissue of that same transfer (same op, file and
    offset) until it has failed `times` times: a transient fault when times <= io.retries,
    a persistent one beyond."""

    def __init__(self, inner: Any, op: str, nth: int, *, err: int = _errno.EIO,
                 times: int = 1) -> None:
        self.inner, self.op, self.nth, self.err, self.times = inner, op, nth, err, times
        self.name = inner.name
        self.count: Counter = Counter()
        self.injected = 0
        self._target: tuple | None = None

    def submit(self, *, op: str, file: int, addr: int, nbytes: int, offset: int,
               buf_index: int) -> Any:
        k = self.count[op]
        self.count[op] += 1
        key = (op, file, offset)
        if op == self.op and k == self.nth:
            self._target = key
        if key == self._target and self.injected < self.times:
            self.injected += 1
            return FailedTransfer(self.err, offset, nbytes)
        return self.inner.submit(op=op, file=file, addr=addr, nbytes=nbytes, offset=offset,
                                 buf_index=buf_index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def inject(tm: Any, op: str, nth: int, **kw: Any) -> FaultyBackend:
    """Wrap the engine of an Offload handle (tiermem.offload(...) as tm)."""
    engine = tm.offloaded.tiers.engine
    faulty = FaultyBackend(engine._backend, op, nth, **kw)
    engine._backend = faulty
    return faulty
