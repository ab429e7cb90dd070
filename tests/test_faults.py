"""Faults at every position of the pipeline: real short transfers, transient I/O errors
survived by reissuing, persistent ones turned into typed errors without losing state."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

import pytest
import torch

import tiermem
from faults import FaultyBackend, HoldWrites, inject
from tiermem.io.buffers import aligned_empty
from tiermem.io import IOEngine

BACKENDS = ["io_uring", "threads"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_reads_are_requeued_until_whole(tmp_path, backend):
    """A FIFO hands out what its writer has written so far: every read comes back short,
    and the engine asks again for the rest until the buffer is full."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    payload = bytes(range(256)) * 256  # 64 KiB
    with IOEngine(backend, queue_depth=4, block_size=64 << 10) as eng:
        f = eng.open(fifo, "r+", direct=False)

        def writer():
            fd = os.open(fifo, os.O_WRONLY)
            for i in range(0, len(payload), 4096):
                os.write(fd, payload[i: i + 4096])
                time.sleep(0.002)
            os.close(fd)

        t = threading.Thread(target=writer)
        buf = aligned_empty(len(payload))
        req = eng.read(f, buf, 0) if backend == "threads" else None
        t.start()
        if req is None:
            req = eng.read(f, buf, 0)
        assert req.wait(timeout=30) == len(payload)
        t.join()
        assert bytes(buf.numpy()) == payload
        assert req.resubmits > 0


def _cfg(tmp_path, backend, retries):
    tmp_path.mkdir(parents=True, exist_ok=True)  # the swap path's parent must exist
    return {"swap": {"paths": [str(tmp_path / "swap")]},
            "io": {"backend": backend, "retries": retries},
            "tiers": {"host": {"capacity": 0}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 1}}


def _run(tmp_path, backend, retries=2, fault=None, steps=3, late=False):
    """Train a small model; `fault` = (op, nth, times), `late` as FaultyBackend's. Returns
    (params, faults survived, the FaultyBackend)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with tiermem.offload(opt, _cfg(tmp_path, backend, retries)) as tm:
        faulty = inject(tm, *fault[:2], times=fault[2], late=late) if fault else None
        for _ in range(steps):
            model(torch.randn(4, 128, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        tm.stats()  # waits for the last write-backs (and their reissues)
        survived = tm.faults_survived
    return [p.detach().clone() for p in model.parameters()], survived, faulty


def _positions(tmp_path, backend):
    """How many reads and writes a fault-free run issues."""
    counts = {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with tiermem.offload(opt, _cfg(tmp_path / "count", backend, 0)) as tm:
        probe = inject(tm, "none", 0)
        for _ in range(3):
            model(torch.randn(4, 128, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        tm.offloaded.tiers.flush()
        counts = dict(probe.count)
    return counts


@pytest.mark.parametrize("backend", BACKENDS)
def test_transient_faults_at_every_position_are_survived(tmp_path, backend):
    """EIO once on the n-th read or write, for every n the run issues: the transfer is
    reissued, training goes on, and the result is bitwise that of a run without faults."""
    reference, _, _ = _run(tmp_path / "ref", backend)
    counts = _positions(tmp_path, backend)
    assert counts["read"] >= 4 and counts["write"] >= 8
    for op in ("read", "write"):
        for n in range(counts[op]):
            got, survived, faulty = _run(tmp_path / f"{op}{n}", backend, fault=(op, n, 1))
            assert faulty.injected == 1 and survived == 1, (op, n)
            for a, b in zip(got, reference):
                assert torch.equal(a, b), (op, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_that_fails_after_a_read_followed_it_is_survived(tmp_path, backend):
    """A write-back that fails only once a read has taken its buffer (reads follow
    write-backs in flight piece by piece): the buffer gets its record back from what
    reached the disk, the write is reissued and the other record read again. At every
    write position; bitwise the run without faults."""
    reference, _, _ = _run(tmp_path / "ref", backend)
    counts = _positions(tmp_path, backend)
    followed = 0
    for n in range(counts["write"]):
        got, survived, faulty = _run(tmp_path / f"w{n}", backend, fault=("write", n, 1),
                                     late=True)
        assert faulty.injected == 1 and survived == 1, n
        followed += faulty.followed
        for a, b in zip(got, reference):
            assert torch.equal(a, b), n
    assert followed >= 2  # the followed write's failure was met, not only plain ones


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_persistent_fault_is_a_typed_error_naming_the_transfer(tmp_path, backend, op):
    """A fault that outlasts io.retries (here: both attempts of one transfer fail): the step
    raises TierMemIOError naming operation, file, offset, length and errno; no hang; the
    block still ends and hands the state back (the disk recovered)."""
    with pytest.raises(tiermem.TierMemIOError) as info:
        _run(tmp_path, backend, retries=1, fault=(op, 2, 2), steps=4)
    e = info.value
    assert e.op == op and e.errno == errno.EIO
    assert e.path.endswith("state.swap") and e.length > 0 and e.offset >= 0
    assert f"{op} of {e.length} bytes at offset {e.offset} in {e.path} failed" in str(e)
    assert "Input/output error" in str(e)
    assert not (tmp_path / "swap" / "tiermem-default").exists()  # state was handed back


@pytest.mark.parametrize("late", [False, True], ids=["failed", "failed-after-a-read-followed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_disk_that_stays_broken_hands_the_state_back_from_memory(tmp_path, backend, late):
    """One partition's write-back fails for good: its buffer is never reused, and at the
    end its record comes back from memory with the rest; the error says so. The result
    equals a run without faults. `late`: the failure shows only after a read took the
    buffer, which gets the record back from what reached the disk first."""
    reference, _, _ = _run(tmp_path / "ref", backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(tiermem.TierMemError, match="gathered from memory") as info:
        with tiermem.offload(opt, _cfg(tmp_path, backend, 1)) as tm:
            faulty = inject(tm, "write", 5, times=10**6, late=late)
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                model(torch.randn(4, 128, generator=g)).square().mean().backward()
                try:
                    opt.step()
                except tiermem.TierMemIOError:
                    pass  # the step itself completed; a write-back of it failed
                opt.zero_grad()
    assert isinstance(info.value.__cause__, tiermem.TierMemIOError)
    for a, b in zip(model.parameters(), reference):
        assert torch.equal(a.detach(), b)
    assert len(opt.state) == 4 and not (tmp_path / "swap" / "tiermem-default").exists()
    assert faulty.followed >= late


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_cut_off_part_way_lose_no_record(tmp_path, backend, monkeypatch):
    """A file size limit (RLIMIT_FSIZE) inside the swap file for one step: the write-backs
    that cross it fail part way (EFBIG) while reads follow them piece by piece. The step
    says so; each record whose buffer a read had started to take gets back what reached
    the disk; once the limit is lifted, flush() writes the rest and training goes on
    bitwise as without the fault."""
    import resource

    from tiermem.tiers.pipeline import StepPipeline

    restored: list[int] = []
    real_restore = StepPipeline._restore

    def spy(self, slot, landed, failure):
        restored.append(landed)
        return real_restore(self, slot, landed, failure)

    monkeypatch.setattr(StepPipeline, "_restore", spy)

    def train(tm_cb=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        cfg = _cfg(tmp_path / ("cut" if tm_cb else "ref"), backend, 0)
        cfg["io"].update(block_size="16KiB", queue_depth=1)
        errors = 0
        with tiermem.offload(opt, cfg) as tm:
            engine = tm.offloaded.tiers.engine
            engine._backend = HoldWrites(engine._backend)  # reads always follow writes
            for step in range(6):
                model(torch.randn(4, 128, generator=g)).square().mean().backward()
                with tm_cb(tm) if tm_cb and step == 3 else contextlib.nullcontext():
                    try:
                        opt.step()
                    except tiermem.TierMemIOError as exc:
                        assert exc.errno == errno.EFBIG
                        errors += 1
                if tm_cb and step == 3:
                    tm.offloaded.tiers.flush()  # the limit is lifted: the kept records go
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], errors

    @contextlib.contextmanager
    def size_limit(tm):
        # 8 KiB into the second 16 KiB piece of the last record in the file: its writes
        # fail there, the other records' go through
        last = max(tm.offloaded.tiers.store.slots.values(), key=lambda s: s.offset)
        limit = last.offset + 16384 + 8192
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    reference, _ = train()
    got, errors = train(size_limit)
    assert errors == 1
    # a read had taken part of a record's buffer, not all of it
    assert any(0 < n < 64 << 10 for n in restored), restored
    for a, b in zip(got, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize("times", [1, 10**6], ids=["once", "for-good"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reading_back_a_cut_off_write_is_retried_or_names_the_lost_record(
        tmp_path, backend, times, monkeypatch):
    """The read that puts a failed write's record back together fails too: once, it is
    read again (io.retries) and the run is bitwise the reference; for good, the error says
    which partition's state is lost instead of going on with a wrong record."""
    from tiermem.swap.store import SwapStore

    real_read = SwapStore.read
    failed = []

    def read(self, part, buf, *, after=None, nbytes=None):
        if nbytes is None or len(failed) >= times:
            return real_read(self, part, buf, after=after, nbytes=nbytes)
        failed.append(part.id)  # only the read-back asks for a prefix: it fails (EIO)
        inner = self.engine._backend
        self.engine._backend = FaultyBackend(inner, "read", 0)
        try:
            return real_read(self, part, buf, nbytes=nbytes)
        finally:
            self.engine._backend = inner

    monkeypatch.setattr(SwapStore, "read", read)
    reference, _, _ = _run(tmp_path / "ref", backend)
    if times == 1:
        got, survived, faulty = _run(tmp_path / "run", backend, fault=("write", 3, 1),
                                     late=True)
        assert failed and survived == 2  # the write and the read-back
        for a, b in zip(got, reference):
            assert torch.equal(a, b)
    else:
        with pytest.raises(tiermem.TierMemError, match="state of partition .* is lost"):
            _run(tmp_path / "run", backend, fault=("write", 3, 1), late=True)
        assert len(failed) == 3  # the first try and io.retries (2) more


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scratch_step_that_fails_part_way_counts_only_what_it_updated(tmp_path, backend):
    """scratch: a read that fails for good mid-step leaves the partitions before it updated
    and the rest not. Each parameter's state then says which: its step count and moments
    (and its weights) are the plain optimizer's after the step it has taken, one or two,
    never a count one ahead of its moments (a parameter cut across the failure is half
    updated, as the docs say)."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 64, generator=g) for _ in range(2)]
    refs = []
    for steps in (1, 2):  # the plain run after one step and after two
        ref = make()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for x in xs[:steps]:
            ref(x).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        refs.append((ref, ref_opt.state_dict()))
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = _cfg(tmp_path, backend, 1)
    cfg["optimizer"] = {"kernel": "match"}
    with tiermem.offload(opt, cfg) as tm:
        model(xs[0]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        faulty = inject(tm, "read", 3, times=2)  # both attempts of the 4th read fail
        model(xs[1]).square().mean().backward()
        with pytest.raises(tiermem.TierMemIOError):
            opt.step()
        assert faulty.injected == 2
        sd = opt.state_dict()
        parts_of: dict[int, set[int]] = {}
        for part in tm.offloaded.parts:
            for s in part.segments:
                parts_of.setdefault(s.index, set()).add(part.id)
    params = list(model.parameters())
    taken = {1: 0, 2: 0}
    for i, st in sd["state"].items():
        if len(parts_of[i]) > 1:
            continue  # cut across partitions: may be half updated
        k = int(st["step"])
        ref, ref_sd = refs[k - 1]
        taken[k] += 1
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], ref_sd["state"][i][key]), (i, k, key)
        assert torch.equal(params[i].detach(), list(ref.parameters())[i].detach()), (i, k)
    assert taken[1] and taken[2], taken  # the fault landed mid-step


@pytest.mark.parametrize("where", ["in-a-step", "at-the-exit"])
@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_broken_disk_and_no_memory_to_hand_back(tmp_path, backend, durability, where,
                                                 monkeypatch):
    """Write-backs fail for good (from a step on, or only the exit's) and the state does
    not fit in free memory to be handed back. scratch: it is whole nowhere, the exit says
    so, and opt.step() after the block says the state is lost (it used to start the
    optimizer over, silently). crash_consistent: the last commit stays on disk (a step
    whose writes failed was rolled back to it; the exit's failed writes went to records
    no commit names), opt.step() names the resume, and the resume goes on from it, bitwise
    the plain optimizer at that step."""
    import tiermem.optim.handle as handle

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, steps, g):
        for _ in range(steps):
            model(torch.randn(4, 128, generator=g)).square().mean().backward()
            try:
                opt.step()
            except tiermem.TierMemIOError:
                pass  # a write-back of the step failed
            opt.zero_grad()

    def broken_disk():
        raise tiermem.TierMemIOError("injected: a write-back failed for good", op="write",
                                     errno=errno.EIO)

    ref, ref_opt = make()
    g_ref = torch.Generator().manual_seed(1)
    train(ref, ref_opt, 2, g_ref)
    model, opt = make()
    g = torch.Generator().manual_seed(1)
    cfg = _cfg(tmp_path, backend, 1)
    cfg["swap"]["durability"] = durability
    cfg["optimizer"] = {"kernel": "match"}  # torch's own arithmetic: the plain run's bits
    lost = durability == "scratch"
    # a step rolled back to the commit leaves nothing to write: the exit keeps it as it
    # keeps any state that does not fit
    clean = not lost and where == "in-a-step"
    with monkeypatch.context() as m:
        m.setattr(handle, "available_memory", lambda: 0)
        with (pytest.warns(tiermem.TierMemWarning, match="does not fit") if clean
              else pytest.raises(tiermem.TierMemError, match="could not be written back")):
            with tiermem.offload(opt, cfg, model=model) as tm:
                train(model, opt, 2, g)
                tm.stats()  # the two steps' write-backs (and commits) landed
                if where == "in-a-step":
                    inject(tm, "write", 0, times=10**6)  # every write from here on fails
                    train(model, opt, 1, g)
                else:
                    tm.offloaded.tiers.flush = broken_disk
    with pytest.raises(tiermem.TierMemError, match="is lost" if lost else "was kept on disk"):
        opt.step()
    if lost:
        return
    handle.forget_kept(opt)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 2
        state = opt.state_dict()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.detach(), b.detach())
    want = ref_opt.state_dict()["state"]
    for i, entry in want.items():
        for k, v in entry.items():
            assert torch.equal(state["state"][i][k], v), (i, k)
