"""What each rank runs in tests/test_distributed_whole.py: rules that step whole parameters
(torch's Adafactor and Muon) over ZeRO shares cut between parameters.

The reference on every rank is the plain optimizer on a copy of the model fed the mean
gradient (dist_scenarios.averaged): with 2 ranks the mean is the same sum in the same
order, so the runs are bitwise equal.
"""

from __future__ import annotations

import copy
import os

import torch

import tiermem

from dist_scenarios import (averaged, barrier, groups_of, kept_at_exit, local_backward,
                             small_cfg, train_pair)
from offload_helpers import Synthetic, compare_runs, compare_state_dicts, make_batches


def matrices(model: Synthetic) -> list[dict]:
    """Muon steps 2-D parameters only: two groups of them (the second one small)."""
    return [{"params": [model.emb.weight, model.fc1.weight, model.fc2.weight]},
            {"params": [model.side.weight], "lr": 5e-3}]


# Muon is given only the matrices: the biases get gradients too, and stay as they are
OPTIMIZERS = {
    "adafactor": lambda m: torch.optim.Adafactor(groups_of(m), lr=1e-2, weight_decay=0.01),
    "muon": lambda m: torch.optim.Muon(matrices(m), lr=2e-2, weight_decay=0.01),
}


def whole_parity(rank: int, world: int, tmp: str, name: str, grads: str = "reduce_scatter",
                 durability: str = "scratch") -> None:
    """Weights and state equal the plain optimizer on the mean gradient, step by step;
    each parameter is owned whole by one rank; state_dict() inside the block gathers
    torch's format (each entry from its owner) and loading it back steps on equal; the
    state is whole again on every rank at exit."""
    make = OPTIMIZERS[name]
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref_model)
    cfg = small_cfg(tmp, grads=grads)
    cfg["swap"]["durability"] = durability
    batches = make_batches(model, 5, seed=10 + rank)

    def steps(first: int, n: int) -> None:
        for i, micro in enumerate(batches[first:first + n], start=first):
            local_backward(model, micro, i, rank)
            if grads == "allreduced":  # the mean on every rank, as DDP leaves them
                averaged(model, world)
            opt.step()
            opt.zero_grad()
            local_backward(ref_model, micro, i, rank)
            averaged(ref_model, world)
            ref_opt.step()
            ref_opt.zero_grad()
            for (n_, p), q in zip(model.named_parameters(), ref_model.parameters()):
                assert torch.equal(p.detach(), q.detach()), f"rank {rank} step {i} {n_}"

    with tiermem.offload(opt, cfg) as tm:
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        steps(0, 3)
        sd = opt.state_dict()
        compare_state_dicts(sd, ref_opt.state_dict(), exact=True)
        opt.load_state_dict(sd)
        steps(3, 2)
        plan = tm.plan()
    compare_runs(model, opt, ref_model, ref_opt, exact=True)
    # whole parameters: every parameter the optimizer holds is in one rank's share
    held = [p for g in opt.param_groups for p in g["params"]]
    assert sum(r["share_elements"] for r in plan["ranks"]) == sum(p.numel() for p in held)


def kept(rank: int, world: int, tmp: str) -> None:
    """Crash-consistent Adafactor whose shares stay on disk at exit (no host memory for the
    whole state), for `tiermem recover` in the test process: rank 0 saves what the plain
    optimizer and model hold after the same steps."""

    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS["adafactor"](model), OPTIMIZERS["adafactor"](ref_model)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="kept"):
        train_pair(rank, world, model, opt, ref_model, ref_opt, 3)
    if rank == 0:
        torch.save({"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict()},
                   os.path.join(tmp, "kept.expected.pt"))
    barrier()


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {
        "adafactor": lambda r, d: whole_parity(r, world, d, "adafactor"),
        "adafactor-allreduced": lambda r, d: whole_parity(r, world, d, "adafactor",
                                                          "allreduced"),
        "adafactor-crash-consistent": lambda r, d: whole_parity(
            r, world, d, "adafactor", durability="crash_consistent"),
        "muon": lambda r, d: whole_parity(r, world, d, "muon"),
        "kept": lambda r, d: kept(r, world, d),
    }

    return run_in_dirs(rank, base, table, names)
