"""SIGINT / SIGTERM while optimizer state is in the tiers.

Inside `tiermem.offload()` SIGTERM is delivered as an exception (like Ctrl-C
already is), so a terminated job leaves the block the same way a failed one
does: write-backs complete, the state goes back into the optimizer or stays
on disk, and the user is told which. While that exit runs, both signals are
held back: a second Ctrl-C cannot leave a swap directory half deleted or a
manifest half written. One that arrives is delivered once the exit is done.
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
