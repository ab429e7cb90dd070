"""IOEngine moves the right bytes to the right place on both backends, with and without O_DIRECT."""

from __future__ import annotations

import gc
import random
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import BACKEND_PARAMS, aligned, filled, needs_io_uring, pattern, read_file
from tiermem.errors import TierMemWarning
from tiermem._lib import lib
from tiermem.io.buffers import BufferPool
from tiermem.io import DIRECT_ALIGN, IOEngine

KiB = 1024
BLOCK_SIZES = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB]


def as_bytes(buf) -> bytes:
    """The raw bytes of a tensor or buffer-protocol object."""
    if isinstance(buf, torch.Tensor):
        return buf.contiguous().view(torch.uint8).numpy().tobytes()
    return memoryview(buf).cast("B").tobytes()


def wait_until_done(reqs, polls: int = 200_000) -> None:
    """Poll done() on every request; fail (rather than hang) if they never all finish."""
    for _ in range(polls):
        if all(r.done() for r in reqs):
            return
        time.sleep(0.0005)
    pytest.fail("requests never reported done()")


# -- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@given(nblocks=st.integers(1, 256), off_blocks=st.integers(0, 64), buf_blocks=st.integers(0, 3),
       block_size=st.sampled_from(BLOCK_SIZES), queue_depth=st.integers(1, 64),
       seed=st.integers(0, 2**31))
def test_direct_round_trip(tmp_path, backend, nblocks, off_blocks, buf_blocks, block_size,
                           queue_depth, seed):
    """Aligned sizes, file offsets and buffer addresses round-trip exactly under O_DIRECT."""
    n, offset, start = nblocks * DIRECT_ALIGN, off_blocks * DIRECT_ALIGN, buf_blocks * DIRECT_ALIGN
    src = filled(start + n, seed)[start:]
    dst = aligned(start + n)[start:]
    with IOEngine(backend, queue_depth=queue_depth, block_size=block_size) as eng:
        with eng.open(tmp_path / "f", "w", direct=True) as f:
            assert f.direct
            assert eng.write(f, src, offset).wait() == n
            assert f.size() == offset + n
            assert eng.read(f, dst, offset).wait() == n
    assert torch.equal(src, dst)
    on_disk = read_file(tmp_path / "f")
    assert on_disk[:offset] == bytes(offset)
    assert on_disk[offset:] == as_bytes(src)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@given(n=st.integers(1, 300_000), offset=st.integers(0, 100_000), start=st.integers(0, 4095),
       block_size=st.sampled_from(BLOCK_SIZES), queue_depth=st.integers(1, 64),
       kinds=st.tuples(st.sampled_from(["tensor", "bytearray", "numpy"]),
                       st.sampled_from(["tensor", "bytearray", "numpy"])),
       seed=st.integers(0, 2**31))
def test_buffered_round_trip(tmp_path, backend, n, offset, start, block_size, queue_depth,
                             kinds, seed):
    """Arbitrary byte sizes, offsets and buffer addresses round-trip exactly with buffered I/O."""
    data = as_bytes(pattern(n, seed))

    def make(kind, content):
        raw = bytearray(start) + bytearray(content)
        if kind == "tensor":
            return torch.frombuffer(raw, dtype=torch.uint8)[start:]
        if kind == "numpy":
            return np.frombuffer(raw, dtype=np.uint8)[start:]
        return memoryview(raw)[start:]

    src, dst = make(kinds[0], data), make(kinds[1], bytes(n))
    with IOEngine(backend, queue_depth=queue_depth, block_size=block_size) as eng:
        with eng.open(tmp_path / "f", "w", direct=False) as f:
            assert eng.write(f, src, offset).wait() == n
            assert eng.read(f, dst, offset).wait() == n
    assert as_bytes(dst) == data
    assert read_file(tmp_path / "f") == bytes(offset) + data


def test_zero_length_transfers(engine, tmp_path, direct):
    """Empty buffers complete at once with 0 bytes, even at offsets past the end of the file."""
    with engine.open(tmp_path / "f", "w", direct=direct) as f:
        assert engine.write(f, bytearray(), 0).wait() == 0
        assert engine.read(f, bytearray(), 1 << 30).wait() == 0
        assert f.size() == 0


def test_file_larger_than_one_block(engine, tmp_path, direct):
    """A 1 MiB transfer (64 blocks) in one request, read back whole and as odd pieces."""
    n = 1 << 20
    src, dst = filled(n, 7), aligned(n)
    with engine.open(tmp_path / "f", "w", direct=direct) as f:
        req = engine.write(f, src, 0)
        assert req.wait() == n
        assert isinstance(req.resubmits, int) and req.resubmits >= 0
        assert engine.read(f, dst, 0).wait() == n
    assert torch.equal(src, dst)
    with engine.open(tmp_path / "f", "r", direct=False) as f:
        piece = bytearray(100_001)
        assert engine.read(f, piece, 333_333).wait() == len(piece)
    assert bytes(piece) == as_bytes(src[333_333:433_334])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_tensor_dtypes_round_trip(engine, tmp_path, direct, dtype):
    """Aligned tensors of any dtype move as raw bytes, bit for bit."""
    nbytes = 3 * 16384 + 4096
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    src, dst = aligned(nbytes, dtype), aligned(nbytes, dtype)
    if dtype.is_floating_point:
        src.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(dtype))
    else:
        src.copy_(torch.randint(-2**62, 2**62, (numel,), generator=torch.Generator().manual_seed(1)))
    with engine.open(tmp_path / "f", "w", direct=direct) as f:
        engine.write(f, src, 0).wait()
        engine.read(f, dst, 0).wait()
    assert dst.dtype == dtype
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


BUFFER_KINDS = {
    "bytearray": lambda raw: bytearray(raw),
    "memoryview": lambda raw: memoryview(bytearray(raw)),
    "numpy_float64": lambda raw: np.frombuffer(bytearray(raw), dtype=np.float64),
    "numpy_int32_2d": lambda raw: np.frombuffer(bytearray(raw), dtype=np.int32).reshape(16, -1),
    "tensor_float32_unaligned": lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.float32),
}


@pytest.mark.parametrize("kind", list(BUFFER_KINDS))
def test_buffer_protocol_objects_round_trip(engine, tmp_path, kind):
    """bytearray, memoryview, numpy arrays and ordinary tensors work with buffered files."""
    raw = as_bytes(pattern(5 * 16384 + 64, 3))
    src, dst = BUFFER_KINDS[kind](raw), BUFFER_KINDS[kind](bytes(len(raw)))
    with engine.open(tmp_path / "f", "w", direct=False) as f:
        engine.write(f, src, 12345).wait()
        engine.read(f, dst, 12345).wait()
    assert as_bytes(dst) == raw


def test_aligned_numpy_view_works_with_o_direct(engine, tmp_path):
    """A numpy view of an aligned tensor satisfies O_DIRECT."""
    n = 4 * 16384
    src, dst = filled(n, 4).numpy(), aligned(n).numpy()
    with engine.open(tmp_path / "f", "w", direct=True) as f:
        engine.write(f, src, 8192).wait()
        engine.read(f, dst, 8192).wait()
    assert np.array_equal(src, dst)


# -- many requests -----------------------------------------------------------------------


def test_many_requests_waited_in_random_order(engine, tmp_path, direct):
    """200 writes then 200 reads in flight at once land at their own offsets."""
    n, size = 200, 4096
    src, dst = filled(n * size, 11), aligned(n * size)
    order = list(range(n))
    random.Random(0).shuffle(order)
    with engine.open(tmp_path / "f", "w", direct=direct) as f:
        writes = {i: engine.write(f, src[i * size:(i + 1) * size], i * size) for i in order}
        assert engine.inflight() == n  # nothing waited for or polled yet
        random.Random(1).shuffle(order)
        assert [writes[i].wait() for i in order] == [size] * n
        assert engine.inflight() == 0
        reads = [engine.read(f, dst[i * size:(i + 1) * size], i * size) for i in order]
        wait_until_done(reads)
        assert engine.inflight() == 0
        assert all(r.wait() == size for r in reads)
    assert torch.equal(src, dst)


def test_submits_from_several_threads(engine, tmp_path, direct):
    """Four threads submitting and waiting on one engine at once each land their own bytes."""
    per_thread, size = 50, 4096
    src = filled(4 * per_thread * size, 15)
    errors = []

    def worker(k: int) -> None:
        try:
            reqs = [engine.write(f, src[j * size:(j + 1) * size], j * size)
                    for j in range(k, 4 * per_thread, 4)]
            assert [r.wait(timeout=60) for r in reqs] == [size] * per_thread
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with engine.open(tmp_path / "f", "w", direct=direct) as f:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert engine.inflight() == 0
    assert read_file(tmp_path / "f") == as_bytes(src)


def test_wait_all_waits_for_everything(engine, tmp_path, direct):
    """wait_all() returns once every request is done, and leaves nothing in flight."""
    n, size = 50, 16384
    src = filled(n * size, 12)
    with engine.open(tmp_path / "f", "w", direct=direct) as f:
        reqs = [engine.write(f, src[i * size:(i + 1) * size], i * size) for i in range(n)]
        engine.wait_all()
        assert engine.inflight() == 0
        assert all(r.done() for r in reqs)
        engine.wait_all()  # nothing in flight: a no-op
    assert read_file(tmp_path / "f") == as_bytes(src)


def test_more_files_than_fixed_file_slots(engine, tmp_path):
    """300 open files (more than the ring's 256 fixed-file slots) all work."""
    files = [engine.open(tmp_path / f"f{i}", "w", direct=True) for i in range(300)]
    bufs = [filled(4096, i) for i in range(300)]
    for f, b in zip(files, bufs):
        engine.write(f, b, 0)
    engine.wait_all()
    for f in files[:150]:
        f.close()
    files[:150] = [engine.open(tmp_path / f"f{i}", "r", direct=True) for i in range(150)]
    out = [aligned(4096) for _ in range(300)]
    for f, o in zip(files, out):
        engine.read(f, o, 0)
    engine.wait_all()
    assert all(torch.equal(b, o) for b, o in zip(bufs, out))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@given(nrecords=st.integers(2, 12), block_blocks=st.integers(1, 4), queue_depth=st.integers(1, 8),
       registered=st.booleans(), seed=st.integers(0, 2**31))
def test_reads_and_writes_in_flight_together(tmp_path, backend, nrecords, block_blocks,
                                             queue_depth, registered, seed):
    """Reads of some records and writes of others, all in flight at once (the io_uring
    backend moves them on a ring each), land exactly: each read gets the record on disk
    before, each write its own bytes, in registered buffers (fixed on both rings) or not."""
    size = 4 * DIRECT_ALIGN
    rng = random.Random(seed)
    reads = sorted(rng.sample(range(nrecords), rng.randint(1, nrecords - 1)))
    writes = [i for i in range(nrecords) if i not in reads]
    old, new = filled(nrecords * size, seed % 1000), filled(nrecords * size, seed % 1000 + 1)
    with IOEngine(backend, queue_depth=queue_depth,
                  block_size=block_blocks * DIRECT_ALIGN) as eng:
        if registered:
            pool = BufferPool(nrecords, size, engine=eng, huge_pages=False, lock=False)
            bufs = pool.buffers
        else:
            bufs = [aligned(size) for _ in range(nrecords)]
        for i in writes:
            bufs[i].copy_(new[i * size:(i + 1) * size])
        with eng.open(tmp_path / "f", "w", direct=True) as f:
            eng.write(f, old, 0).wait()
            reqs = [eng.read(f, bufs[i], i * size) for i in reads]
            reqs += [eng.write(f, bufs[i], i * size) for i in writes]
            rng.shuffle(reqs)
            assert [r.wait(timeout=60) for r in reqs] == [size] * nrecords
    for i in reads:
        assert torch.equal(bufs[i], old[i * size:(i + 1) * size])
    on_disk = read_file(tmp_path / "f")
    for i in range(nrecords):
        want = (new if i in writes else old)[i * size:(i + 1) * size]
        assert on_disk[i * size:(i + 1) * size] == as_bytes(want)


# -- registered buffers -----------------------------------------------------------------


def test_registered_pool_slices_round_trip(engine, tmp_path, direct):
    """Reads and writes into slices inside registered pool buffers move the right bytes."""
    pool = BufferPool(2, 256 * KiB, engine=engine, huge_pages=False, lock=False)
    assert pool.registered == (engine.backend == "io_uring")
    a, b = pool.buffers
    a.copy_(pattern(256 * KiB, 21))
    b.zero_()
    with engine.open(tmp_path / "f", "w", direct=direct) as f:
        engine.write(f, a, 0).wait()
        engine.write(f, a[8192:8192 + 64 * KiB], 512 * KiB).wait()
        engine.read(f, b[4096:4096 + 64 * KiB], 512 * KiB).wait()
        engine.read(f, b[128 * KiB:], 128 * KiB).wait()
    assert torch.equal(b[4096:4096 + 64 * KiB], a[8192:8192 + 64 * KiB])
    assert torch.equal(b[128 * KiB:], a[128 * KiB:])
    assert not b[:4096].any()


def test_register_while_in_flight_is_refused(engine, tmp_path):
    """register_buffers raises ValueError while requests are in flight, and works after."""
    bufs = [aligned(64 * KiB) for _ in range(2)]
    with engine.open(tmp_path / "f", "w", direct=True) as f:
        for i in range(20):
            engine.write(f, bufs[0], i * 64 * KiB)
        with pytest.raises(ValueError, match="in flight"):
            engine.register_buffers(bufs)
        engine.wait_all()
    assert engine.register_buffers(bufs) == (engine.backend == "io_uring")


@needs_io_uring
def test_registered_buffer_lives_until_engine_closes():
    """The engine keeps registered buffers mapped after the caller drops them, until close."""
    eng = IOEngine("io_uring")
    gc.collect()  # earlier tests' garbage must not be freed inside the count
    live = lib.tm_mem_live_count()
    buf = aligned(64 * KiB)
    assert eng.register_buffers([buf])
    del buf
    gc.collect()
    assert lib.tm_mem_live_count() == live + 1
    eng.close()
    gc.collect()
    assert lib.tm_mem_live_count() == live


# -- lifetime ----------------------------------------------------------------------------


def test_request_keeps_its_buffer_mapped(engine, tmp_path):
    """Dropping the only reference to a buffer mid-write does not unmap it under the engine."""
    n = 512 * KiB
    src = filled(n, 9)
    expected = as_bytes(src)
    gc.collect()  # earlier tests' garbage must not be freed inside the count
    live = lib.tm_mem_live_count()
    with engine.open(tmp_path / "f", "w", direct=True) as f:
        req = engine.write(f, src, 0)
        del src
        gc.collect()
        assert lib.tm_mem_live_count() == live
        assert req.wait() == n
    del req
    gc.collect()
    assert lib.tm_mem_live_count() == live - 1
    assert read_file(tmp_path / "f") == expected


def test_close_with_writes_in_flight_finishes_them(backend, tmp_path, direct):
    """close() right after submitting 64 writes lets them all finish; the data is on disk."""
    eng = IOEngine(backend, queue_depth=1, block_size=4096)
    size, n = 64 * KiB, 64
    src = filled(n * size, 13)
    f = eng.open(tmp_path / "f", "w", direct=direct)
    reqs = [eng.write(f, src[i * size:(i + 1) * size], i * size) for i in range(n)]
    eng.close()
    assert eng.closed and f.closed
    assert eng.inflight() == 0
    assert all(r.done() for r in reqs)
    assert [r.wait() for r in reqs] == [size] * n
    assert read_file(tmp_path / "f") == as_bytes(src)


def test_a_forked_child_closing_the_engine_leaves_the_parents_transfers(backend, tmp_path):
    """A child forked with transfers in flight that closes the engine (or exits through its
    finalizer) touches none of them: the io_uring rings are mapped shared with the parent,
    so draining there reaped the parent's completions and the parent waited forever; the
    thread pool's threads live in the parent only, and destroying the copied pool hung the
    child. The parent's transfers all land, with the right bytes."""
    import os

    eng = IOEngine(backend, queue_depth=2, block_size=4096)  # a shallow queue: most wait
    size, n = 256 * KiB, 48
    src = filled(n * size, 29)
    f = eng.open(tmp_path / "f", "w", direct="auto")
    reqs = [eng.write(f, src[i * size:(i + 1) * size], i * size) for i in range(n)]
    pid = os.fork()
    if pid == 0:  # the child: close as an exiting program would, then leave at once
        code = 1
        try:
            eng.close()
            code = 0 if eng.closed else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung closing the engine")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [r.wait(timeout=30) for r in reqs] == [size] * n
    eng.close()
    assert read_file(tmp_path / "f") == as_bytes(src)


def test_file_close_waits_for_its_transfers(engine, tmp_path, direct):
    """File.close() with writes in flight finishes them before closing the fd."""
    size, n = 64 * KiB, 16
    src = filled(n * size, 14)
    f = engine.open(tmp_path / "f", "w", direct=direct)
    reqs = [engine.write(f, src[i * size:(i + 1) * size], i * size) for i in range(n)]
    f.close()
    f.close()  # idempotent
    assert all(r.done() for r in reqs)
    assert read_file(tmp_path / "f") == as_bytes(src)


CLOSED_ENGINE_CALLS = {
    "open": lambda eng, path, f: eng.open(path, "w"),
    "read": lambda eng, path, f: eng.read(f, aligned(4096), 0),
    "write": lambda eng, path, f: eng.write(f, aligned(4096), 0),
    "register_buffers": lambda eng, path, f: eng.register_buffers([aligned(4096)]),
}


@pytest.mark.parametrize("call", list(CLOSED_ENGINE_CALLS))
def test_closed_engine_refuses_work(backend, tmp_path, call):
    """Every entry point of a closed engine raises ValueError; close() stays idempotent."""
    eng = IOEngine(backend)
    f = eng.open(tmp_path / "f", "w")
    eng.close()
    eng.close()
    with pytest.raises(ValueError, match="closed"):
        CLOSED_ENGINE_CALLS[call](eng, tmp_path / "g", f)


def test_context_managers_close(backend, tmp_path):
    """Leaving the with-blocks closes the file and the engine."""
    with IOEngine(backend) as eng:
        with eng.open(tmp_path / "f", "w") as f:
            eng.write(f, aligned(4096), 0).wait()
        assert f.closed
    assert eng.closed


def test_open_modes(engine, tmp_path):
    """"w" creates and truncates, "r+" keeps the contents, "r" reads."""
    path = tmp_path / "f"
    path.write_bytes(b"a" * 8192)
    with engine.open(path, "r+", direct=False) as f:
        assert f.size() == 8192
        engine.write(f, b"bb", 10).wait()
    assert read_file(path) == b"a" * 10 + b"bb" + b"a" * 8180
    with engine.open(path, "w", direct=False) as f:
        assert f.size() == 0
    with engine.open(path, "r", direct=False) as f:
        assert f.size() == 0 and f.path == str(path)


def test_direct_auto_uses_o_direct_where_supported(engine, tmp_path, reset_once_warnings,
                                                   recwarn):
    """direct="auto" on a filesystem that takes O_DIRECT opens with it and warns about nothing."""
    with engine.open(tmp_path / "f", "w", direct="auto") as f:
        assert f.direct is True
    assert not [w for w in recwarn if issubclass(w.category, TierMemWarning)]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_reads_landed_prefix_holds_the_files_bytes(tmp_path, backend):
    """Request.landed of a read in flight: the prefix of the buffer that holds the file's
    bytes already (the swap store hashes it while the rest lands). A read from a FIFO at
    queue depth 1 lands piece by piece as the pieces are written into the FIFO."""
    import os

    piece, n = 4096, 8 * 4096
    data = pattern(n, 5)
    os.mkfifo(tmp_path / "fifo")
    buf = aligned(n)
    buf.fill_(0xAB)
    with IOEngine(backend, queue_depth=1, block_size=piece) as eng:
        f = eng.open(tmp_path / "fifo", "r+", direct=False)
        rd = eng.read(f, buf, 0)
        fd = os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK)
        fed = 0
        try:
            assert rd.landed == 0 and not rd.done()
            for k in range(1, n // piece + 1):
                os.write(fd, as_bytes(data[fed: fed + piece]))
                fed += piece
                for _ in range(5_000):
                    if rd.landed >= fed:
                        break
                    time.sleep(0.001)
                got = rd.landed
                assert got == fed, (k, got)
                assert as_bytes(buf[:got]) == as_bytes(data[:got])
                assert fed == n or not rd.done()
        finally:
            # the read must end for the engine to close: whatever it still waits for
            if fed < n:
                os.write(fd, as_bytes(data[fed:]))
            os.close(fd)
        assert rd.wait(timeout=60) == n and rd.landed == n
    assert as_bytes(buf) == bytes(data)
