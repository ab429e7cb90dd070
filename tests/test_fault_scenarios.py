"""Faults drawn at random into drawn runs (tests/test_scenarios.py's): nothing is ever lost
silently.

A run (optimizer, tiers, backend, swap dirs, pipeline knobs, durability, overlap, the
weights in the tiers) meets one fault at a drawn place: an I/O error on the n-th read or
write of either engine, once (reissued: the run equals the plain one) or for good, or a
byte flipped in a record's current copy or a swap file truncated between steps. A hard
fault must come out as tiermem's own error; in crash_consistent mode a step that raised
leaves the model and the optimizer at the last committed step, or (the weights tier could
not give every weight back) that step on disk for a resume; and a new block opens
afterwards. The long search this is drawn from (several hundred runs, kills and resumes
too) is described in docs/dev/testing.md.
"""

from __future__ import annotations

import copy
import errno
import os
import pathlib
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.errors import TierMemError, WeightsLost
from tiermem.optim.rules import UnsupportedOptimizer

from adam_helpers import assert_bitwise
from faults import FailedTransfer, FaultyBackend
from offload_helpers import (Synthetic, backend_params, loss_of, make_batches,
                             same_state_value, side_used)
from test_scenarios import OPTIMIZERS, _config, _fresh, _loop, _streams, scenarios


def _reference(sc, model, batches) -> list[dict]:
    """The plain run's weights and state after 0..steps steps."""
    ref = copy.deepcopy(model)
    opt, sched = _fresh(ref, sc, 0, OPTIMIZERS)
    out = []
    for i in range(sc["steps"] + 1):
        if i:
            _loop(ref, opt, sched, batches, i - 1, i, sc)
        out.append({"w": [p.detach().clone() for p in ref.parameters()],
                    "sd": copy.deepcopy(opt.state_dict())})
    return out


def _same(model, sd, snap, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), snap["w"]):
        assert_bitwise(p.detach(), q, f"{what}: {name}")
    if sd is None:
        return
    assert set(sd["state"]) == set(snap["sd"]["state"]), what
    for i, state in snap["sd"]["state"].items():
        for k, v in state.items():
            same_state_value(sd["state"][i][k], v, f"{what}: state[{i}][{k!r}]")


def _engine(tm, which: str):
    if which == "params" and tm.offloaded.weights is not None:
        return tm.offloaded.weights.records.engine
    return tm.offloaded.tiers.engine


def _damage(tm, fault) -> None:
    """Flip a byte in a record's current copy, or truncate its swap file, on disk."""
    store = tm.offloaded.tiers.store
    if store is None or not store.slots:
        return
    pid = sorted(store.slots)[fault["which"] % len(store.slots)]
    slot = store.slots[pid]
    path = store.files[slot.file].path
    start = slot.offset + store.latest.get(pid, 0) * slot.nbytes
    if fault["kind"] == "flip":
        at = start + int(fault["frac"] * slot.nbytes)
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))
    else:
        os.truncate(path, start + int(fault["frac"] * slot.nbytes) // 4096 * 4096)


@st.composite
def faults(draw):
    kind = draw(st.sampled_from(["hard", "transient", "flip", "transient", "truncate", "hard"]))
    # every run writes each record it updates; a small one may read none back
    return dict(kind=kind, op=draw(st.sampled_from(["write", "write", "read"])),
                nth=draw(st.integers(0, 5)), engine=draw(st.sampled_from(["opt", "params"])),
                err=draw(st.sampled_from([errno.EIO, errno.ENOSPC, errno.EAGAIN])),
                late=draw(st.booleans()), at=draw(st.integers(0, 1)),
                which=draw(st.integers(0, 50)), frac=draw(st.floats(0, 0.999)))


@st.composite
def faulty_runs(draw):
    sc = draw(scenarios())
    # one block straight through (the fault is the cut), every record on NVMe (where
    # the faults are)
    sc.update(steps=3, cut=None, resume=False, add_group=None, lanes=None, host=0,
              partition_size="64KiB", freeze=None, zeros=False, edit=False, amp=False)
    if sc["overlap"]:
        sc["clip"] = False
    return sc, draw(faults())


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(run=faulty_runs())
def test_a_drawn_fault_changes_nothing_or_is_tiermems_error(tmp_path_factory, run):
    sc, fault = run
    tmp = pathlib.Path(tmp_path_factory.mktemp("fault"))
    seed = zlib.crc32(repr(sorted(sc.items())).encode()) % 1000
    model = Synthetic(vocab=300, hidden=130, out=9, seed=seed)
    batches = make_batches(model, sc["steps"], micro=sc["micro"], seed=seed)
    snaps = _reference(sc, model, batches)
    opt, sched = _fresh(model, sc, 0, OPTIMIZERS)
    faulty, failed_at, committed, sd = None, None, None, None
    try:
        with tiermem.offload(opt, _config(tmp, sc), model=model, **_streams(sc)) as tm:
            engine = _engine(tm, fault["engine"])
            if fault["kind"] in ("transient", "hard") and engine is not None:
                faulty = FaultyBackend(engine._backend, fault["op"], fault["nth"],
                                       err=fault["err"], late=fault["late"],
                                       times=1 if fault["kind"] == "transient" else 10**6)
                engine._backend = faulty
            for i in range(sc["steps"]):
                if i == fault["at"] and fault["kind"] in ("flip", "truncate"):
                    _damage(tm, fault)
                try:
                    _loop(model, opt, sched, batches, i, i + 1, sc, tm)
                except TierMemError as exc:
                    failed_at, committed = i, tm.committed_step
                    if "completed but could not be committed" in str(exc):
                        committed = i + 1  # nothing is rolled back then (reliability.md)
                    raise
            survived = tm.faults_survived
            sd = opt.state_dict()
    except (TierMemError, UnsupportedOptimizer) as exc:
        assert fault["kind"] != "transient" or isinstance(exc, UnsupportedOptimizer) or (
            faulty is None or not faulty.injected), f"a transient fault raised: {exc!r}"
        if sc["crash"] and failed_at is not None and committed is not None:
            if opt.state:  # handed back: the last committed step
                _same(model, opt.state_dict(), snaps[committed], f"{sc} {fault}")
    else:
        _same(model, sd, snaps[sc["steps"]], f"{sc} {fault}")
        if faulty is not None and fault["kind"] == "transient":
            assert survived == faulty.injected
    # a new block opens and steps afterwards: no engine, file or lock left behind
    m = torch.nn.Linear(40, 40)
    o = torch.optim.AdamW(m.parameters())
    (tmp / "after").mkdir()
    with tiermem.offload(o, {"swap": {"paths": [str(tmp / "after")]},
                             "tiers": {"host": {"capacity": 0}}}):
        m(torch.randn(2, 40)).sum().backward()
        o.step()


# -- found by the drawn search --------------------------------------------------------

# (scenario, step before which the parameter tier's swap file is cut, where it is cut)
LOST = {
    "during-step": (dict(opt="adagrad-fused", two_groups=True, host=0, partition_size="64KiB",
                         buffers=(5, 3), zigzag=False, write_back="immediate", paths=1,
                         overlap=False, weights="nvme", steps=3, micro=1, clip=True,
                         sched=False, lr_change=1, add_group=None, lanes=None), 1, 32768),
    # a read ahead of the cut-off records is in flight when the block ends
    "read-ahead": (dict(opt="nadam", two_groups=False, host=0, partition_size="64KiB",
                        buffers=(3, 2), zigzag=False, write_back="immediate", paths=1,
                        overlap=False, weights="nvme", steps=3, micro=2, clip=True,
                        sched=True, lr_change=1, add_group=None, lanes="cpu"), 0, 286720),
}


# the read ahead is met only where a step fails and rolls back (crash_consistent)
@pytest.mark.parametrize("case,crash", [("during-step", True), ("during-step", False),
                                        ("read-ahead", True)],
                         ids=["during-step-crash_consistent", "during-step-scratch",
                              "read-ahead-crash_consistent"])
@pytest.mark.parametrize("backend", backend_params())
def test_weights_the_tier_cannot_read_back_at_exit_lose_nothing_else(tmp_path, backend,
                                                                     crash, case):
    """parameters.offload: nvme, its swap file cut short between steps: a step fails
    reading a weight record, and so does the block's exit for the records past the cut.
    The other weights still go back to the model; the exit's error names the lost ones
    (never a shape mismatch from gathering state against empty parameters, nor a failed
    read ahead that stops the rest); crash_consistent keeps the last commit untouched (no
    manifest of empty parameters written over it), and a resume gives back its weights
    and state bitwise; scratch hands the optimizer state back with the parameters'
    shapes."""
    base, at, cut = LOST[case]
    sc = dict(base, backend=backend, crash=crash, cut=None, resume=False)
    model = Synthetic(vocab=300, hidden=130, out=9, seed=5)
    batches = make_batches(model, sc["steps"], micro=sc["micro"], seed=5)
    snaps = _reference(sc, model, batches)
    opt, sched = _fresh(model, sc, 0, OPTIMIZERS)
    cfg = _config(tmp_path, sc)
    params_file = tmp_path / "swap" / "tiermem-default.params" / "state.swap"
    committed = None
    with pytest.raises(TierMemError) as info:
        with tiermem.offload(opt, cfg, model=model, **_streams(sc)) as tm:
            for i in range(sc["steps"]):
                if i == at:
                    os.truncate(params_file, cut)
                try:
                    _loop(model, opt, sched, batches, i, i + 1, sc, tm)
                except TierMemError:
                    committed = tm.committed_step
                    break
    lost = info.value if isinstance(info.value, WeightsLost) else info.value.__cause__
    assert isinstance(lost, WeightsLost), info.value
    assert lost.names == ["side.weight", "side.bias"]
    assert str(params_file) in str(lost)
    assert [p.numel() > 0 for p in model.parameters()] == [True] * 5 + [False] * 2
    if not crash:
        # (a step that failed part-way leaves a scratch run's state partly applied: only
        # the shapes of its tensors are the plain run's)
        want = snaps[at + 1]["sd"]["state"]
        for i, state in opt.state_dict()["state"].items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim():
                    assert v.shape == want[i][k].shape, (i, k)
        assert not (tmp_path / "swap" / "tiermem-default").exists()
        return
    assert committed is not None
    assert f"committed step {committed} stays on disk" in str(info.value)
    for (name, p), q in list(zip(model.named_parameters(), snaps[committed]["w"]))[:5]:
        assert_bitwise(p.detach(), q, name)  # rolled back, then given back
    model2 = Synthetic(vocab=300, hidden=130, out=9, seed=6)  # other weights: all restored
    opt2, _ = _fresh(model2, sc, 0, OPTIMIZERS)
    with tiermem.offload(opt2, cfg, model=model2, resume=True, **_streams(sc)) as tm:
        assert tm.resumed_step == committed
        _same(model2, opt2.state_dict(), snaps[committed], "resumed")
        tm.discard()


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("backend", backend_params())
def test_a_step_rolled_back_after_updates_during_backward_asks_for_its_gradients(
        tmp_path, backend, op):
    """crash_consistent, pipeline.overlap_backward and parameters.offload: nvme. A step
    whose I/O fails for good is rolled back, but the updates during backward had taken
    their gradients from memory, and the tier keeps them nowhere else: step() run again
    would miss them (a write fault: silently not the plain run) or read gradient records
    never written. It refuses, naming what to do; after zero_grad() and the backward
    again, the run is bitwise the plain one."""
    sc = dict(opt="adamw-amsgrad", two_groups=False, backend=backend, host=0,
              partition_size="64KiB", buffers=(2, 1), zigzag=True, write_back="immediate",
              paths=1, overlap=True, crash=True, weights="nvme", steps=3, micro=1,
              clip=False, sched=False, lr_change=None, add_group=None, cut=None,
              resume=False, lanes=None)
    model = Synthetic(vocab=300, hidden=130, out=9, seed=7)
    batches = make_batches(model, 3, seed=7)
    snaps = _reference(sc, model, batches)
    opt, _ = _fresh(model, sc, 0, OPTIMIZERS)
    refused = 0
    with tiermem.offload(opt, _config(tmp_path, sc), model=model) as tm:
        engine = tm.offloaded.tiers.engine
        for i in range(3):
            tokens, target = batches[i][0]
            loss_of(model, tokens, target, side_used(i)).backward()
            if i == 1:  # io.retries (2) reissues fail too
                engine._backend = FaultyBackend(engine._backend, op, 0 if op == "read" else 3,
                                                times=3)
            try:
                opt.step()
            except TierMemError:
                assert tm.committed_step == 1
                with pytest.raises(TierMemError, match="run that step's forward and "
                                                       "backward again"):
                    opt.step()
                refused += 1
                opt.zero_grad()
                loss_of(model, tokens, target, side_used(i)).backward()
                opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
    assert refused == 1
    _same(model, sd, snaps[3], "after the backward again")


class _ReadsFail:
    """Every read of the wrapped backend fails (EIO): a drive gone for reads."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def submit(self, *, op, nbytes, offset, **kw):
        if op == "read":
            return FailedTransfer(errno.EIO, offset, nbytes)
        return self.inner.submit(op=op, nbytes=nbytes, offset=offset, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("backend", backend_params())
def test_a_device_models_weights_unread_at_exit_are_named_never_guessed(tmp_path, backend):
    """A device model (its lanes emulated) with parameters.offload: nvme whose weight
    records cannot be read when the block ends: a weight the window holds is not taken
    from the device side's copy (which may still be on its way: the emulation fills it
    with NaN), so every parameter is named lost and none comes back made up."""
    sc = dict(LOST["read-ahead"][0], backend=backend, crash=False, cut=None, resume=False)
    model = Synthetic(vocab=300, hidden=130, out=9, seed=5)
    batches = make_batches(model, sc["steps"], micro=sc["micro"], seed=5)
    opt, sched = _fresh(model, sc, 0, OPTIMIZERS)
    with pytest.raises(WeightsLost) as info:
        with tiermem.offload(opt, _config(tmp_path, sc), model=model, **_streams(sc)) as tm:
            _loop(model, opt, sched, batches, 0, 2, sc, tm)
            engine = tm.offloaded.weights.records.engine
            engine._backend = _ReadsFail(engine._backend)
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in info.value.names if "gradient" not in n] == names
    assert all(p.numel() == 0 for p in model.parameters())
