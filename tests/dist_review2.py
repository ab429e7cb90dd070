"""What each rank runs in tests/test_review2_dist.py (bugs found by the second review of
the distributed add_param_group)."""

from __future__ import annotations

import torch

import tiermem

from dist_scenarios import barrier, local_backward, small_cfg
from offload_helpers import Synthetic, make_batches


def zero_order_differs(rank: int, world: int, tmp: str) -> None:
    """Over ZeRO shares the ranks compare the groups they added at their next agreement by
    parameter count, shapes and dtypes, and settings: two parameters of one shape added in
    another order on one rank (list(set(...)) of the parameters to unfreeze) went on
    without a word, each rank cutting and reducing its own parameter k."""
    from tiermem.dist.collectives import RankMismatch

    model = Synthetic()
    ps = dict(model.named_parameters())
    opt = torch.optim.Adafactor([ps["emb.weight"], ps["fc1.weight"]], lr=1e-2)
    batch = make_batches(model, 1, seed=10 + rank)[0]
    added = [ps["fc2.bias"], ps["side.bias"]]  # both (33,)
    with tiermem.offload(opt, small_cfg(tmp, timeout=20), model=model, name="order") as tm:
        opt.add_param_group({"params": added if rank == 0 else added[::-1]})
        local_backward(model, batch, 0, rank)
        try:
            opt.step()
        except RankMismatch as exc:
            assert "The ranks added param groups that differ" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: groups of other parameters were stepped")
        tm.discard()
    barrier()


def fsdp_order_differs(rank: int, world: int, tmp: str) -> None:
    """Over fully_shard parameters add_param_group is a collective whose ranks compare their
    groups first: two parameters of one shape in another order on one rank went on (their
    owners gathered each other's shards), where it is refused on every rank, added on
    none; the block then adds the group alike."""
    from torch.distributed.fsdp import fully_shard

    from tiermem.errors import TierMemError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(61, 33), torch.nn.Tanh(),
                                torch.nn.Linear(33, 33), torch.nn.Tanh(),
                                torch.nn.Linear(33, 33))
    for layer in (model[0], model[2], model[4], model):
        fully_shard(layer)
    opt = torch.optim.Adafactor(list(model[0].parameters()), lr=1e-2)
    added = [model[2].bias, model[4].bias]  # both (33,)
    with tiermem.offload(opt, small_cfg(tmp, timeout=20), model=model, name="order") as tm:
        try:
            opt.add_param_group({"params": added if rank == 0 else added[::-1]})
        except TierMemError as exc:
            assert "differ in parameter 0 (rank 0: 2.bias, rank 1: 4.bias)" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: groups of other parameters were added")
        assert len(opt.param_groups) == 1 and len(tm.layout.params) == 2, rank
        opt.add_param_group({"params": added})
        x = torch.randn(8, 61, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        opt.step()
        tm.discard()
    barrier()


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {"zero-order-differs": lambda r, d: zero_order_differs(r, world, d),
             "fsdp-order-differs": lambda r, d: fsdp_order_differs(r, world, d)}
    return run_in_dirs(rank, base, table, names)
