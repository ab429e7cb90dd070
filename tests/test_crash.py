"""swap.durability: crash_consistent — kill -9 at many points of a step, then resume.

A child process (tests/crash_run.py) trains with the state committed every step and
SIGKILLs itself at one point: before, during or after a record write, before the
flush, between the manifest's write and its rename, after the rename, after a step.
This process then resumes from what the child left and checks, against a plain
torch.optim.AdamW run on the same gradients, that the model's weights and the
optimizer state are bitwise those of the last committed step, that
`tm.resumed_step` names it, that training goes on from there, and that
`tiermem recover` writes the same into a checkpoint file.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
import tiermem.tools.cli
from conftest import BACKEND_PARAMS, sweep
from crash_run import (backward_grads, crash_config, make_model, make_optimizer, run_killed,
                       set_grads)
from offload_helpers import assert_same_tensor, compare_state_dicts, swap_dir
from tiermem.errors import TierMemError
from tiermem.swap.rundir import StaleSwapError

STEPS = 3


def trajectory(grads, steps: int) -> list[tuple[list[torch.Tensor], dict]]:
    """Weights and optimizer state_dict of plain AdamW after 0..steps steps of `grads`."""
    model = make_model()
    opt = make_optimizer(model)
    out = [([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))]
    for k in range(1, steps + 1):
        grads(model, k)
        opt.step()
        out.append(([p.detach().clone() for p in model.parameters()],
                    copy.deepcopy(opt.state_dict())))
    return out


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[torch.Tensor], dict]]:
    return trajectory(set_grads, STEPS + 1)


@pytest.fixture(scope="module")
def partitions(tmp_path_factory) -> int:
    """Records per step (each is written once per step, resident ones too)."""
    model = make_model()
    with tiermem.offload(make_optimizer(model), crash_config(
            str(tmp_path_factory.mktemp("count")), "threads"), model=model) as tm:
        tm.discard()
        return tm.plan()["partitions"]


def expected_step(point: str, out: list[str]) -> int:
    begun = max((int(out[i + 1]) for i, w in enumerate(out) if w == "begin"), default=0)
    return begun if point in ("manifest-renamed", "after-step") else begun - 1


def assert_weights(model: torch.nn.Module, weights: list[torch.Tensor], what: str) -> None:
    for (name, p), w in zip(model.named_parameters(), weights):
        assert_same_tensor(p.detach(), w, f"{what}: {name}")


# (point, n as a function of P = records per step). The step-0 commit at set-up
# writes P records, then syncs and renames manifest 1; step k writes records
# kP+1..(k+1)P and commits manifest k+1.
def poisoned(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every weight 7.0: a resume must put the committed weights back."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    return model


def refused_before_first_commit(opt, cfg, model) -> None:
    """Killed before the first commit: there is no state to resume, and the directory is
    reported rather than reused."""
    with pytest.raises(TierMemError, match="manifest.json does not exist"):
        with tiermem.offload(opt, cfg, model=model, resume=True):
            pass
    with pytest.raises(StaleSwapError, match="did not finish cleanly"):
        with tiermem.offload(opt, cfg, model=model):
            pass


def recover(swap, tmp_path, step: int) -> dict:
    """`tiermem recover`'s checkpoint of the run in `swap`, which must be of `step`."""
    ckpt = tmp_path / "recovered.pt"
    assert tiermem.tools.cli.main(["recover", str(swap_dir(swap)), "-o", str(ckpt)]) == 0
    recovered = torch.load(ckpt)
    assert recovered["step"] == step
    return recovered


POINTS = [
    ("write-before", lambda P: 2),          # set-up, nothing committed yet
    ("sync", lambda P: 1),                  # set-up, records written, not flushed
    ("manifest-tmp", lambda P: 1),          # set-up, manifest written but not renamed
    ("manifest-renamed", lambda P: 1),      # step 0 committed
    ("write-before", lambda P: P + 1),      # first write of step 1
    ("write-after", lambda P: 2 * P + 2),   # a write of step 2 in flight
    ("sync", lambda P: 3),                  # step 2 written, not flushed
    ("manifest-tmp", lambda P: 3),          # step 2's manifest not yet renamed
    ("manifest-renamed", lambda P: 3),      # step 2 committed, directory not fsynced
    ("after-step", lambda P: 2),            # between steps
    ("write-after", lambda P: 4 * P),       # the last write of step 3
]


@pytest.mark.parametrize("backend,point,n", [
    pytest.param(b.values[0], point, n, marks=b.marks, id=f"{point}-{i}-{b.values[0]}")
    for b, (i, (point, n)) in sweep(list(enumerate(POINTS)), BACKEND_PARAMS)])
def test_resume_after_kill(tmp_path, backend, point, n, partitions, reference):
    swap = tmp_path / "swap"
    out = run_killed(swap, backend, f"{point}:{n(partitions)}", STEPS)
    step = expected_step(point, out)
    cfg = crash_config(str(swap), backend)
    model = make_model()
    opt = make_optimizer(poisoned(model))
    if step < 0:
        refused_before_first_commit(opt, cfg, model)
        return
    weights, state = reference[step]
    recovered = recover(swap, tmp_path, step)
    for (name, _), w in zip(make_model().named_parameters(), weights):
        assert_same_tensor(recovered["model"][name], w, f"recovered {name}")
    compare_state_dicts(recovered["optimizer"], state)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == step
        assert_weights(model, weights, f"resumed at step {step}")
        compare_state_dicts(opt.state_dict(), state)
        set_grads(model, step + 1)
        opt.step()
        assert tm.committed_step == step + 1
    assert_weights(model, reference[step + 1][0], f"step {step + 1} after resume")
    compare_state_dicts(opt.state_dict(), reference[step + 1][1])
    assert not swap_dir(swap).exists()


@pytest.fixture(scope="module")
def backward_reference() -> list[tuple[list[torch.Tensor], dict]]:
    """Gradients from a real backward (the overlap runs)."""
    return trajectory(backward_grads, STEPS)


OVERLAP_POINTS = [
    ("write-after", lambda P: P + 2),       # a record written by the worker during backward 1
    ("write-before", lambda P: 2 * P + 3),  # step 2, mid-backward
    ("manifest-renamed", lambda P: 3),      # step 2 committed by step()
]


@pytest.mark.parametrize("point,n", OVERLAP_POINTS,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(OVERLAP_POINTS)])
def test_resume_after_kill_with_overlap(tmp_path, point, n, partitions, backward_reference):
    """pipeline.overlap_backward: the worker writes records while backward runs; a kill
    there resumes to the last step that step() committed."""
    swap = tmp_path / "swap"
    out = run_killed(swap, "threads", f"{point}:{n(partitions)}", STEPS, "fp32", "fp32",
                     "overlap")
    step = expected_step(point, out)
    model = make_model()
    opt = make_optimizer(model)
    cfg = crash_config(str(swap), "threads")
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == step
        assert_weights(model, backward_reference[step][0], f"resumed at step {step}")
        compare_state_dicts(opt.state_dict(), backward_reference[step][1])
        tm.discard()

