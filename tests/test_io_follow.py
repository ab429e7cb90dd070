"""A read that follows a write into the same memory (IOEngine.read(after=write)): each
piece of the read starts only once the write has sent the bytes it overwrites, so a
pipeline buffer's next record is read while its last one is still being written.

Both backends. The FIFO cases are deterministic: a pipe holds 64 KiB, so a write into a
FIFO nobody reads yet sends its first 64 KiB piece and stops; the read must take that
piece's memory and no more. Without the dependency the read overwrites the rest at once
and the FIFO receives the read's bytes instead of the write's."""

from __future__ import annotations

import errno
import os
import resource
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tiermem.errors import TierMemIOError
from tiermem.io import IOEngine
from tiermem.io.buffers import aligned_empty

BACKENDS = ["io_uring", "threads"]
KiB, MiB = 1 << 10, 1 << 20


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def until(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.001)
    return cond()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_read_takes_only_the_memory_its_write_has_sent(tmp_path, backend):
    n, piece = 256 * KiB, 64 * KiB
    old, new = pattern(n, 1), pattern(n, 2)
    new.tofile(tmp_path / "new")
    os.mkfifo(tmp_path / "fifo")
    # queue depth 1: the write's pieces go into the FIFO one after another, in order
    received = bytearray()

    def drain():
        fd = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            while len(received) < n:
                try:
                    received.extend(os.read(fd, piece))
                except BlockingIOError:
                    time.sleep(0.001)
        finally:
            os.close(fd)

    drainer = threading.Thread(target=drain, daemon=True)
    # queue depth 1: the write's pieces go into the FIFO one after another, in order
    with IOEngine(backend, queue_depth=1, block_size=piece) as eng:
        buf = aligned_empty(n)
        buf.numpy()[:] = old
        out = eng.open(tmp_path / "fifo", "r+", direct=False)
        src = eng.open(tmp_path / "new", "r", direct=False)
        w = eng.write(out, buf, 0)
        try:
            r = eng.read(src, buf, 0, after=w)
            # The first piece fits the pipe and lands; the read takes its memory, only it.
            assert until(lambda: np.array_equal(buf.numpy()[:piece], new[:piece]))
            time.sleep(0.05)  # time for a read that ignored the write to run ahead
            assert np.array_equal(buf.numpy()[piece:], old[piece:])
            assert not w.done() and not r.done()
            assert w.landed == piece
        finally:
            drainer.start()  # the engine closes only once the write is out of the FIFO
        assert w.wait(timeout=60) == n and r.wait(timeout=60) == n
        drainer.join(timeout=60)
        assert bytes(received) == old.tobytes()  # the write sent what the buffer held
        assert np.array_equal(buf.numpy(), new)
        assert w.landed == n


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_write_cancels_the_read_where_its_memory_was_not_sent(tmp_path, backend):
    """The write fails 3/4 of the way (RLIMIT_FSIZE: EFBIG): what it sent is in the file,
    the read is cancelled (ECANCELED) and never touched the memory past what was sent."""
    n, limit = 8 * MiB, 6 * MiB
    old, new = pattern(n, 3), pattern(n, 4)
    new.tofile(tmp_path / "new")
    with IOEngine(backend, queue_depth=1, block_size=256 * KiB) as eng:
        buf = aligned_empty(n)
        buf.numpy()[:] = old
        out = eng.open(tmp_path / "out", "w")
        src = eng.open(tmp_path / "new", "r")
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            w = eng.write(out, buf, 0)
            r = eng.read(src, buf, 0, after=w)
            with pytest.raises(TierMemIOError) as wfail:
                w.wait(timeout=60)
            with pytest.raises(TierMemIOError) as rfail:
                r.wait(timeout=60)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert wfail.value.errno == errno.EFBIG
    assert rfail.value.errno == errno.ECANCELED
    assert "the write it follows failed" in str(rfail.value)
    assert w.landed == limit
    assert np.array_equal(np.fromfile(tmp_path / "out", dtype=np.uint8), old[:limit])
    got = buf.numpy()
    assert np.array_equal(got[limit:], old[limit:])  # never sent: never overwritten
    taken = rfail.value.offset  # where the read was stopped
    assert taken <= limit and np.array_equal(got[:taken], new[:taken])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_any_overlap_of_read_and_write_memory(tmp_path_factory, backend, data):
    """A write and a read over windows of one arena that overlap in any way (or not), at
    any block size and queue depth: the write sends the bytes its memory held when it was
    issued, the read ends with its file's bytes."""
    page = 4096
    arena_pages = 48
    block = data.draw(st.sampled_from([4096, 8192, 16384]), label="block")
    depth = data.draw(st.integers(1, 4), label="depth")
    d = tmp_path_factory.mktemp("follow")
    arena = aligned_empty(arena_pages * page)
    arena.numpy()[:] = pattern(arena.numel(), 5)
    src = pattern(arena_pages * page, 6)
    src.tofile(d / "src")
    with IOEngine(backend, queue_depth=depth, block_size=block) as eng:
        out = eng.open(d / "out", "w")
        fin = eng.open(d / "src", "r")
        writes = []  # (request, bytes it must send, file offset)
        for k in range(data.draw(st.integers(1, 4), label="pairs")):
            wa = data.draw(st.integers(0, arena_pages - 1), label="write start")
            wn = data.draw(st.integers(1, arena_pages - wa), label="write pages")
            ra = data.draw(st.integers(0, arena_pages - 1), label="read start")
            rn = data.draw(st.integers(1, arena_pages - ra), label="read pages")
            for w, _, _ in writes:
                w.wait(timeout=60)  # a read follows one write: the earlier ones landed
            wmem = arena[wa * page:(wa + wn) * page]
            expect = wmem.numpy().copy()
            w = eng.write(out, wmem, k * arena_pages * page)
            writes.append((w, expect, k * arena_pages * page))
            r = eng.read(fin, arena[ra * page:(ra + rn) * page], ra * page, after=w)
            r.wait(timeout=60)
            assert np.array_equal(arena.numpy()[ra * page:(ra + rn) * page],
                                  src[ra * page:(ra + rn) * page])
        for w, expect, off in writes:
            w.wait(timeout=60)
        got = np.fromfile(d / "out", dtype=np.uint8)
        for w, expect, off in writes:
            assert np.array_equal(got[off:off + expect.size], expect)


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_a_read_may_follow(tmp_path, backend):
    buf = aligned_empty(64 * KiB)
    pattern(buf.numel(), 7).tofile(tmp_path / "f")
    with IOEngine(backend) as eng, IOEngine(backend) as other:
        f = eng.open(tmp_path / "f", "r+")
        rd = eng.read(f, buf, 0)
        rd.wait()
        with pytest.raises(ValueError, match="must be a write of this engine"):
            eng.read(f, buf, 0, after=rd)
        g = other.open(tmp_path / "f", "r+")
        ow = other.write(g, buf, 0)
        with pytest.raises(ValueError, match="must be a write of this engine"):
            eng.read(f, buf, 0, after=ow)
        ow.wait()
        # a write already landed is no dependency: a plain read
        w = eng.write(f, buf, 0)
        w.wait()
        assert eng.read(f, buf, 0, after=w).wait() == buf.numel()
        assert rd.landed == buf.numel()  # a read's landed prefix: all of it once done
    # a write that failed holds the only copy of its bytes: the read is cancelled at once
    full = IOEngine(backend)
    try:
        dev = full.open("/dev/full", "r+", direct=False)
        bad = full.write(dev, buf, 0)
        with pytest.raises(TierMemIOError):
            bad.wait(timeout=60)
        f2 = full.open(tmp_path / "f", "r")
        before = buf.numpy().copy()
        with pytest.raises(TierMemIOError, match="the write it follows failed") as info:
            full.read(f2, buf, 0, after=bad).wait()
        assert info.value.errno == errno.ECANCELED
        assert np.array_equal(buf.numpy(), before)
    finally:
        full.close()
