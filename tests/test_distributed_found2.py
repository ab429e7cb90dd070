"""Scenarios found by a second 2-rank search of the sharded path (before the first step with
gradients on some ranks only, weight records a commit rewrote, param groups added under a
process group, ...): one gloo group of 2 runs them all, each test reports one, as
test_distributed.py does. The scenario functions below run in the spawned ranks."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import tiermem
from dist_harness import launch
from dist_scenarios import (averaged, barrier, groups_of, local_backward, pair, same_fqn_state,
                            small_cfg, train_pair)
from offload_helpers import compare_runs, compare_state_dicts, make_batches
from test_distributed import outcome

FOUND = ["helpers-uneven-grads", "dcp-uneven-grads"]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    d = tmp_path_factory.mktemp("found2")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return launch(2, "test_distributed_found2", "run_named", str(d), FOUND, deadline=300)


@pytest.mark.parametrize("name", FOUND)
def test_found(found, name):
    outcome(found, name)


# -- what the ranks run ------------------------------------------------------------------


def _refused_fast(fn, *, expect: bool, why: str, timeout: float) -> None:
    """fn() raises RankMismatch naming `why` (expect) or returns, and well before
    distributed.timeout either way (a hang waits that long, then names a peer)."""
    from tiermem.dist.collectives import RankMismatch

    started = time.monotonic()
    try:
        fn()
    except RankMismatch as exc:
        assert expect, f"refused where it should not be: {exc}"
        assert why in str(exc), exc
    else:
        assert not expect, "not refused"
    assert time.monotonic() - started < timeout / 2, time.monotonic() - started


def helpers_uneven_grads(rank: int, world: int, tmp: str) -> None:
    """torch's get_optimizer_state_dict / set_optimizer_state_dict on a never-stepped tiered
    optimizer when rank 0 has gradients and rank 1 none: torch steps the optimizer (zero
    gradients, lr 0) on rank 1 only, a collective under ZeRO. get: rank 0's state_dict()
    gather paired with rank 1's step and both waited for distributed.timeout; set: rank 0's
    next real step paired with rank 1's lr-0 step and went on silently (the ranks one step
    apart from then on). Now every rank raises at once, naming the helpers' step, and the
    group stays in step."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    timeout = 20
    why = "take that step only on a rank where no parameter has a gradient"
    model, opt, ref_model, ref_opt = pair()
    batches = make_batches(model, 3, seed=10 + rank)
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "get"), timeout=timeout),
                         model=model) as tm:
        if rank == 0:
            local_backward(model, batches[0], 0, rank)
        _refused_fast(lambda: get_optimizer_state_dict(model, opt), expect=True, why=why,
                      timeout=timeout)
        tm.discard()
    barrier()

    for i, micro in enumerate(batches[:2]):  # a checkpoint of 2 steps
        local_backward(ref_model, micro, i, rank)
        averaged(ref_model, world)
        ref_opt.step()
        ref_opt.zero_grad()
    sd = copy.deepcopy(get_optimizer_state_dict(ref_model, ref_opt))
    model = copy.deepcopy(ref_model)
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.05, foreach=False)
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "set"), timeout=timeout),
                         model=model) as tm:
        if rank == 0:
            local_backward(model, batches[2], 2, rank)
        # rank 0 loads (not a collective); rank 1's lr-0 step meets rank 0's next step
        _refused_fast(lambda: set_optimizer_state_dict(model, opt, copy.deepcopy(sd)),
                      expect=rank == 1, why=why, timeout=timeout)
        if rank == 0:
            _refused_fast(opt.step, expect=True, why=why, timeout=timeout)
        tm.discard()
    barrier()


def dcp_uneven_grads(rank: int, world: int, tmp: str) -> None:
    """tiermem.dist.dcp.save and load take no step: before the first step, with gradients on
    rank 0 only, they write and read the never-stepped state (none), and the run then goes
    on equal to the plain one, bitwise; with no gradient anywhere, torch's helpers step
    every rank alike, a frozen parameter (no gradient on any rank) holding no state, as in
    the plain optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from tiermem.dist import dcp

    model, opt, ref_model, ref_opt = pair()
    ck = os.path.join(tmp, "ck")
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a"), timeout=30),
                         model=model) as tm:
        if rank == 0:
            local_backward(model, make_batches(model, 1, seed=99)[0], 0, rank)
        dcp.save(tm, ck)
        dcp.load(tm, ck)
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        opt.zero_grad()
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)

    model, opt, ref_model, ref_opt = pair()
    for m in (model, ref_model):
        m.fc2.bias.requires_grad_(False)
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "b"), timeout=30), model=model):
        same_fqn_state(get_optimizer_state_dict(model, opt),
                       get_optimizer_state_dict(ref_model, ref_opt))
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def run_named(rank: int, world: int, base: str, names: list[str]) -> dict:
    from dist_harness import scenario_results

    table = {
        "helpers-uneven-grads": helpers_uneven_grads,
        "dcp-uneven-grads": dcp_uneven_grads,
    }

    def run(name):
        def go(r):
            d = os.path.join(base, name)
            os.makedirs(d, mode=0o700, exist_ok=True)
            barrier()  # every rank starts each scenario together
            table[name](r, world, d)
        return go

    return scenario_results(rank, {n: run(n) for n in names})
