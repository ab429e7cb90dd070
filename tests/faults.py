"""A fault-injecting wrapper around an I/O backend, for tests."""

from __future__ import annotations

import errno as _errno
from collections import Counter
from typing import Any

from tiermem.io.backend import FailedTransfer  # noqa: F401 - re-exported for the tests
from tiermem.io.native_transfer import NativeTransfer


class Held(NativeTransfer):
    """A real write that looks in flight until waited for: a read into its memory always
    follows it (IOEngine.read(after=...)), however fast the disk moved it."""

    __slots__ = ("_waited",)

    def __init__(self, real: NativeTransfer) -> None:
        super().__init__(real._owner, real._req, real._wait, real._after)
        self._waited = False

    def done(self) -> bool:
        return self._waited

    def wait(self, timeout: float | None) -> bool:
        self._waited = self._waited or super().wait(timeout)
        return self._waited


class LateFailure(Held):
    """A real write that lands whole but reports `err` once waited for, and is in flight
    until then: a read into its memory follows it (IOEngine.read(after=...)) and takes all
    of that memory, as it would where a disk fails only after the write's last piece."""

    __slots__ = ("_err",)

    def __init__(self, real: NativeTransfer, err: int) -> None:
        super().__init__(real)
        self._err = err

    def failure(self) -> tuple[int, int, int] | None:
        return (self._err, self._req.offset, self._req.len) if self._waited else None


class FaultyBackend:
    """Delegates to a real backend, but the n-th read or write (0-based, counted per op)
    fails with `err`, and so does each reissue of that same transfer (same op, file and
    offset) until it has failed `times` times: a transient fault when times <= io.retries,
    a persistent one beyond. late: a faulty write lands and fails only when waited for
    (LateFailure); `followed` counts the reads that followed one."""

    def __init__(self, inner: Any, op: str, nth: int, *, err: int = _errno.EIO,
                 times: int = 1, late: bool = False) -> None:
        self.inner, self.op, self.nth, self.err, self.times = inner, op, nth, err, times
        self.late = late
        self.name = inner.name
        self.count: Counter = Counter()
        self.injected = 0
        self.followed = 0
        self._target: tuple | None = None

    def submit(self, *, op: str, file: int, addr: int, nbytes: int, offset: int,
               buf_index: int, **kw: Any) -> Any:
        k = self.count[op]
        self.count[op] += 1
        key = (op, file, offset)
        if op == self.op and k == self.nth:
            self._target = key
        self.followed += isinstance(kw.get("after"), LateFailure)
        if key == self._target and self.injected < self.times:
            self.injected += 1
            if self.late and op == "write":
                return LateFailure(self.inner.submit(
                    op=op, file=file, addr=addr, nbytes=nbytes, offset=offset,
                    buf_index=buf_index, **kw), self.err)
            return FailedTransfer(self.err, offset, nbytes)
        return self.inner.submit(op=op, file=file, addr=addr, nbytes=nbytes, offset=offset,
                                 buf_index=buf_index, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class HoldWrites:
    """Delegates to a real backend; every write comes back Held."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name

    def submit(self, *, op: str, **kw: Any) -> Any:
        t = self.inner.submit(op=op, **kw)
        return Held(t) if op == "write" else t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def inject(tm: Any, op: str, nth: int, **kw: Any) -> FaultyBackend:
    """Wrap the engine of an Offload handle (tiermem.offload(...) as tm)."""
    engine = tm.offloaded.tiers.engine
    faulty = FaultyBackend(engine._backend, op, nth, **kw)
    engine._backend = faulty
    return faulty
