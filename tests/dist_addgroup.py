"""What each rank runs in tests/test_distributed_addgroup.py: optimizer.add_param_group()
inside tiermem.offload under a process group for the rules that step whole parameters
(torch's Adafactor and Muon over ZeRO shares cut between parameters; Adafactor, Muon and
the generic path over fully_shard parameters, each parameter owned whole by one rank).

The use case is progressive unfreezing (Lightning's BackboneFinetuning): the added group
holds parameters that were frozen when the block opened. The reference on every rank is
the plain optimizer, which added the same group at the same step, on a copy of the model
fed the mean gradient (dist_scenarios.averaged): with 2 ranks the runs are bitwise equal.
"""

from __future__ import annotations

import copy
import os

import torch

import tiermem

from dist_scenarios import averaged, barrier, kept_at_exit, local_backward, small_cfg
from offload_helpers import Synthetic, compare_runs, compare_state_dicts, make_batches


def _frozen(model: torch.nn.Module, names: list[str], frozen: bool) -> None:
    named = dict(model.named_parameters())
    for n in names:
        named[n].requires_grad_(not frozen)


# The first group, and the group added later (frozen until then): fc2 and the side branch
# (the side branch has a gradient on some steps only, and on one rank only at step 2)
ZERO = {
    "adafactor": (["emb.weight", "fc1.weight", "fc1.bias"],
                  ["fc2.weight", "fc2.bias", "side.weight", "side.bias"],
                  lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01)),
    # Muon steps matrices only
    "muon": (["emb.weight", "fc1.weight"], ["fc2.weight", "side.weight"],
             lambda ps: torch.optim.Muon(ps, lr=2e-2, weight_decay=0.01)),
}


def _zero_steps(rank, world, pairs, batches, steps, allreduced) -> None:
    for i in steps:
        for m, o, ref in pairs:
            local_backward(m, batches[i], i, rank)
            if allreduced or ref:
                averaged(m, world)
            o.step()
            o.zero_grad(set_to_none=True)


def zero_added(rank: int, world: int, tmp: str, name: str, grads: str = "reduce_scatter",
               backend: str = "threads") -> None:
    """Adafactor / Muon over ZeRO shares: a group of parameters frozen when the block opened
    is added on every rank after two steps (unfrozen first, as BackboneFinetuning does);
    weights after every step, state_dict() after the add and the state at exit equal the
    plain optimizer's that added the same group."""
    first, added, make = ZERO[name]
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    for m in (model, ref_model):
        _frozen(m, added, True)
    named, ref_named = dict(model.named_parameters()), dict(ref_model.named_parameters())
    opt, ref_opt = make([named[n] for n in first]), make([ref_named[n] for n in first])
    allreduced = grads == "allreduced"
    batches = make_batches(model, 6, seed=10 + rank)
    pairs = ((model, opt, False), (ref_model, ref_opt, True))
    with tiermem.offload(opt, small_cfg(tmp, backend=backend, grads=grads), model=model) as tm:
        _zero_steps(rank, world, pairs, batches, range(2), allreduced)
        before = tm.plan()["share_elements"]
        for m, o in ((model, opt), (ref_model, ref_opt)):
            _frozen(m, added, False)
            ps = dict(m.named_parameters())
            o.add_param_group({"params": [ps[n] for n in added], "lr": 5e-3})
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        for i in range(2, 6):
            _zero_steps(rank, world, pairs, batches, [i], allreduced)
            for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
                assert torch.equal(p.detach(), q.detach()), f"rank {rank} step {i} {n}"
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        plan = tm.plan()
        assert plan["share_elements"] >= before
        # whole parameters: every parameter held is in exactly one rank's share
        held = [p for g in opt.param_groups for p in g["params"]]
        assert sum(r["share_elements"] for r in plan["ranks"]) == sum(p.numel() for p in held)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {
        "zero-adafactor": lambda r, d: zero_added(r, world, d, "adafactor"),
        "zero-adafactor-allreduced-io_uring": lambda r, d: zero_added(
            r, world, d, "adafactor", "allreduced", "io_uring"),
        "zero-muon": lambda r, d: zero_added(r, world, d, "muon"),
    }
    return run_in_dirs(rank, base, table, names)
