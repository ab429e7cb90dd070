"""`opt.state`'s truth inside the block is the plain optimizer's: torch's SGD without
momentum keeps no entry at all, so its opt.state stays empty (false) after any number of
steps, while a group with momentum makes one at its first step. Code that tests
`if opt.state:` (torch.distributed.checkpoint's state_dict helpers, which then run a step
of lr 0 to make state) takes the same branch either way. Red before the rule said which
groups keep an entry (true after the first step, in one process and under a process
group)."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from offload_helpers import (Synthetic, backend_params, compare_runs, config, loss_of,
                             make_batches, side_used)


def _groups(model: Synthetic, momenta: tuple[float, float]) -> list[dict]:
    # the side branch (stepped on some steps only) in a group of its own
    rest = [p for n, p in model.named_parameters() if not n.startswith("side")]
    return [{"params": rest, "momentum": momenta[0]},
            {"params": list(model.side.parameters()), "momentum": momenta[1]}]


def _run(model, opt, batches, seen, start=0):
    for i, micro in enumerate(batches, start=start):
        for tokens, target in micro:
            loss_of(model, tokens, target, side_used(i)).backward()
        opt.step()
        opt.zero_grad()
        seen.append(bool(opt.state))


@pytest.mark.parametrize("momenta", [(0.0, 0.0), (0.0, 0.9), (0.9, 0.0)])
@pytest.mark.parametrize("backend", backend_params())
def test_sgd_state_is_true_only_where_torch_keeps_entries(tmp_path, backend, momenta):
    # (0.0, 0.9): the momentum group steps only on the steps using the side branch, from
    # the second on: false, true, true
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(_groups(model, momenta), lr=0.05)
    ref_opt = torch.optim.SGD(_groups(ref, momenta), lr=0.05)
    batches = make_batches(model, 3)
    want: list[bool] = []
    _run(ref, ref_opt, batches, want)
    got: list[bool] = []
    with tiermem.offload(opt, config(tmp_path, backend=backend)):
        assert not opt.state
        _run(model, opt, batches, got)
        assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()
    assert got == want
    assert bool(opt.state) == bool(ref_opt.state)
    compare_runs(model, opt, ref, ref_opt)


def test_sgd_without_momentum_under_a_process_group(tmp_path):
    import torch.distributed as dist

    tmp_path.chmod(0o700)  # tiermem refuses swap paths others can write
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(_groups(model, (0.0, 0.9)), lr=0.05)
    ref_opt = torch.optim.SGD(_groups(ref, (0.0, 0.9)), lr=0.05)
    batches = make_batches(model, 3)
    want: list[bool] = []
    _run(ref, ref_opt, batches, want)
    c = config(tmp_path / "a")
    c["distributed"] = {"grads": "allreduced"}
    got: list[bool] = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        with tiermem.offload(opt, c, model=model, process_group=dist.group.WORLD):
            _run(model, opt, batches, got)
    finally:
        dist.destroy_process_group()
    assert got == want == [False, True, True]
