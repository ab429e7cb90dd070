"""IOEngine: asynchronous reads and writes of whole buffers at file offsets.

It validates every request before anything reaches the kernel (alignment under
O_DIRECT, bounds, buffer kind, open/closed state), tracks what is in flight per
file, and turns a backend's raw failure into a TierMemIOError that names the
operation, file, offset, length and errno. The bytes are moved by a backend:
io_uring (native/io_engine.c) or a pread/pwrite thread pool.
"""

from __future__ import annotations

import errno as _errno
import os
import stat
import threading
import warnings
import weakref
from typing import Any, Literal, Sequence

from tiermem.errors import TierMemIOError, TierMemWarning
from tiermem.io import uring_backend
from tiermem.io.backend import FailedTransfer
from tiermem.io.buffer_ref import BufferRef, buffer_ref
from tiermem.io.native_transfer import NativeTransfer
from tiermem.io.thread_backend import ThreadBackend
from tiermem.io.uring_backend import UringBackend
from tiermem.sysinfo import mount_of

DIRECT_ALIGN = 4096
MiB = 1 << 20
BackendName = Literal["auto", "io_uring", "threads"]
Direct = bool | Literal["auto"]
MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC,  # read-write so a swap file can be read back
}

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, TierMemWarning, stacklevel=4)


def io_uring_status() -> tuple[bool, str]:
    """Whether io_uring works in this process, decided by a real io_uring_setup, and why not."""
    return _uring_status(uring_backend.probe())


def _uring_status(err: int) -> tuple[bool, str]:
    if err == 0:
        return True, "io_uring_setup works"
    hints = {
        _errno.ENOSYS: "the kernel has no io_uring",
        _errno.EPERM: "denied: kernel.io_uring_disabled or a seccomp filter",
        _errno.EACCES: "denied by a security module",
    }
    return False, f"io_uring_setup failed: {os.strerror(err)} ({hints.get(err, 'unexpected')})"


class File:
    """A file opened through an IOEngine; pass it to read() and write()."""

    def __init__(self, engine: "IOEngine", path: str, fd: int, token: int, mode: str,
                 direct: bool) -> None:
        self.engine = engine
        self.path = path
        self.fd = fd
        self.mode = mode
        self.direct = direct
        self._token = token
        self._inflight: set[Request] = set()
        self.closed = False
        # Sizes bound reads of regular files only: a pipe or device has no fixed end.
        self.regular = stat.S_ISREG(os.fstat(fd).st_mode)

    def size(self) -> int:
        """Current size in bytes (fstat)."""
        self._check_open()
        return os.fstat(self.fd).st_size

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"I/O on closed file {self.path}")

    def close(self) -> None:
        """Wait for this file's transfers, then close it. Idempotent."""
        if self.closed:
            return
        for req in list(self._inflight):
            req._settle()
        self.closed = True
        self.engine._forget_file(self)
        # Safe to close: nothing in flight references this fd any more.
        os.close(self.fd)

    def __enter__(self) -> "File":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.fd}"
        return f"<tiermem.io.File {self.path!r} mode={self.mode} direct={self.direct} {state}>"


_CANCEL = object()  # _dependency's answer for a read whose write had failed


class Request:
    """Handle of one submitted read or write."""

    def __init__(self, engine: "IOEngine", op: str, file: File, ref: BufferRef, offset: int,
                 transfer: Any, follows_write: bool = False) -> None:
        self.op = op
        self.file = file
        self.offset = offset
        self.nbytes = ref.nbytes
        self._engine = engine
        self._ref = ref  # keeps the buffer alive while the kernel may touch it
        self._transfer = transfer
        self._follows_write = follows_write  # issued with read(after=a write in flight)
        self._error: TierMemIOError | None = None
        self._settled = False
        self._raised = False

    def done(self) -> bool:
        """True once the transfer finished (successfully or not); never raises."""
        if not self._settled and self._transfer.done():
            self._settle()
        return self._settled

    def wait(self, timeout: float | None = None) -> int:
        """Block until done and return the bytes moved; raise TierMemIOError on failure.

        With a `timeout` (seconds) that runs out, raise TimeoutError; the
        request stays in flight.
        """
        if not self._settled and not self._transfer.wait(timeout):
            raise TimeoutError(f"{self.op} of {self.nbytes} bytes at offset {self.offset} in "
                               f"{self.file.path} still in flight after {timeout} s")
        self._settle()
        if self._error is not None:
            self._raised = True
            self._engine._seen(self)
            raise self._error
        return self.nbytes

    @property
    def resubmits(self) -> int:
        """Pieces of this transfer requeued after a short transfer or EAGAIN."""
        return self._transfer.resubmits

    @property
    def landed(self) -> int:
        """Bytes from the start of the buffer whose transfer finished, a multiple of 4096
        unless it is all of them; where a failed transfer stopped, once it is done. Of a
        write: what reached the file (a read that followed it, read(after=...), overwrote
        no more than this); of a read: what holds the file's bytes already (the rest may
        still change)."""
        n = self._transfer.landed()
        return n if n == self.nbytes else n & ~(DIRECT_ALIGN - 1)

    def interval(self) -> tuple[float, float]:
        """time.monotonic() seconds when submitted and when completed (once done)."""
        t0, t1 = self._transfer.interval_ns()
        return t0 / 1e9, t1 / 1e9

    def _settle(self) -> None:
        """Wait without raising and drop the engine's bookkeeping for this request."""
        if self._settled:
            return
        self._transfer.wait(None)
        failure = self._transfer.failure()
        if failure is not None:
            err, off, length = failure
            self._error = TierMemIOError.from_failure(
                op=self.op, path=self.file.path, offset=off, length=length, err=err,
                follows_write=self._follows_write)
        self._settled = True
        self._engine._retire(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return (f"<tiermem.io.Request {self.op} {self.nbytes} B @ {self.offset} "
                f"{self.file.path!r} {state}>")


def _close_backend(backend: Any, pid: int) -> None:
    """The engine's finalizer: close `backend`, in the process that started it only. In a
    child forked while it was open, the io_uring rings are mapped shared with the parent
    (draining them would reap the parent's completions) and the thread pool's threads live
    in the parent alone, its lock and conditions copied in whatever state they were in
    (destroying it hung in pthread_cond_broadcast); its memory stays with the child."""
    if os.getpid() == pid:
        backend.close()


class IOEngine:
    """Asynchronous file I/O over io_uring, or a thread pool where io_uring is unavailable.

    backend: "auto" probes io_uring_setup and falls back to "threads" with one
    warning; "io_uring" fails when it is unavailable; "threads" always works.
    Transfers are split into `block_size` pieces with up to `queue_depth` in
    flight: in all on the threads backend, per direction (reads, writes) on io_uring.
    """

    def __init__(self, backend: BackendName = "auto", queue_depth: int = 32,
                 block_size: int = MiB) -> None:
        if backend not in ("auto", "io_uring", "threads"):
            raise ValueError(f"IOEngine: backend={backend!r}; allowed: 'auto', 'io_uring', "
                             "'threads'")
        if not 1 <= queue_depth <= 4096:
            raise ValueError(f"IOEngine: queue_depth={queue_depth} must be in 1..4096")
        if block_size < DIRECT_ALIGN or block_size % DIRECT_ALIGN or block_size > 1 << 30:
            raise ValueError(f"IOEngine: block_size={block_size} must be a multiple of "
                             f"{DIRECT_ALIGN} between {DIRECT_ALIGN} and 1 GiB")
        self.queue_depth = queue_depth
        self.block_size = block_size
        self._backend = self._start_backend(backend)
        self.backend: str = self._backend.name
        # An engine dropped without close() still drains and frees its ring;
        # weakref callbacks run before the GC frees the buffers of its requests.
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _close_backend, self._backend, self._pid)
        self._lock = threading.Lock()
        self._inflight: set[Request] = set()
        self._unseen: list[Request] = []  # failed, and no wait() has raised it yet
        self._files: set[File] = set()
        self._regions: list[tuple[int, int]] = []
        self._registered_owners: list[Any] = []
        self.closed = False

    def _start_backend(self, backend: str):
        if backend == "threads":
            return ThreadBackend(self.queue_depth, self.block_size)
        err = uring_backend.probe()
        ok, why = _uring_status(err)
        if ok:
            return UringBackend(self.queue_depth, self.block_size)
        if backend == "io_uring":
            raise TierMemIOError(f"io_uring backend asked for but unavailable: {why}",
                                 op="io_uring_setup", errno=err)
        _warn_once("no-io-uring", f"tiermem: {why}; using the threads backend "
                                  "(pread/pwrite on a thread pool)")
        return ThreadBackend(self.queue_depth, self.block_size)

    # -- files -----------------------------------------------------------------

    def open(self, path: str | os.PathLike, mode: str = "r", direct: Direct = True, *,
             follow_symlinks: bool = True) -> File:
        """Open `path` for transfers.

        mode: "r" read-only, "r+" read-write, "w" create/truncate (read-write),
        new files 0600. direct: True requires O_DIRECT (error where the filesystem
        refuses it), "auto" falls back to buffered I/O with one warning, False is
        buffered. follow_symlinks=False refuses a path whose last part is a link.
        """
        self._check_open()
        if mode not in MODES:
            raise ValueError(f"IOEngine.open: mode={mode!r}; allowed: {', '.join(MODES)}")
        if direct not in (True, False, "auto"):
            raise ValueError(f"IOEngine.open: direct={direct!r}; allowed: True, False, 'auto'")
        path = os.fspath(path)
        flags = MODES[mode] | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
        use_direct = bool(direct)
        try:
            fd = os.open(path, flags | (os.O_DIRECT if use_direct else 0), 0o600)
        except OSError as exc:
            if not (use_direct and exc.errno == _errno.EINVAL):
                why = ("it is a symbolic link, and links are refused here"
                       if exc.errno == _errno.ELOOP and not follow_symlinks else exc.strerror)
                raise TierMemIOError(f"open {path} (mode {mode!r}) failed: {why}",
                                     op="open", path=path, errno=exc.errno) from None
            fs = mount_of(path).fstype
            if direct is True:
                raise TierMemIOError(
                    f"open {path}: the {fs} filesystem refuses O_DIRECT; put swap files on a "
                    "local disk filesystem (ext4, xfs) or open with direct='auto'/False",
                    op="open", path=path, errno=exc.errno) from None
            _warn_once(f"buffered:{fs}", f"tiermem: {path} is on a {fs} filesystem, which "
                       "refuses O_DIRECT; using buffered I/O there (slower, and the page "
                       "cache holds a second copy of the data)")
            use_direct = False
            fd = os.open(path, flags, 0o600)
        token = self._backend.add_file(fd)
        f = File(self, path, fd, token, mode, use_direct)
        with self._lock:
            self._files.add(f)
        return f

    def _forget_file(self, f: File) -> None:
        self._backend.remove_file(f._token)
        with self._lock:
            self._files.discard(f)

    # -- buffers ---------------------------------------------------------------

    def register_buffers(self, buffers: Sequence[Any]) -> bool:
        """Register buffers with the ring as fixed buffers (io_uring only).

        Returns whether the backend registered them. Requests on memory inside
        a registered buffer then skip the kernel's per-request page mapping.
        The engine keeps the buffers alive until unregistered or closed.
        """
        self._check_open()
        with self._lock:
            if self._inflight:
                raise ValueError("IOEngine.register_buffers: requests are in flight; "
                                 "register buffers before submitting I/O")
        refs = [buffer_ref(b, for_read=True) for b in buffers]
        self._backend.unregister_buffers()
        ok = self._backend.register_buffers([(r.addr, r.nbytes) for r in refs])
        self._regions = [(r.addr, r.nbytes) for r in refs] if ok else []
        self._registered_owners = [r.owner for r in refs] if ok else []
        return ok

    def _buffer_index(self, addr: int, nbytes: int) -> int:
        for i, (start, length) in enumerate(self._regions):
            if start <= addr and addr + nbytes <= start + length:
                return i
        return -1

    # -- transfers -------------------------------------------------------------

    def read(self, file: File, buffer: Any, offset: int, *,
             after: Request | None = None) -> Request:
        """Start reading len(buffer) bytes of `file` at `offset` into `buffer`.

        after: a write of this engine, maybe in flight, whose memory `buffer` reuses. The
        read takes each piece of that memory only once the write has sent it, so the two
        run together instead of one after the other. If that write fails, the rest of
        this read is cancelled (ECANCELED) and the memory keeps what the write had not
        sent yet; what it had sent is on the disk. A write already finished is no
        dependency; one that already failed cancels the read before it starts.
        """
        return self._submit("read", file, buffer, offset, after=after)

    def write(self, file: File, buffer: Any, offset: int) -> Request:
        """Start writing all of `buffer` to `file` at `offset`."""
        return self._submit("write", file, buffer, offset)

    def _submit(self, op: str, file: File, buffer: Any, offset: int,
                after: Request | None = None) -> Request:
        self._check_open()
        if not isinstance(file, File) or file.engine is not self:
            raise ValueError(f"{op}: {file!r} was not opened by this engine")
        file._check_open()
        if op == "write" and file.mode == "r":
            raise ValueError(f"write: {file.path} is open read-only (mode 'r')")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{op}: offset={offset!r} must be a non-negative int")
        ref = buffer_ref(buffer, for_read=op == "read")
        if file.direct:
            self._check_direct(op, file, ref, offset)
        if op == "read" and ref.nbytes and file.regular and offset + ref.nbytes > file.size():
            raise TierMemIOError(
                f"read of {ref.nbytes} bytes at offset {offset} runs past the end of "
                f"{file.path} (size {file.size()})", op="read", path=file.path,
                offset=offset, length=ref.nbytes, errno=_errno.ENODATA)
        dep = self._dependency(after)
        if dep is _CANCEL:
            transfer: Any = FailedTransfer(_errno.ECANCELED, offset, ref.nbytes)
        else:
            extra = {"after": dep} if dep is not None else {}
            transfer = self._backend.submit(op=op, file=file._token, addr=ref.addr,
                                            nbytes=ref.nbytes, offset=offset,
                                            buf_index=self._buffer_index(ref.addr, ref.nbytes),
                                            **extra)
        req = Request(self, op, file, ref, offset, transfer, follows_write=after is not None)
        with self._lock:
            self._inflight.add(req)
        file._inflight.add(req)
        return req

    def _dependency(self, after: Request | None) -> Any:
        """The backend transfer a read must follow piece by piece; None when `after` is
        absent or landed; _CANCEL when it failed (its memory holds the only copy of its
        bytes). A transfer the backend did not make itself (a test's wrapper) cannot be
        followed in C: it is waited for here instead."""
        if after is None:
            return None
        if not isinstance(after, Request) or after._engine is not self or after.op != "write":
            raise ValueError(f"read: after={after!r} must be a write of this engine")
        if after._settled or after._transfer.done():
            return _CANCEL if after._transfer.failure() is not None else None
        if isinstance(after._transfer, NativeTransfer):
            return after._transfer
        after._transfer.wait(None)
        return self._dependency(after)

    @staticmethod
    def _check_direct(op: str, file: File, ref: BufferRef, offset: int) -> None:
        bad = [f"{name} {val} ({val % DIRECT_ALIGN} past a {DIRECT_ALIGN}-byte boundary)"
               for name, val in (("buffer address", ref.addr), ("offset", offset),
                                 ("length", ref.nbytes)) if val % DIRECT_ALIGN]
        if bad:
            raise ValueError(f"{op} on {file.path} with O_DIRECT needs {DIRECT_ALIGN}-byte "
                             f"alignment; unaligned: {', '.join(bad)}. Use buffers from "
                             "tiermem.io.buffers.aligned_empty and aligned offsets/lengths.")

    def _retire(self, req: Request) -> None:
        with self._lock:
            self._inflight.discard(req)
            if req._error is not None:
                self._unseen.append(req)
        req.file._inflight.discard(req)

    def _seen(self, req: Request) -> None:
        """A wait() raised req's failure: it no longer needs reporting (nor keeping)."""
        with self._lock:
            if req in self._unseen:
                self._unseen.remove(req)

    def _raise_unseen(self) -> None:
        """Raise the first failure that no wait() has raised (one seen only via done())."""
        with self._lock:
            pending = [r for r in self._unseen if not r._raised]
            self._unseen = pending[1:]
        if pending:
            pending[0]._raised = True
            raise pending[0]._error

    def inflight(self) -> int:
        """Requests submitted and not yet waited for or seen done."""
        with self._lock:
            return len(self._inflight)

    def moving(self) -> bool:
        """Whether a transfer is under way now: one submitted and not finished (a finished
        one that nobody has waited for yet does not count)."""
        with self._lock:
            pending = list(self._inflight)
        return not all(r.done() for r in pending)

    def wait_all(self) -> None:
        """Wait for every request in flight; raise the first failure no one has seen yet."""
        with self._lock:
            pending = list(self._inflight)
        for req in pending:
            req._settle()
        self._raise_unseen()

    # -- lifetime --------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O on a closed IOEngine")

    def close(self) -> None:
        """Let every in-flight transfer finish, close files, free the ring. Idempotent.

        Then raise the first transfer failure nobody has seen (no wait() raised it)."""
        if self.closed:
            return
        if os.getpid() != self._pid:
            # A child forked while this engine was open: every transfer in flight is the
            # parent's (waiting for one here would reap the parent's completions).
            self._finalizer()  # _close_backend lets the parent's ring and threads be
            self.closed = True
            return
        with self._lock:
            pending = list(self._inflight)
        for req in pending:
            req._settle()
        for f in list(self._files):
            f.close()
        self._finalizer()  # backend.close(): every transfer has finished above
        self._regions, self._registered_owners = [], []
        self.closed = True
        self._raise_unseen()

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            self.close()
        except TierMemIOError:
            if exc_type is None:  # never mask the exception already on its way out
                raise

    def __repr__(self) -> str:
        return (f"<tiermem.io.IOEngine backend={self.backend} queue_depth={self.queue_depth} "
                f"block_size={self.block_size}{' closed' if self.closed else ''}>")
