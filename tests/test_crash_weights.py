"""Weights that live outside an fp32 master, committed with the state (crash_consistent).

optimizer.master_weights kahan / none (a bf16 model; int8, fp32 or bf16 moments: COMBOS):
the model's bf16
weights are the only copy of the weights, so a crash-consistent record keeps them too
(kind "weight", copied in by every update). A child (tests/crash_run.py) is killed at
every point tests/test_crash.py kills one, on both backends; resuming from what it left
must give bitwise the weights and optimizer state of an uninterrupted run at the last
committed step and go on from there as it does, and `tiermem recover` must write those
weights (loadable into a plain bf16 model) and that state.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
import tiermem.tools.cli
from conftest import BACKEND_PARAMS, sweep
from crash_run import crash_config, make_model, make_optimizer, run_killed, set_grads
from offload_helpers import assert_same_tensor, compare_state_dicts, swap_dir
from test_crash import POINTS, expected_step, poisoned, recover, refused_before_first_commit

STEPS = 3
# (master_weights, state_dtype)
COMBOS = (("kahan", "int8"), ("none", "int8"), ("kahan", "fp32"), ("none", "bf16"))


def low_config(swap: str, backend: str, master: str, moments: str = "int8") -> dict:
    return crash_config(swap, backend, moments, master)


def uninterrupted(tmp_path_factory, backend: str, master: str, moments: str, steps: int
                  ) -> tuple[int, list[tuple[list[torch.Tensor], dict]]]:
    """(records per step, the weights and state_dict after 0..steps steps) of a run that
    is never killed: what a resume must give back."""
    model = make_model(torch.bfloat16)
    opt = make_optimizer(model)
    cfg = low_config(str(tmp_path_factory.mktemp(f"ref-{master}-{moments}")), backend,
                     master, moments)
    out = []
    with tiermem.offload(opt, cfg, model=model) as tm:
        plan = tm.plan()
        assert plan["partitions"] >= 3 and plan["state_bytes"]["host"] > 0
        for k in range(steps + 1):
            if k:
                set_grads(model, k)
                opt.step()
            out.append(([p.detach().clone() for p in model.parameters()],
                        copy.deepcopy(opt.state_dict())))
        tm.discard()
    return plan["partitions"], out


_REFS: dict[tuple[str, str, str], tuple[int, list]] = {}


@pytest.fixture
def reference(tmp_path_factory, request):
    key = request.param
    if key not in _REFS:
        _REFS[key] = uninterrupted(tmp_path_factory, *key, STEPS + 1)
    return _REFS[key]


def test_records_keep_the_weights_and_the_plan_counts_them(tmp_path):
    """2 B/param more in a crash-consistent record: kahan + int8 4.03 -> 6.03, none + int8
    2.03 -> 4.03, kahan + fp32 10 -> 12, none + bf16 4 -> 6; the plan's arithmetic says
    the same."""
    from tiermem.tools.optimizers import state_bytes

    for (master, moments), per in zip(COMBOS, (6 + 8 / 256, 4 + 8 / 256, 12, 6)):
        model = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters())
        cfg = {"swap": {"paths": [str(tmp_path / f"{master}-{moments}")],
                        "durability": "crash_consistent"},
               "tiers": {"host": {"capacity": 0}}, "pipeline": {"partition_size": "1MiB"},
               "optimizer": {"state_dtype": moments, "master_weights": master}}
        with tiermem.offload(opt, cfg, model=model) as tm:
            got = tm.plan()["state_bytes"]["nvme"] / model.weight.numel()
            tm.discard()
        assert got == pytest.approx(per, rel=0.01), master
        settings = tiermem.load_config(cfg)
        assert state_bytes("adamw", [(1 << 20,)], torch.bfloat16, settings) / (1 << 20) \
            == pytest.approx(per, rel=0.001)


@pytest.mark.parametrize("master,moments", COMBOS)
def test_keeping_the_weights_changes_no_number(tmp_path, master, moments):
    """The copy of the weights in the record changes the layout (fewer elements a
    partition), not the arithmetic: a crash-consistent run trains bitwise as a scratch run
    (int8 rounding streams are keyed by parameter, not by partition)."""
    out = {}
    for durability in ("scratch", "crash_consistent"):
        model = make_model(torch.bfloat16)
        opt = make_optimizer(model)
        cfg = low_config(str(tmp_path / durability), "threads", master, moments)
        cfg["swap"]["durability"] = durability
        with tiermem.offload(opt, cfg, model=model) as tm:
            for k in (1, 2, 3):
                set_grads(model, k)
                opt.step()
            out[durability] = ([p.detach().clone() for p in model.parameters()],
                               copy.deepcopy(opt.state_dict()), tm.plan()["partitions"])
            tm.discard()
    (w0, sd0, n0), (w1, sd1, n1) = out["scratch"], out["crash_consistent"]
    assert n1 > n0  # the layouts differ
    for a, b in zip(w0, w1):
        assert_same_tensor(b, a, "weights")
    compare_state_dicts(sd1, sd0)


REFS = [(b.values[0], m, s) for b in BACKEND_PARAMS for m, s in COMBOS]


@pytest.mark.parametrize("reference,point,n", [
    pytest.param(ref, point, n, id=f"{ref[0]}-{ref[1]}-{ref[2]}-{point}-{i}")
    for ref, (i, (point, n)) in sweep(list(enumerate(POINTS)), REFS)], indirect=["reference"])
def test_resume_after_kill(tmp_path, point, n, reference, request):
    backend, master, moments = request.node.callspec.params["reference"]
    partitions, ref = reference
    swap = tmp_path / "swap"
    out = run_killed(swap, backend, f"{point}:{n(partitions)}", STEPS, "bf16", moments,
                     "synthetic", master)
    step = expected_step(point, out)
    cfg = low_config(str(swap), backend, master, moments)
    model = make_model(torch.bfloat16)
    opt = make_optimizer(poisoned(model))
    if step < 0:
        refused_before_first_commit(opt, cfg, model)
        return
    weights, state = ref[step]
    recovered = recover(swap, tmp_path, step)
    plain = make_model(torch.bfloat16)
    plain.load_state_dict(recovered["model"])  # loads into a plain model, exactly
    for (name, p), w in zip(plain.named_parameters(), weights):
        assert_same_tensor(recovered["model"][name], w.float(), f"recovered {name}")
        assert_same_tensor(p.detach(), w, f"loaded {name}")
    compare_state_dicts(recovered["optimizer"], state)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == step
        for (name, p), w in zip(model.named_parameters(), weights):
            assert_same_tensor(p.detach(), w, f"resumed at step {step}: {name}")
        compare_state_dicts(opt.state_dict(), state)
        set_grads(model, step + 1)
        opt.step()
        assert tm.committed_step == step + 1
        compare_state_dicts(opt.state_dict(), ref[step + 1][1])
        tm.discard()
    for (name, p), w in zip(model.named_parameters(), ref[step + 1][0]):
        assert_same_tensor(p.detach(), w, f"step {step + 1} after resume: {name}")
    assert not swap_dir(swap).exists()
