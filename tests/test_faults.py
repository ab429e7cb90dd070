"""Faults at every position of the pipeline: real short transfers, transient I/O errors
survived by reissuing, persistent ones turned into typed errors without losing state."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

import tiermem
from faults import inject
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


def _run(tmp_path, backend, retries=2, fault=None, steps=3):
    """Train a small model; `fault` = (op, nth, times). Returns (params, handle, injected)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with tiermem.offload(opt, _cfg(tmp_path, backend, retries)) as tm:
        faulty = inject(tm, *fault[:2], times=fault[2]) if fault else None
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_disk_that_stays_broken_hands_the_state_back_from_memory(tmp_path, backend):
    """One partition's write-back fails for good: its buffer is never reused, and at the
    end its record comes back from memory with the rest; the error says so. The result
    equals a run without faults."""
    reference, _, _ = _run(tmp_path / "ref", backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(tiermem.TierMemError, match="gathered from memory") as info:
        with tiermem.offload(opt, _cfg(tmp_path, backend, 1)) as tm:
            inject(tm, "write", 5, times=10**6)
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
