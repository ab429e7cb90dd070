"""Every way an IOEngine request can be wrong or fail, and what the caller is told."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

from conftest import REPO, aligned, filled, pattern, read_file
from tiermem.errors import TierMemIOError, TierMemWarning
from tiermem.io import IOEngine

KiB = 1024


def assert_names_failure(exc: TierMemIOError, *, op: str, path, err: int) -> None:
    """The error carries and prints the operation, path and errno."""
    assert isinstance(exc, OSError)
    assert exc.op == op
    assert exc.path == str(path)
    assert exc.errno == err
    assert str(path) in str(exc)


# -- validation before submit ----------------------------------------------------------

# (what is unaligned, buffer start inside an aligned buffer, length, file offset)
UNALIGNED = [
    ("buffer address", 1, 4096, 0),
    ("buffer address", 512, 8192, 4096),
    ("offset", 0, 4096, 512),
    ("offset", 0, 4096, 4095),
    ("length", 0, 4095, 0),
    ("length", 0, 6000, 8192),
]


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("what,start,length,offset", UNALIGNED)
def test_o_direct_alignment_error_names_what_is_unaligned(engine, tmp_path, op, what, start,
                                                          length, offset):
    """With O_DIRECT an unaligned address/offset/length is a ValueError naming exactly that."""
    (tmp_path / "f").write_bytes(bytes(64 * KiB))
    buf = aligned(32 * KiB)[start:start + length]
    with engine.open(tmp_path / "f", "r+", direct=True) as f:
        with pytest.raises(ValueError) as info:
            getattr(engine, op)(f, buf, offset)
        assert engine.inflight() == 0
    msg = str(info.value)
    assert "4096" in msg
    listed = msg.split("unaligned:")[1].split(". Use")[0]  # "offset 512 (512 past ...)"
    named = {name for name in ("buffer address", "offset", "length") if f"{name} " in listed}
    assert named == {what}


# (file offset, length, direct)
PAST_EOF = [
    (0, 20 * KiB, True),
    (16 * KiB, 4 * KiB, True),
    (12 * KiB, 8 * KiB, True),
    (1, 16 * KiB, False),
    (16 * KiB - 1, 2, False),
    (1 << 40, 1, False),
]


@pytest.mark.parametrize("offset,length,direct", PAST_EOF)
def test_read_past_end_of_file_fails_at_submit(engine, tmp_path, offset, length, direct):
    """A read beyond the file's size raises TierMemIOError (ENODATA) before anything is queued."""
    path = tmp_path / "f"
    path.write_bytes(bytes(16 * KiB))
    with engine.open(path, "r", direct=direct) as f:
        with pytest.raises(TierMemIOError) as info:
            engine.read(f, aligned(length + 4095 & ~4095)[:length], offset)
        assert engine.inflight() == 0
    assert_names_failure(info.value, op="read", path=path, err=errno.ENODATA)
    assert (info.value.offset, info.value.length) == (offset, length)
    assert str(offset) in str(info.value)


BAD_BUFFERS = [
    ("non-contiguous tensor", lambda: torch.zeros(64, 64, dtype=torch.uint8).t(), ValueError,
     "contiguous"),
    ("non-contiguous numpy", lambda: np.zeros((64, 64), dtype=np.uint8)[:, ::2], ValueError,
     "contiguous"),
    ("meta-device tensor", lambda: torch.empty(4096, dtype=torch.uint8, device="meta"),
     ValueError, "meta"),
    ("str", lambda: "not a buffer", TypeError, "str"),
    ("list", lambda: [0] * 4096, TypeError, "list"),
    ("int", lambda: 4096, TypeError, "int"),
    ("None", lambda: None, TypeError, "NoneType"),
]


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("name,make,exc_type,word", BAD_BUFFERS, ids=[b[0] for b in BAD_BUFFERS])
def test_bad_buffer_kinds_are_refused(engine, tmp_path, op, name, make, exc_type, word):
    """Non-contiguous, non-CPU and non-buffer objects raise ValueError/TypeError at submit."""
    (tmp_path / "f").write_bytes(bytes(64 * KiB))
    with engine.open(tmp_path / "f", "r+", direct=False) as f:
        with pytest.raises(exc_type, match=word):
            getattr(engine, op)(f, make(), 0)
        assert engine.inflight() == 0


READ_ONLY_BUFFERS = {
    "bytes": lambda: bytes(4096),
    "memoryview of bytes": lambda: memoryview(bytes(4096)),
    "read-only numpy": lambda: np.frombuffer(bytes(4096), dtype=np.uint8),
}


@pytest.mark.parametrize("kind", list(READ_ONLY_BUFFERS))
def test_read_into_read_only_buffer_is_refused(engine, tmp_path, kind):
    """Reading into an immutable buffer is a ValueError; writing from it works."""
    path = tmp_path / "f"
    with engine.open(path, "w", direct=False) as f:
        buf = READ_ONLY_BUFFERS[kind]()
        assert engine.write(f, buf, 0).wait() == 4096
        with pytest.raises(ValueError, match="read-only"):
            engine.read(f, buf, 0)


@pytest.mark.parametrize("offset", [-1, -4096, 4096.0, "0", None])
def test_bad_offset_is_refused(engine, tmp_path, offset):
    """Offsets must be non-negative ints."""
    with engine.open(tmp_path / "f", "w", direct=False) as f:
        with pytest.raises(ValueError, match="offset"):
            engine.write(f, bytearray(8), offset)


def test_write_to_read_only_file_is_refused(engine, tmp_path):
    """A file opened "r" refuses writes with ValueError."""
    (tmp_path / "f").write_bytes(bytes(4096))
    with engine.open(tmp_path / "f", "r") as f:
        with pytest.raises(ValueError, match="read-only"):
            engine.write(f, aligned(4096), 0)
    assert read_file(tmp_path / "f") == bytes(4096)


@pytest.mark.parametrize("call", ["read", "write", "size"])
def test_closed_file_is_refused(engine, tmp_path, call):
    """A closed File raises ValueError for I/O and size()."""
    f = engine.open(tmp_path / "f", "w")
    engine.write(f, aligned(4096), 0).wait()
    f.close()
    with pytest.raises(ValueError, match="closed"):
        if call == "size":
            f.size()
        else:
            getattr(engine, call)(f, aligned(4096), 0)


def test_file_of_another_engine_is_refused(engine, tmp_path):
    """A File can only be used with the engine that opened it."""
    with IOEngine("threads") as other, other.open(tmp_path / "f", "w") as f:
        with pytest.raises(ValueError, match="not opened by this engine"):
            engine.write(f, aligned(4096), 0)


@pytest.mark.parametrize("kwargs", [dict(backend="uring"), dict(queue_depth=0),
                                    dict(queue_depth=5000), dict(block_size=1000),
                                    dict(block_size=6000), dict(block_size=2 << 30)])
def test_bad_engine_arguments(kwargs):
    """Unknown backends, queue depths outside 1..4096 and unaligned block sizes are refused."""
    with pytest.raises(ValueError):
        IOEngine(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(mode="a"), dict(mode="rw"), dict(direct="yes"),
                                    dict(direct=None)])
def test_bad_open_arguments(engine, tmp_path, kwargs):
    """Unknown modes and direct values are refused."""
    with pytest.raises(ValueError):
        engine.open(tmp_path / "f", **kwargs)


# -- failures reported by the OS ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["r", "r+"])
def test_open_missing_file_names_the_path(engine, tmp_path, direct, mode):
    """Opening a nonexistent file for reading is a TierMemIOError (ENOENT) naming the path."""
    path = tmp_path / "no" / "such-file"
    with pytest.raises(TierMemIOError) as info:
        engine.open(path, mode, direct=direct)
    assert_names_failure(info.value, op="open", path=path, err=errno.ENOENT)


@pytest.mark.parametrize("mode,name", [("w", "new-file"), ("r+", "existing")])
def test_open_for_write_on_read_only_filesystem(engine, readonly_dir, direct, mode, name):
    """Opening for writing on a read-only mount is a TierMemIOError (EROFS) naming the path."""
    path = readonly_dir / name
    with pytest.raises(TierMemIOError) as info:
        engine.open(path, mode, direct=direct)
    assert_names_failure(info.value, op="open", path=path, err=errno.EROFS)
    with engine.open(readonly_dir / "existing", "r", direct=direct) as f:  # reading still works
        assert f.size() == 4096


def _fill_tiny_tmpfs(engine, tiny_tmpfs, direct):
    f = engine.open(tiny_tmpfs / "big", "w", direct=direct)
    return f, engine.write(f, aligned(4 << 20), 0)


def test_no_space_left(engine, tiny_tmpfs, direct):
    """Writing 4 MiB to a 1 MiB tmpfs fails with a write TierMemIOError naming ENOSPC."""
    f, req = _fill_tiny_tmpfs(engine, tiny_tmpfs, direct)
    with pytest.raises(TierMemIOError) as info:
        req.wait()
    exc = info.value
    assert_names_failure(exc, op="write", path=f.path, err=errno.ENOSPC)
    assert "No space left" in str(exc) and "ENOSPC" in str(exc)
    assert 0 <= exc.offset and exc.length > 0 and exc.offset + exc.length <= 4 << 20
    assert str(exc.offset) in str(exc)


def test_wait_all_raises_an_unseen_failure_once(engine, tiny_tmpfs, direct):
    """wait_all() raises a failure nobody waited for, and does not raise it a second time."""
    _fill_tiny_tmpfs(engine, tiny_tmpfs, direct)
    with pytest.raises(TierMemIOError) as info:
        engine.wait_all()
    assert info.value.errno == errno.ENOSPC
    engine.wait_all()


def test_wait_all_does_not_repeat_a_failure_already_raised_by_wait(engine, tiny_tmpfs, direct):
    """A failure already raised by Request.wait() is not raised again by wait_all()."""
    _, req = _fill_tiny_tmpfs(engine, tiny_tmpfs, direct)
    with pytest.raises(TierMemIOError):
        req.wait()
    engine.wait_all()


def test_wait_all_raises_a_failure_only_polled_with_done(engine, tiny_tmpfs):
    """A failure seen only through done() (which never raises) is still raised by wait_all()."""
    _, req = _fill_tiny_tmpfs(engine, tiny_tmpfs, direct=False)
    for _ in range(200_000):
        if req.done():
            break
        time.sleep(0.0005)
    assert req.done()
    with pytest.raises(TierMemIOError):
        engine.wait_all()


# -- requests that cannot finish yet ------------------------------------------------------


@pytest.fixture
def stalled(backend, tmp_path):
    """(engine, request, release): a queue_depth-1 engine whose only slot is stuck in a write.

    Both backends: a 256 KiB write into a FIFO nobody reads (the pipe holds 64 KiB)
    blocks the write ring's only slot, or the pool's only write thread, until release()
    drains it.
    (Aligned tensors, not bytearrays: see test_request_on_bytearray_in_a_gc_cycle.)
    """
    eng = IOEngine(backend, queue_depth=1, block_size=4096)
    os.mkfifo(tmp_path / "fifo")
    f = eng.open(tmp_path / "fifo", "r+", direct=False)
    req = eng.write(f, aligned(256 * KiB), 0)

    def release():
        fd = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            for _ in range(200_000):
                if req.done():
                    return
                with contextlib.suppress(BlockingIOError):
                    os.read(fd, 1 << 16)
                time.sleep(0.0005)
        finally:
            os.close(fd)
    try:
        yield eng, req, release
    finally:
        release()
        eng.close()


@pytest.fixture
def stalled_read(backend, tmp_path):
    """(engine, release): a queue_depth-1 engine whose only read slot is stuck.

    Reads and writes have slots of their own (a ring each on io_uring, threads each on
    the threads backend), so a stuck write (`stalled`) holds no read back; a 4 KiB read
    from an empty FIFO holds the read ring's only slot, or the pool's only read thread,
    until release() writes those 4 KiB.
    """
    eng = IOEngine(backend, queue_depth=1, block_size=4096)
    os.mkfifo(tmp_path / "rfifo")
    f = eng.open(tmp_path / "rfifo", "r+", direct=False)
    req = eng.read(f, aligned(4 * KiB), 0)

    def release():
        if req.done():
            return
        # The engine's O_RDWR descriptor is a reader: this open does not block.
        fd = os.open(tmp_path / "rfifo", os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, bytes(4 * KiB))
        finally:
            os.close(fd)
        req.wait(timeout=60)
    try:
        yield eng, release
    finally:
        release()
        eng.close()


def test_wait_timeout_raises_and_request_stays_usable(stalled):
    """wait(timeout) on a stuck request raises TimeoutError; once unstuck, wait() succeeds."""
    eng, req, release = stalled
    with pytest.raises(TimeoutError, match="still in flight"):
        req.wait(timeout=0.05)
    with pytest.raises(TimeoutError):
        req.wait(timeout=0)
    assert not req.done()
    assert eng.inflight() == 1
    release()
    assert req.wait(timeout=60) == req.nbytes
    assert eng.inflight() == 0


def test_moving_says_whether_a_transfer_is_under_way(stalled, tmp_path):
    """IOEngine.moving() is True while a transfer is stuck and False once none is (what
    an update asks before it takes every thread), whether or not it was waited for."""
    eng, req, release = stalled
    assert eng.moving()
    release()
    assert not eng.moving()
    assert req.wait(timeout=60) == req.nbytes
    with eng.open(tmp_path / "f", "w", direct=False) as f:
        write = eng.write(f, aligned(4 * KiB), 0)
        for _ in range(20_000):  # landed, not waited for: no longer under way
            if not eng.moving():
                break
            time.sleep(0.0005)
        assert not eng.moving() and write.wait() == 4 * KiB


def _lands_beside(req, release, what: str) -> None:
    """req lands while the other direction's only slot is stuck; if it waits instead,
    free that slot first (so the file can close) and fail."""
    try:
        req.wait(timeout=10)
    except TimeoutError:
        release()
        req.wait(timeout=60)
        pytest.fail(f"the {what} waited for the stuck transfer of the other direction")


def test_read_runs_beside_a_stuck_write(stalled, tmp_path):
    """Reads have slots of their own on both backends (a ring per direction, threads per
    direction): with the only write slot stuck, a read still lands, and the write lands
    once released."""
    eng, req, release = stalled
    path = tmp_path / "src"
    src = pattern(64 * KiB, 5)
    path.write_bytes(src.numpy().tobytes())
    dst = aligned(64 * KiB)
    with eng.open(path, "r", direct=False) as f:
        _lands_beside(eng.read(f, dst, 0), release, "read")
    assert torch.equal(dst, src)
    assert not req.done()
    release()
    assert req.wait(timeout=60) == req.nbytes


def test_write_runs_beside_a_stuck_read(stalled_read, tmp_path):
    """The other way round: with the only read slot stuck, a write still lands."""
    eng, release = stalled_read
    src = pattern(64 * KiB, 6)
    with eng.open(tmp_path / "dst", "w", direct=False) as f:
        _lands_beside(eng.write(f, src, 0), release, "write")
    assert read_file(tmp_path / "dst") == src.numpy().tobytes()
    release()


def test_wait_with_huge_timeout(engine, tmp_path):
    """A very long timeout (1e9 s) behaves like no timeout on every backend."""
    with engine.open(tmp_path / "f", "w") as f:
        req = engine.write(f, aligned(4096), 0)
        assert req.wait(timeout=1e9) == 4096


def test_file_truncated_before_queued_reads_run(stalled_read, tmp_path):
    """Reads accepted at submit but run after the file shrank fail with ENODATA, not garbage."""
    eng, release = stalled_read
    path = tmp_path / "victim"
    path.write_bytes(bytes(range(256)) * 256)  # 64 KiB
    dst = aligned(64 * KiB)
    with eng.open(path, "r", direct=False) as f:
        tail = eng.read(f, dst[32 * KiB:], 32 * KiB)
        os.truncate(path, 16 * KiB)
        release()
        with pytest.raises(TierMemIOError) as info:
            tail.wait(timeout=60)
    assert_names_failure(info.value, op="read", path=path, err=errno.ENODATA)
    assert "unexpected end of file" in str(info.value)
    assert 32 * KiB <= info.value.offset < 64 * KiB


def test_file_truncated_while_reads_run(backend, tmp_path, direct):
    """Truncating a file under 64 queued reads: each one returns the right bytes or ENODATA."""
    n, size = 64, 256 * KiB
    src = filled(n * size, 31)
    path = tmp_path / "f"
    path.write_bytes(src.numpy().tobytes())
    dst = aligned(n * size)
    with IOEngine(backend, queue_depth=1, block_size=4096) as eng:
        with eng.open(path, "r", direct=direct) as f:
            reqs = [eng.read(f, dst[i * size:(i + 1) * size], i * size) for i in range(n)]
            os.truncate(path, 0)
            outcomes = []
            for i, req in enumerate(reqs):
                try:
                    req.wait(timeout=60)
                except TierMemIOError as exc:
                    assert exc.errno == errno.ENODATA, exc
                    assert "unexpected end of file" in str(exc)
                    outcomes.append("enodata")
                else:
                    piece = slice(i * size, (i + 1) * size)
                    assert torch.equal(dst[piece], src[piece]), f"request {i} read wrong bytes"
                    outcomes.append("ok")
    # 16384 sequential 4 KiB pieces cannot all finish before the truncate right after submit.
    assert "enodata" in outcomes


def test_truncated_file_fails_at_submit(engine, tmp_path, direct):
    """After a truncate, reads beyond the new size are refused at submit with ENODATA."""
    path = tmp_path / "f"
    path.write_bytes(bytes(64 * KiB))
    with engine.open(path, "r", direct=direct) as f:
        os.truncate(path, 16 * KiB)
        with pytest.raises(TierMemIOError) as info:
            engine.read(f, aligned(32 * KiB), 0)
    assert info.value.errno == errno.ENODATA


# -- filesystems that refuse O_DIRECT ---------------------------------------------------------


def test_direct_true_on_ramfs_names_the_filesystem(engine, ramfs_dir):
    """direct=True on ramfs (no O_DIRECT) is a TierMemIOError that says ramfs refuses it."""
    with pytest.raises(TierMemIOError, match="ramfs") as info:
        engine.open(ramfs_dir / "f", "w", direct=True)
    assert info.value.op == "open" and info.value.path == str(ramfs_dir / "f")


def test_direct_auto_on_ramfs_warns_once_and_works_buffered(engine, ramfs_dir,
                                                            reset_once_warnings):
    """direct="auto" on ramfs falls back to buffered I/O with one TierMemWarning naming ramfs."""
    src = filled(40_000, 5)  # deliberately not a multiple of 4096
    dst = aligned(40_960)[:40_000]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with engine.open(ramfs_dir / "a", "w", direct="auto") as a, \
                engine.open(ramfs_dir / "b", "w", direct="auto") as b:
            assert a.direct is False and b.direct is False
            engine.write(a, src, 123).wait()
            engine.read(a, dst, 123).wait()
    ours = [w for w in caught if issubclass(w.category, TierMemWarning)]
    assert len(ours) == 1 and "ramfs" in str(ours[0].message)
    assert torch.equal(src, dst)


# -- message formatting ---------------------------------------------------------------------


@pytest.mark.parametrize("op,err,words", [
    ("read", errno.EIO, ["Input/output error", "EIO"]),
    ("write", errno.ENOSPC, ["No space left on device", "ENOSPC"]),
    ("read", errno.ENODATA, ["unexpected end of file"]),
    ("write", errno.ENODATA, ["ENODATA"]),
])
def test_error_message_names_everything(op, err, words):
    """from_failure() builds a message with op, path, offset, length and the errno text."""
    exc = TierMemIOError.from_failure(op=op, path="/swap/part-3", offset=8192, length=4096,
                                      err=err)
    msg = str(exc)
    for word in [op, "/swap/part-3", "8192", "4096", *words]:
        assert word in msg
    assert (exc.op, exc.path, exc.offset, exc.length, exc.errno) == (
        op, "/swap/part-3", 8192, 4096, err)


# -- garbage collection -----------------------------------------------------------------------

GC_CYCLE_SCRIPT = """
import gc, sys
from tiermem.io import IOEngine
with IOEngine(sys.argv[1]) as eng, eng.open(sys.argv[2], "w", direct=False) as f:
    req = eng.write(f, bytearray(4096), 0)
    req.wait()
    holder = [req]
    holder.append(holder)  # a reference cycle made after the request, as tracebacks make
    del req, holder
    gc.collect()
print("collected")
"""


def test_request_on_bytearray_in_a_gc_cycle(backend, tmp_path):
    """A finished request on a bytearray that ends up in a reference cycle is collected cleanly.

    Run in a subprocess because the failure mode is a segfault in memoryview dealloc.
    """
    proc = subprocess.run([sys.executable, "-c", GC_CYCLE_SCRIPT, backend, str(tmp_path / "f")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-2000:]}"
    assert "collected" in proc.stdout
