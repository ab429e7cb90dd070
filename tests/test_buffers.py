"""aligned_empty and BufferPool: alignment, backing, page-locking, lifetime and hand-out."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from conftest import run_without_ipc_lock
from tiermem._lib import lib
from tiermem.io.buffers import BufferPool, aligned_empty
from tiermem.errors import TierMemWarning
from tiermem.sysinfo import has_cap_ipc_lock

KiB, MiB = 1024, 1 << 20
HUGE = 2 * MiB


class Counters:
    """Snapshot of the C allocator's counters, to compare against later."""

    def __init__(self) -> None:
        gc.collect()
        self.live = lib.tm_mem_live_count()
        self.bytes = lib.tm_mem_live_bytes()
        self.freed = lib.tm_mem_free_count()

    def delta(self) -> tuple[int, int, int]:
        """(live buffers, live bytes, frees) since the snapshot."""
        gc.collect()
        return (lib.tm_mem_live_count() - self.live, lib.tm_mem_live_bytes() - self.bytes,
                lib.tm_mem_free_count() - self.freed)


# -- aligned_empty ----------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 5000, 3 * MiB + 1])
@pytest.mark.parametrize("huge_pages", [True, False])
def test_aligned_empty_shape_and_alignment(nbytes, huge_pages):
    """The tensor has exactly nbytes, on 4 KiB-aligned memory (2 MiB-aligned with huge pages)."""
    t = aligned_empty(nbytes, huge_pages=huge_pages, lock=False)
    info = t.tiermem_info
    assert (t.dtype, t.device.type, t.numel()) == (torch.uint8, "cpu", nbytes)
    assert t.is_contiguous()
    assert info.nbytes == nbytes
    assert info.pages in ({"hugetlb", "thp", "4k"} if huge_pages else {"4k"})
    page = 4096 if info.pages == "4k" else HUGE
    assert t.data_ptr() % page == 0
    assert info.mapped_bytes % page == 0 and nbytes <= info.mapped_bytes < nbytes + page


def test_huge_pages_asked_for_are_huge():
    """huge_pages=True backs the buffer with hugetlb or transparent huge pages, never 4k."""
    info = aligned_empty(3 * MiB).tiermem_info
    assert info.pages in {"hugetlb", "thp"}
    assert info.mapped_bytes == 4 * MiB


def _anon_huge_bytes(addr: int) -> int:
    """AnonHugePages of the mapping that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and head[0] == "AnonHugePages:":
                return int(head[1]) * KiB
    raise AssertionError(f"no mapping holds {addr:#x}")


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("nbytes", [1, 4095, 5000, HUGE - 4096, HUGE, HUGE + 1, 6_553_600,
                                    3 * MiB + 1])
def test_fit_maps_huge_pages_over_whole_extents_only(nbytes):
    """huge_pages="fit" maps no more than the size rounded up to 4 KiB: below one huge page
    4 KiB pages; from one on, a 2 MiB-aligned start, so that the kernel can back every
    whole 2 MiB extent with a huge page and the tail with 4 KiB pages."""
    t = aligned_empty(nbytes, huge_pages="fit", lock=False)
    info = t.tiermem_info
    assert (t.numel(), info.nbytes) == (nbytes, nbytes)
    assert info.mapped_bytes == -(-nbytes // 4096) * 4096
    if info.mapped_bytes < HUGE:
        assert info.pages == "4k" and t.data_ptr() % 4096 == 0
        return
    assert info.pages == "thp-fit" and t.data_ptr() % HUGE == 0
    t.fill_(7)  # every byte is there (and touched)
    assert int(t[-1]) == 7 and int(t[0]) == 7
    if _thp_available():
        # the kernel may fall short of huge pages (fragmented memory): never past the extents
        assert _anon_huge_bytes(t.data_ptr()) <= nbytes // HUGE * HUGE


@pytest.mark.skipif(not _thp_available(), reason="transparent huge pages are off")
def test_fit_gets_huge_pages_when_the_kernel_has_them():
    """On this machine's kernel (THP madvise) the whole extents are huge pages, which is
    the point: the virtio disk splits a transfer at every physical discontinuity."""
    bufs = [aligned_empty(6_553_600, huge_pages="fit", lock=False) for _ in range(3)]
    got = [_anon_huge_bytes(b.data_ptr()) for b in bufs]
    assert max(got) == 3 * HUGE, got


def test_fit_buffers_unmapped_once():
    c = Counters()
    bufs = [aligned_empty(n, huge_pages="fit", lock=False) for n in (5000, HUGE + 1, 6_553_600)]
    assert c.delta()[:2] == (3, 8192 + HUGE + 4096 + 6_553_600)
    del bufs
    assert c.delta() == (0, 0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_aligned_empty_dtypes(dtype):
    """Any dtype: nbytes / itemsize elements, usable as an ordinary tensor."""
    t = aligned_empty(64 * KiB, dtype, huge_pages=False, lock=False)
    assert t.dtype == dtype
    assert t.numel() * t.element_size() == 64 * KiB
    t.fill_(3)
    assert int(t.sum().item()) == 3 * t.numel()


@pytest.mark.parametrize("nbytes,dtype", [(0, torch.uint8), (-4096, torch.uint8),
                                          (6, torch.float32), (4100, torch.int64)])
def test_aligned_empty_bad_sizes(nbytes, dtype):
    """nbytes must be a positive multiple of the item size; nothing is mapped otherwise."""
    before = Counters()
    with pytest.raises(ValueError, match="nbytes"):
        aligned_empty(nbytes, dtype)
    assert before.delta() == (0, 0, 0)


@pytest.mark.skipif(not has_cap_ipc_lock(), reason="needs CAP_IPC_LOCK to lock memory")
def test_lock_true_locks_the_buffer(recwarn):
    """With CAP_IPC_LOCK, lock=True page-locks the buffer without warning."""
    assert aligned_empty(MiB, huge_pages=False).tiermem_info.locked
    assert not [w for w in recwarn if issubclass(w.category, TierMemWarning)]


def test_lock_false_is_not_locked_and_quiet(reset_once_warnings, recwarn):
    """lock=False leaves the buffer pageable and says nothing."""
    assert not aligned_empty(MiB, huge_pages=False, lock=False).tiermem_info.locked
    assert not [w for w in recwarn if issubclass(w.category, TierMemWarning)]


VIEWS = {
    "slice": lambda t: t[100:200],
    "dtype view": lambda t: t.view(torch.int32),
    "reshape": lambda t: t.reshape(16, -1),
    "numpy": lambda t: t.numpy(),
    "memoryview": lambda t: memoryview(t.numpy()),
}


@pytest.mark.parametrize("make_view", list(VIEWS.values()), ids=list(VIEWS))
def test_buffer_unmapped_once_after_last_view(make_view):
    """A view keeps the mapping alive after the base tensor dies; it is unmapped exactly once."""
    before = Counters()
    base = aligned_empty(64 * KiB, huge_pages=False, lock=False)
    mapped = base.tiermem_info.mapped_bytes
    view = make_view(base)
    del base
    assert before.delta() == (1, mapped, 0)
    del view
    assert before.delta() == (0, 0, 1)


def test_dtype_buffer_unmapped_once():
    """A float32 buffer (a view of the raw bytes internally) is unmapped once when dropped."""
    before = Counters()
    t = aligned_empty(3 * MiB, torch.float32)
    assert before.delta()[:2] == (1, t.tiermem_info.mapped_bytes)
    del t
    assert before.delta() == (0, 0, 1)


def test_many_buffers_each_unmapped_once():
    """Twenty buffers dropped: twenty frees, no more, and no bytes left mapped."""
    before = Counters()
    bufs = [aligned_empty((i + 1) * 4096, huge_pages=i % 2 == 0, lock=False) for i in range(20)]
    assert before.delta()[0] == 20
    del bufs
    assert before.delta() == (0, 0, 20)


UNLOCKED_SCRIPT = """
import json, resource, warnings
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, 64 * 1024))
from tiermem.sysinfo import has_cap_ipc_lock
from tiermem.io.buffers import BufferPool, aligned_empty
from tiermem.errors import TierMemWarning
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = aligned_empty(4 << 20)
    b = aligned_empty(1 << 20, huge_pages=False)
    pool = BufferPool(2, 1 << 20, huge_pages=False)
ours = [str(w.message) for w in caught if issubclass(w.category, TierMemWarning)]
print(json.dumps({"cap": has_cap_ipc_lock(), "warnings": ours, "pinned": pool.pinned_bytes,
                  "locked": [a.tiermem_info.locked, b.tiermem_info.locked]}))
"""


def test_unlockable_memory_warns_once():
    """Without CAP_IPC_LOCK and with a 64 KiB memlock limit: one TierMemWarning, locked=False."""
    out = run_without_ipc_lock(UNLOCKED_SCRIPT)
    assert out["locked"] == [False, False]
    assert out["pinned"] == 0
    assert len(out["warnings"]) == 1
    assert "RLIMIT_MEMLOCK" in out["warnings"][0]


def test_failed_cuda_registration_is_cleared_and_named(monkeypatch):
    """With a GPU, buffers are pinned by cudaHostRegister. When that fails, the error is
    read back out of the CUDA runtime (torch's binding leaves it as the thread's last
    error, which the next kernel launch check would raise against an unrelated op), and
    the one warning names cudaHostRegister rather than mlock."""
    import tiermem.io.buffers as buffers

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", size))
            return 2  # cudaErrorMemoryAllocation

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))

        def cudaGetErrorString(self, code):
            return "out of memory"

    class FakeLibcudart:
        def cudaGetLastError(self):
            calls.append(("cleared", None))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(buffers, "_cudart", FakeLibcudart())
    monkeypatch.setattr(buffers, "_warned_unlocked", False)
    with pytest.warns(TierMemWarning, match=r"cudaHostRegister failed: out of memory") as w:
        buf = aligned_empty(1 << 20, huge_pages=False)
    assert "RLIMIT_MEMLOCK" not in str(w[0].message)
    assert buf.tiermem_info.locked is False
    assert calls == [("register", 1 << 20), ("cleared", None)]
    del buf
    gc.collect()
    assert len(calls) == 2  # never pinned: freed without cudaHostUnregister


# -- BufferPool -------------------------------------------------------------------------------


def small_pool(count: int = 3) -> BufferPool:
    return BufferPool(count, 16 * KiB, huge_pages=False, lock=False)


def test_pool_buffers():
    """count distinct, aligned, nbytes-long uint8 buffers; mapped_bytes adds them up."""
    pool = BufferPool(4, 64 * KiB, huge_pages=False, lock=False)
    assert len(pool.buffers) == 4 and pool.available == 4
    assert len({b.data_ptr() for b in pool.buffers}) == 4
    for b in pool.buffers:
        assert b.numel() == 64 * KiB and b.data_ptr() % 4096 == 0
    assert pool.mapped_bytes == 4 * 64 * KiB
    assert pool.pinned_bytes == 0
    assert pool.registered is False


@pytest.mark.skipif(not has_cap_ipc_lock(), reason="needs CAP_IPC_LOCK to lock memory")
def test_locked_pool_reports_pinned_bytes():
    """A locked pool's pinned_bytes is everything it maps."""
    pool = BufferPool(2, MiB, huge_pages=True)
    assert pool.pinned_bytes == pool.mapped_bytes == 2 * HUGE


@pytest.mark.parametrize("count,nbytes", [(0, 4096), (-1, 4096), (2, 0), (2, 4095), (2, 6000)])
def test_pool_bad_arguments(count, nbytes):
    """count >= 1 and nbytes a positive multiple of 4096, else ValueError before mapping."""
    before = Counters()
    with pytest.raises(ValueError):
        BufferPool(count, nbytes)
    assert before.delta() == (0, 0, 0)


def test_pool_over_budget_allocates_nothing():
    """A pool larger than its budget raises ValueError before mapping anything."""
    before = Counters()
    with pytest.raises(ValueError, match="budget"):
        BufferPool(4, MiB, budget=4 * MiB - 1)
    assert before.delta() == (0, 0, 0)


def test_pool_at_budget_is_allowed():
    """A pool exactly at its budget is built."""
    assert len(BufferPool(4, 64 * KiB, budget=256 * KiB, huge_pages=False, lock=False).buffers) == 4


def test_pool_pins_no_more_than_its_budget():
    """A pool built under a pinned-memory budget pins no more than that budget.

    With huge pages each 4 KiB buffer maps (and locks) a whole 2 MiB page.
    """
    budget = 4 * 4096
    try:
        pool = BufferPool(4, 4096, budget=budget)
    except ValueError:
        return  # refusing is also correct
    assert pool.pinned_bytes <= budget, pool.describe()


def test_pool_unmaps_everything_when_dropped():
    """Dropping the pool unmaps each of its buffers exactly once."""
    before = Counters()
    pool = small_pool(5)
    assert before.delta()[0] == 5
    del pool
    assert before.delta() == (0, 0, 5)


def test_acquire_and_release():
    """acquire() hands out each buffer once; release() gives it back."""
    pool = small_pool(3)
    got = [pool.acquire() for _ in range(3)]
    assert pool.available == 0
    assert sorted(b.data_ptr() for b in got) == sorted(b.data_ptr() for b in pool.buffers)
    pool.release(got[1])
    assert pool.available == 1
    assert pool.acquire(timeout=0) is got[1]


def test_acquire_times_out_when_all_are_out():
    """With every buffer out, acquire(timeout) raises TimeoutError."""
    pool = small_pool(2)
    pool.acquire(), pool.acquire()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0)


RELEASE_ERRORS = {
    "foreign tensor": lambda pool, held: aligned_empty(16 * KiB, huge_pages=False, lock=False),
    "slice of a pool buffer": lambda pool, held: held[:4096],
    "buffer of another pool": lambda pool, held: small_pool(1).buffers[0],
}


@pytest.mark.parametrize("what", list(RELEASE_ERRORS))
def test_release_of_a_foreign_buffer_is_refused(what):
    """release() of anything but one of the pool's own buffers is a ValueError."""
    pool = small_pool(2)
    held = pool.acquire()
    with pytest.raises(ValueError, match="not one of the pool's buffers"):
        pool.release(RELEASE_ERRORS[what](pool, held))
    assert pool.available == 1


def test_double_release_is_refused():
    """Releasing the same buffer twice is a ValueError, and the pool does not grow."""
    pool = small_pool(2)
    buf = pool.acquire()
    pool.release(buf)
    with pytest.raises(ValueError, match="twice"):
        pool.release(buf)
    assert pool.available == 2


def test_acquire_waits_for_a_release():
    """A blocked acquire() gets the buffer another thread releases."""
    pool = small_pool(1)
    buf = pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=60)))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive() and not got  # nothing was free: it must still be waiting
    pool.release(buf)
    waiter.join(60)
    assert len(got) == 1 and got[0] is buf


def test_concurrent_acquire_release_never_shares_a_buffer():
    """8 threads x 300 acquire/release cycles on 3 buffers: no buffer is ever held twice."""
    pool = small_pool(3)
    held: set[int] = set()
    guard = threading.Lock()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(300):
                buf = pool.acquire(timeout=60)
                with guard:
                    assert buf.data_ptr() not in held, "buffer handed out twice"
                    held.add(buf.data_ptr())
                buf[:8] = k
                assert int(buf[:8].sum()) == 8 * k
                with guard:
                    held.remove(buf.data_ptr())
                pool.release(buf)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker is stuck in acquire()"
    assert errors == []
    assert pool.available == 3


def test_pool_registers_with_an_io_uring_engine(engine):
    """With an engine, the pool's buffers are registered exactly when the backend is io_uring."""
    pool = BufferPool(2, 64 * KiB, engine=engine, huge_pages=False, lock=False)
    assert pool.registered == (engine.backend == "io_uring")
    assert f"registered={pool.registered}" in pool.describe()

