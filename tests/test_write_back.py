"""pipeline.write_back: deferred. The records a step visits last stay unwritten in their
buffers, where zig-zag has the next step update them first; they reach the disk when a
buffer is reused for another record, on flush, or at a checkpoint. A steady step then
writes exactly the records it reads.

Each test trains the same parameters with the plain optimizer beside the tiered one and
asserts bitwise equality, on both I/O backends. What makes them fail: a deferred buffer
reused without its write (state_dict()/load_state_dict() between steps read every record
through the buffers), a flush that forgets the deferred records (the swap file is read
back and compared), and a failed deferred write dropped instead of kept for the next
flush.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiermem
from faults import inject
from tiermem.io.buffers import aligned_empty
from offload_helpers import backend_params, config, twin_optimizers

N_PARAMS, NUMEL, BUFFERS = 6, 20_000, 3  # 80 KB each: two 64 KiB partitions per parameter
OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
]
IDS = ["sgd", "adamw"]


def make(cls, kw):
    return twin_optimizers(cls, kw, [NUMEL] * N_PARAMS)


def cfg(tmp_path, backend, write_back="deferred", **extra):
    c = config(tmp_path, backend=backend, buffer_count=BUFFERS, prefetch_depth=1,
               write_back=write_back)
    for section, values in extra.items():
        c.setdefault(section, {}).update(values)
    return c


def step_both(ps, opt, ref, ref_opt, g):
    for p, r in zip(ps, ref):
        p.grad = torch.randn(NUMEL, generator=g)
        r.grad = p.grad.clone()
    opt.step()
    ref_opt.step()


def assert_same(ps, opt, ref, ref_opt):
    """Weights and optimizer state bitwise equal (the state in torch's format, read from
    the records wherever they are)."""
    for p, r in zip(ps, ref):
        assert torch.equal(p, r)
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for k, v in want[i].items():
            assert torch.equal(got[i][k], v), (i, k)


def disk_holds_the_buffers(tiers) -> None:
    """Every NVMe record as the swap file holds it (read back, checksum and generation
    checked) equals the record the pipeline hands out."""
    for part in tiers.parts:
        buf = aligned_empty(tiers.pipeline.slots[0].buf.numel())
        tiers.store.read(part, buf).wait()
        tiers.store.verify(part, buf)
        with tiers.pipeline.record(part, write=False) as (views, _):
            for kind, view in part.views(buf).items():
                assert torch.equal(view, views[kind]), (part.id, kind)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("write_back", ["deferred", "immediate"])
def test_results_and_bytes_per_step(tmp_path, backend, cls, kw, write_back):
    ps, opt, ref, ref_opt = make(cls, kw)
    g = torch.Generator().manual_seed(1)
    steps = 6
    with tiermem.offload(opt, cfg(tmp_path, backend, write_back)) as tm:
        tm.record_events(True)
        for _ in range(steps):
            step_both(ps, opt, ref, ref_opt, g)
        stats, plan = tm.stats(), tm.plan()
        every_record = sum(slot.nbytes for slot in tm.offloaded.tiers.store.slots.values())
        assert_same(ps, opt, ref, ref_opt)
        events = tm.events()
    n = plan["partitions"]
    assert n > 2 * BUFFERS
    writes: dict[int, list[int]] = {}
    for e in events:
        if e.track == "nvme write":
            writes.setdefault(e.step, []).append(e.partition)
    for step in range(2, steps):  # the last step's writes are the handle's exit flush
        assert sorted(set(writes[step])) == sorted(writes[step])  # one write per record
        # deferred: the records left in the buffers are neither written nor read again
        assert len(writes[step]) == (n - BUFFERS if write_back == "deferred" else n)
    for s in stats[1:]:
        assert s["reads_skipped"] == BUFFERS
        if write_back == "deferred":
            assert s["writes_deferred"] == BUFFERS
        else:
            assert s["writes_deferred"] == 0
            assert s["write_bytes"]["nvme"] == every_record


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", OPTIMIZERS, ids=IDS)
def test_a_reused_buffer_writes_its_deferred_record_first(tmp_path, backend, cls, kw):
    """state_dict() and load_state_dict() between steps take every record through the
    buffers, so each deferred record's buffer is reused for another one: its update must
    reach the disk first, or a later step reads the record it had before."""
    ps, opt, ref, ref_opt = make(cls, kw)
    g = torch.Generator().manual_seed(2)
    with tiermem.offload(opt, cfg(tmp_path, backend)) as tm:
        for i in range(7):
            step_both(ps, opt, ref, ref_opt, g)
            if i % 3 == 1:
                assert_same(ps, opt, ref, ref_opt)  # state_dict() reads every record
            if i % 3 == 2:
                opt.load_state_dict(ref_opt.state_dict())
        assert sum(s["writes_deferred"] for s in tm.stats()) > 0
        assert_same(ps, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_flush_writes_every_deferred_record(tmp_path, backend):
    """After flush() the swap file holds every record as the plain optimizer has it: read
    back from disk, checked, compared moment by moment."""
    cls, kw = OPTIMIZERS[1]
    ps, opt, ref, ref_opt = make(cls, kw)
    g = torch.Generator().manual_seed(3)
    with tiermem.offload(opt, cfg(tmp_path, backend)) as tm:
        for _ in range(5):
            step_both(ps, opt, ref, ref_opt, g)
        assert tm.stats()[-1]["writes_deferred"] == BUFFERS
        tiers = tm.offloaded.tiers
        tiers.flush()
        assert not any(s.deferred for s in tiers.pipeline.slots)
        disk_holds_the_buffers(tiers)
        # and the buffers themselves hold the plain optimizer's state
        assert_same(ps, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_a_failed_deferred_write_is_kept_for_the_next_flush(tmp_path, backend):
    """The deferred records' writes fail at flush: the error names the write, the buffers
    keep the records, and the next flush writes them; nothing is lost."""
    cls, kw = OPTIMIZERS[0]
    ps, opt, ref, ref_opt = make(cls, kw)
    g = torch.Generator().manual_seed(4)
    with tiermem.offload(opt, cfg(tmp_path, backend, io={"retries": 0})) as tm:
        for _ in range(4):
            step_both(ps, opt, ref, ref_opt, g)
        tiers = tm.offloaded.tiers
        faulty = inject(tm, "write", 0, times=1)  # the first write from here on: a deferred one
        with pytest.raises(tiermem.TierMemIOError, match="write of"):
            tiers.flush()
        assert faulty.injected == 1
        assert sum(s.dirty for s in tiers.pipeline.slots) == 1
        tiers.flush()  # the disk is back: the kept record goes out
        assert not any(s.dirty or s.deferred for s in tiers.pipeline.slots)
        disk_holds_the_buffers(tiers)
        for _ in range(2):
            step_both(ps, opt, ref, ref_opt, g)
        assert_same(ps, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_crash_consistent_steps_write_every_record(tmp_path, backend):
    """A committed step must be on disk: crash_consistent never defers, whatever
    pipeline.write_back says."""
    cls, kw = OPTIMIZERS[0]
    ps, opt, ref, ref_opt = make(cls, kw)
    g = torch.Generator().manual_seed(5)
    with tiermem.offload(opt, cfg(tmp_path, backend, swap={"durability": "crash_consistent"})
                         ) as tm:
        for _ in range(4):
            step_both(ps, opt, ref, ref_opt, g)
        stats = tm.stats()
        every_record = sum(slot.nbytes for slot in tm.offloaded.tiers.store.slots.values())
        assert_same(ps, opt, ref, ref_opt)
    for s in stats[1:]:
        assert s["writes_deferred"] == 0
        assert s["write_bytes"]["nvme"] == every_record


def test_write_back_setting_is_validated(tmp_path):
    with pytest.raises(tiermem.ConfigError, match="pipeline.write_back"):
        tiermem.load_config({"pipeline": {"write_back": "later"}})


# -- any sequence of steps, partial steps, state_dict round trips and flushes --------------

ACTIONS = st.lists(st.sampled_from(["step", "partial", "state_dict", "load", "flush"]),
                   min_size=3, max_size=9)


@pytest.mark.parametrize("backend", backend_params())
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS, buffers=st.integers(2, 5), sizes=st.lists(
    st.integers(1_000, 40_000), min_size=2, max_size=5), data=st.data())
def test_any_sequence_equals_the_plain_optimizer(tmp_path_factory, backend, actions, buffers,
                                                 sizes, data):
    """Partial steps (some parameters without gradients: the visit order changes, so a
    deferred record may be needed after its buffer is), state_dict() and load_state_dict()
    between steps, flushes: the weights and the state stay bitwise those of the plain
    optimizer, and the swap file after a final flush holds every record."""
    prefetch = data.draw(st.integers(1, buffers - 1), label="prefetch")
    ps, opt, ref, ref_opt = twin_optimizers(
        torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3), sizes)
    g = torch.Generator().manual_seed(len(sizes))
    c = config(tmp_path_factory.mktemp("swap"), backend=backend, buffer_count=buffers,
               prefetch_depth=prefetch)
    with tiermem.offload(opt, c) as tm:
        for action in ["step", *actions]:
            if action in ("step", "partial"):
                skip = (data.draw(st.sets(st.integers(0, len(ps) - 1), max_size=len(ps) - 1),
                                  label="no grad") if action == "partial" else set())
                for i, (p, r) in enumerate(zip(ps, ref)):
                    grad = None if i in skip else torch.randn(p.numel(), generator=g)
                    p.grad, r.grad = grad, None if grad is None else grad.clone()
                opt.step()
                ref_opt.step()
            elif action == "state_dict":
                assert_same(ps, opt, ref, ref_opt)
            elif action == "load":
                opt.load_state_dict(ref_opt.state_dict())
            else:
                tm.offloaded.tiers.flush()
        assert_same(ps, opt, ref, ref_opt)
        tiers = tm.offloaded.tiers
        tiers.flush()
        disk_holds_the_buffers(tiers)
