"""Thread-pool backend: pread/pwrite of block_size pieces on queue_depth threads.

Used where io_uring is unavailable (old kernels, kernel.io_uring_disabled,
container seccomp) or when asked for. os.preadv/pwritev release the GIL, so the
threads overlap with Python compute just as the io_uring worker does. Like the
io_uring worker, pieces of reads are served before pieces of writes, each in
submission order.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import threading
import time
import itertools
import queue
from typing import Sequence

MAX_THREADS = 16


class ThreadTransfer:
    __slots__ = ("_lock", "_event", "_pending", "_failure", "_resubmits", "_t0", "_t1")

    def __init__(self, pieces: int) -> None:
        self._t0 = self._t1 = time.monotonic_ns()
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._pending = pieces
        self._failure: tuple[int, int, int] | None = None
        self._resubmits = 0
        if pieces == 0:
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._event.wait(timeout)

    def failure(self) -> tuple[int, int, int] | None:
        return self._failure

    @property
    def resubmits(self) -> int:
        return self._resubmits

    def interval_ns(self) -> tuple[int, int]:
        return self._t0, self._t1

    def _finish_piece(self, failure: tuple[int, int, int] | None, resubmits: int) -> None:
        with self._lock:
            if failure and self._failure is None:
                self._failure = failure
            self._resubmits += resubmits
            self._pending -= 1
            if self._pending == 0:
                self._t1 = time.monotonic_ns()
                self._event.set()


def _move(op: str, fd: int, addr: int, nbytes: int, offset: int, xfer: ThreadTransfer) -> None:
    """Move one piece, requeueing short transfers and EAGAIN/EINTR until it is whole."""
    done = resubmits = 0
    failure = None
    if xfer._failure is None:  # a failed transfer stops issuing pieces
        view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
        while done < nbytes:
            try:
                if op == "read":
                    n = os.preadv(fd, [view[done:]], offset + done)
                else:
                    n = os.pwritev(fd, [view[done:]], offset + done)
            except (BlockingIOError, InterruptedError):
                resubmits += 1
                continue
            except OSError as exc:
                failure = (exc.errno or _errno.EIO, offset + done, nbytes - done)
                break
            if n == 0:
                failure = (_errno.ENODATA if op == "read" else _errno.EIO,
                           offset + done, nbytes - done)
                break
            done += n
            resubmits += done < nbytes
    xfer._finish_piece(failure, resubmits)


class ThreadBackend:
    name = "threads"

    def __init__(self, queue_depth: int, block_size: int) -> None:
        self._block = block_size
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._worker, name=f"tiermem-io-{i}",
                                          daemon=True)
                         for i in range(min(queue_depth, MAX_THREADS))]
        for t in self._threads:
            t.start()

    def _worker(self) -> None:
        while True:
            _prio, _seq, piece = self._queue.get()
            if piece is None:
                return
            _move(*piece)

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        return False

    def unregister_buffers(self) -> None:
        pass

    def add_file(self, fd: int) -> int:
        return fd

    def remove_file(self, token: int) -> None:
        pass

    def submit(self, *, op: str, file: int, addr: int, nbytes: int, offset: int,
               buf_index: int) -> ThreadTransfer:
        starts = range(0, nbytes, self._block)
        xfer = ThreadTransfer(len(starts))
        prio = 0 if op == "read" else 1
        for s in starts:
            self._queue.put((prio, next(self._seq),
                             (op, file, addr + s, min(self._block, nbytes - s), offset + s, xfer)))
        return xfer

    def close(self) -> None:
        # The stop markers sort after every queued piece, so all of them run first.
        for _ in self._threads:
            self._queue.put((2, next(self._seq), None))
        for t in self._threads:
            t.join()
        self._threads = []
