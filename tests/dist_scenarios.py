"""What each rank runs in the distributed tests (imported by the spawned processes).

The reference on every rank is a plain torch optimizer on a copy of the model, fed
the same local batches, whose gradients are averaged with an all-reduce: one
process's AdamW on the global batch's mean gradient. tiermem's run on the same
rank must match it (bitwise with 2 ranks, where a sum of two does not depend on
the order; within assert_close_tensor with 3).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tiermem
from tiermem.collectives import PeerError

from offload_helpers import (Synthetic, assert_close_tensor, assert_same_tensor,
                             compare_runs, config, loss_of, make_batches, side_used)

STEPS = 4


def groups_of(model: Synthetic) -> list[dict]:
    """Two groups; the second holds one 33-element bias, so some rank owns none of it."""
    return [{"params": [model.emb.weight, model.fc1.weight, model.fc1.bias, model.fc2.weight,
                        model.fc2.bias, model.side.weight]},
            {"params": [model.side.bias], "lr": 5e-3}]


def used_side(step: int, rank: int) -> bool:
    # Step 2 uses the side branch on rank 0 only: its grads are None on the other ranks.
    return side_used(step) or (step == 2 and rank == 0)


def local_backward(model: Synthetic, micro, step: int, rank: int) -> None:
    for tokens, target in micro:
        loss_of(model, tokens, target, used_side(step, rank)).backward()


def averaged(ref_model: torch.nn.Module, world: int) -> None:
    """The mean of every rank's gradients into ref_model's grads (None where no rank has one)."""
    params = list(ref_model.parameters())
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    for p, has in zip(params, present.tolist()):
        if not has:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        p.grad = g.div_(world)


def parity(rank: int, world: int, tmp: str, backend: str, *, host="0", grads="reduce_scatter",
           ddp: bool = False, amsgrad: bool = False) -> None:
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.05, amsgrad=amsgrad,
                            foreach=False)
    ref_opt = torch.optim.AdamW(groups_of(ref_model), lr=1e-2, weight_decay=0.05,
                                amsgrad=amsgrad, foreach=False)
    batches = make_batches(model, STEPS, seed=10 + rank)
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    cfg = config(tmp, backend=backend, host=host, partition_size="64KiB")
    cfg["distributed"] = {"grads": grads, "bucket_size": "32KiB", "timeout": 120}
    check = assert_same_tensor if world == 2 and not ddp else assert_close_tensor
    with tiermem.offload(opt, cfg, model=model) as tm:
        plan = tm.plan()
        for i, micro in enumerate(batches):
            if ddp:
                for tokens, target in micro:
                    y = net(tokens, used_side(i, rank) or side_used(i))
                    (y.float() - target).square().mean().backward()
            else:
                local_backward(model, micro, i, rank)
            opt.step()
            opt.zero_grad()
            for tokens, target in micro:
                loss_of(ref_model, tokens, target,
                        used_side(i, rank) or (ddp and side_used(i))).backward()
            averaged(ref_model, world)
            ref_opt.step()
            ref_opt.zero_grad()
            for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
                check(p.detach(), q.detach(), f"rank {rank} step {i} {n}")
        stats = tm.stats()
    # The plan is per rank and lists every rank; the shares cover the model exactly once.
    total = sum(p.numel() for p in model.parameters())
    assert plan["world"] == world and plan["rank"] == rank
    assert sum(r["share_elements"] for r in plan["ranks"]) == total
    assert plan["ranks"][rank]["share_elements"] == plan["share_elements"]
    assert len(stats) == STEPS
    if grads == "reduce_scatter":
        assert all(s["comm_bytes"] > 0 for s in stats)
    # At exit every rank holds the whole state again, as the plain optimizer does.
    compare_runs(model, opt, ref_model, ref_opt, exact=check is assert_same_tensor)
