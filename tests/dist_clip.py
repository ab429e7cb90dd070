"""What each rank runs in tests/test_distributed_clip.py: torch's gradient clipping under
distributed.grads: reduce_scatter, where p.grad is each rank's own gradient until the step.

The reference on every rank is the plain optimizer on a copy of the model fed the mean
gradient (dist_scenarios.averaged) and clipped by torch's own clip_grad_norm_ /
clip_grad_value_: what DDP + the plain optimizer do. Bitwise where the shares hold whole
parameters (the norm of norms is torch's own) and for clip_grad_value_; within
assert_close_tensor where the shares cut parameters (the same norm, another rounding).
"""

from __future__ import annotations

import copy

import torch

import tiermem
from tiermem.dist.collectives import RankMismatch
from tiermem.errors import TierMemError

from dist_generic import LionLike
from dist_scenarios import averaged, groups_of, local_backward, small_cfg
from offload_helpers import (Synthetic, assert_close_tensor, assert_same_tensor,
                             compare_runs, make_batches)

MAKE = {
    "adamw": lambda m: torch.optim.AdamW(groups_of(m), lr=1e-2, weight_decay=0.05,
                                         foreach=False),
    "adafactor": lambda m: torch.optim.Adafactor(groups_of(m), lr=1e-2),
    # the generic path: shares of whole parameters too
    "lion": lambda m: LionLike(groups_of(m), lr=1e-3, weight_decay=0.01),
}


def clip_parity(rank: int, world: int, tmp: str, name: str, how: str) -> None:
    """Each step: backward, a clip, the step; the same on the reference, with the mean
    gradient clipped by torch. `how`: norm (every parameter; the clip bites), value,
    subset (fc1's parameters by norm, then everything by value), tm (tm.clip_grad_norm_),
    inf (the max norm)."""
    exact = name in ("adafactor", "lion") or how == "value"
    check = assert_same_tensor if exact else assert_close_tensor
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = MAKE[name](model), MAKE[name](ref_model)
    batches = make_batches(model, 4, seed=10 + rank)
    bit = 0

    def clip(m, tm=None):
        params = list(m.parameters())
        if how == "norm":
            return torch.nn.utils.clip_grad_norm_(params, 0.05)
        if how == "inf":
            return torch.nn.utils.clip_grad_norm_(params, 0.01, norm_type=float("inf"))
        if how == "tm" and tm is not None:
            return tm.clip_grad_norm_(0.05)
        if how == "tm":
            return torch.nn.utils.clip_grad_norm_(params, 0.05)
        if how == "value":
            torch.nn.utils.clip_grad_value_(params, 1e-3)
            return None
        total = torch.nn.utils.clip_grad_norm_([m.fc1.weight, m.fc1.bias], 0.02)
        torch.nn.utils.clip_grad_value_(params, 2e-3)
        return total

    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        for i, micro in enumerate(batches):
            local_backward(model, micro, i, rank)
            total = clip(model, tm)
            opt.step()
            opt.zero_grad()
            local_backward(ref_model, micro, i, rank)
            averaged(ref_model, world)
            ref_total = clip(ref_model)
            ref_opt.step()
            ref_opt.zero_grad()
            if total is not None:
                check(total, ref_total, f"rank {rank} step {i}: the total norm")
                bit += bool(ref_total > 0.05)
            for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
                check(p.detach(), q.detach(), f"rank {rank} step {i} {n}")
    compare_runs(model, opt, ref_model, ref_opt, exact=exact)
    assert how in ("value", "inf") or bit, "the clip never bit: the test shows nothing"


def edited_refused(rank: int, world: int, tmp: str) -> None:
    """p.grad edited in place after a clip: the step is refused on every rank (the clip
    took the averaged gradient; the edit cannot be applied on top of it as DDP would).
    Starting over (zero_grad, a new backward) after a clip whose step was skipped is
    DDP's: the new gradients, clipped again, step as the reference's."""
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = MAKE["adamw"](model), MAKE["adamw"](ref_model)
    batches = make_batches(model, 3, seed=10 + rank)
    with tiermem.offload(opt, small_cfg(tmp)):
        local_backward(model, batches[0], 0, rank)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        model.fc1.weight.grad.mul_(2)
        try:
            opt.step()
        except TierMemError as exc:
            assert "p.grad changed between clip_grad_norm_" in str(exc), exc
        else:
            raise AssertionError("a step after p.grad was edited since the clip ran")
        try:  # the same at another clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        except TierMemError as exc:
            assert "another torch.nn.utils.clip_grad_norm_" in str(exc), exc
        else:
            raise AssertionError("a clip after p.grad was edited since the last clip ran")
        # a skipped step: start over, twice (the second time with the clip's total known)
        for i in (1, 2):
            opt.zero_grad()
            local_backward(model, batches[i], i, rank)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    local_backward(ref_model, batches[2], 2, rank)
    averaged(ref_model, world)
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    ref_opt.step()
    compare_runs(model, opt, ref_model, ref_opt, exact=False)


def refusals(rank: int, world: int, tmp: str) -> None:
    """A clip over the optimizer's parameters and others with gradients of their own; the
    0-norm over pieces of parameters; a clip on one rank only (RankMismatch on both, no
    hang); add_param_group between a clip and the step."""
    model = Synthetic()
    opt = MAKE["adamw"](model)
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    batches = make_batches(model, 2, seed=10 + rank)
    with tiermem.offload(opt, small_cfg(tmp, timeout=60)):
        local_backward(model, batches[0], 0, rank)
        for call, says in [
                (lambda: torch.nn.utils.clip_grad_norm_([*model.parameters(), other], 1.0),
                 "and 1 others with gradients in p.grad"),
                (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=0),
                 "norm_type 0"),
        ]:
            try:
                call()
            except TierMemError as exc:
                assert says in str(exc), exc
            else:
                raise AssertionError(f"not refused: {says}")
        try:
            if rank == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                opt.step()
        except RankMismatch as exc:
            assert "clip_grad_norm_" in str(exc) and "opt.step()" in str(exc), exc
        else:
            raise AssertionError("a clip on one rank and a step on the other went on")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # together now
        extra = torch.nn.Linear(2, 2)
        try:
            opt.add_param_group({"params": list(extra.parameters())})
        except TierMemError as exc:
            assert "between a gradient clip and opt.step()" in str(exc), exc
        else:
            raise AssertionError("add_param_group between a clip and the step was taken")
        opt.step()
        opt.zero_grad()


def plans_after_add(rank: int, world: int, tmp: str) -> None:
    """tm.plan()['ranks'] counts a group added inside the block from the next step on."""
    model = Synthetic()
    opt = MAKE["adamw"](model)
    extra = torch.nn.Linear(40, 30)
    batches = make_batches(model, 1, seed=10 + rank)
    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        before = sum(r["share_elements"] for r in tm.plan()["ranks"])
        opt.add_param_group({"params": list(extra.parameters())})
        local_backward(model, batches[0], 0, rank)
        extra(torch.ones(1, 40)).sum().backward()
        opt.step()
        after = sum(r["share_elements"] for r in tm.plan()["ranks"])
    assert after == before + 40 * 30 + 30, (before, after)


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {f"{name}-{how}": (lambda r, d, name=name, how=how:
                               clip_parity(r, world, d, name, how))
             for name, how in [("adamw", "norm"), ("adamw", "value"), ("adamw", "subset"),
                               ("adamw", "inf"), ("adafactor", "norm"),
                               ("adafactor", "tm"), ("lion", "norm")]}
    table.update({
        "edited-refused": lambda r, d: edited_refused(r, world, d),
        "refusals": lambda r, d: refusals(r, world, d),
        "plans-after-add": lambda r, d: plans_after_add(r, world, d),
    })
    return run_in_dirs(rank, base, table, names)
