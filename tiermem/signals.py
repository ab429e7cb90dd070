"""SIGINT / SIGTERM while optimizer state is in the tiers.

Inside `tiermem.offload()` SIGTERM is delivered as an exception (like Ctrl-C
already is), so a terminated job leaves the block the same way a failed one
does: write-backs complete, the state goes back into the optimizer or stays
on disk, and the user is told which. While that exit runs, both signals are
held back: a second Ctrl-C cannot leave a swap directory half deleted or a
manifest half written. One that arrives is delivered once the exit is done.

During a step (and any single-record access) the signals are deferred to safe
points instead: between partitions, where no write is half issued and every
buffer is either idle or owned by a request in flight. An exception raised in
the middle of sealing a record or issuing its write would leave the swap
store's bookkeeping ahead of the disk (a generation counted but never written).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

HELD = {signal.SIGINT, signal.SIGTERM}


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived inside tiermem.offload(); a KeyboardInterrupt so `except Exception`
    in the training loop does not swallow it."""


_deferring: "_Deferral | None" = None


class _Deferral:
    """Signals that arrived inside deferred(), and the handlers they are meant for."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.previous: dict[int, object] = {}

    def deliver(self) -> None:
        """Raise the first pending signal again with the handler it was meant for in place,
        as held() does (several Ctrl-C while deferred count as one)."""
        if not self.pending:
            return
        signum = self.pending[0]
        self.pending.clear()
        mine = signal.signal(signum, self.previous[signum])
        try:
            signal.raise_signal(signum)  # its handler runs here (or its default action)
        finally:
            signal.signal(signum, mine)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(f"{signal.Signals(signum).name} received")


@contextmanager
def terminate_as_exception() -> Iterator[None]:
    """In the main thread, turn SIGTERM into Terminated for the duration."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the duration; one that arrived is raised at the end.

    (A signal mask would not do: the kernel hands a process-directed signal to any
    thread that does not block it, such as the I/O workers, and Python then runs the
    handler in the main thread all the same.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in HELD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if arrived:
            signal.raise_signal(arrived[0])


@contextmanager
def deferred() -> Iterator[None]:
    """Defer SIGINT and SIGTERM to safe_point() calls inside the block, or to its end.

    Only in the main thread (where Python runs handlers) and only once: an inner
    deferred() inside an outer one adds nothing."""
    global _deferring
    if _deferring is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    d = _Deferral()
    d.previous = {s: signal.signal(s, lambda signum, frame: d.pending.append(signum))
                  for s in HELD}
    _deferring = d
    try:
        yield
    finally:
        _deferring = None
        for s, handler in d.previous.items():
            signal.signal(s, handler)
        # Even over an error in flight (it becomes the signal's __context__): a loop that
        # catches the error and goes on must still be stopped.
        d.deliver()


def safe_point() -> None:
    """Raise a signal deferred so far (main thread only): the caller holds no half-done
    write, so leaving from here is clean."""
    d = _deferring
    if d is not None and d.pending and threading.current_thread() is threading.main_thread():
        d.deliver()
