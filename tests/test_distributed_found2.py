"""Scenarios found by a second 2-rank search of the sharded path (before the first step with
gradients on some ranks only, weight records a commit rewrote, param groups added under a
process group, ...): one gloo group of 2 runs them all, each test reports one, as
test_distributed.py does. The scenario functions below run in the spawned ranks."""

from __future__ import annotations

import collections
import copy
import os
import shutil
import time

import pytest
import torch

import tiermem
from dist_harness import launch
from dist_scenarios import (averaged, barrier, groups_of, local_backward, pair, same_fqn_state,
                            small_cfg, train_pair)
from offload_helpers import (assert_same_tensor, compare_runs, compare_state_dicts, config,
                             make_batches)
from test_distributed import outcome

FOUND = ["helpers-uneven-grads", "dcp-uneven-grads", "commit-writes-split"]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    d = tmp_path_factory.mktemp("found2")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return launch(2, "test_distributed_found2", "run_named", str(d), FOUND, deadline=300)


@pytest.mark.parametrize("name", FOUND)
def test_found(found, name):
    outcome(found, name)


def test_resume_then_edit_before_a_step_some_parameters_skip(tmp_path):
    """Crash-consistent, one process: resumed, the side layer's weight edited, then a step
    the side layer takes no part in, committed and crashed (the run directory copied as
    the crash left it): the resume gives the edited weight. A resume takes no commit
    before its first step, so no version snapshot existed and that step's commit kept
    side.weight's master of before the edit (the Synthetic model's side branch, replaced
    by model.load_state_dict, came back 0.26 off)."""
    swap, image = tmp_path / "swap", tmp_path / "image"
    swap.mkdir(mode=0o700)
    cfg = config(swap)
    cfg["swap"]["durability"] = "crash_consistent"
    xs = [torch.randn(4, 40, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def crash(tm):  # what a kill now would leave on disk: the commit just made
        run = tm.offloaded.tiers.run_dir()
        shutil.rmtree(image, ignore_errors=True)
        shutil.copytree(run, image)
        tm.discard()
        return run

    def run_steps(m, o, steps):
        for i in steps:
            if i == 2:
                with torch.no_grad():
                    m.side.weight.mul_(0.5)
            m(xs[i], i == 0).square().mean().backward()
            o.step()
            o.zero_grad()

    model = Split()
    opt = torch.optim.AdamW(model.groups(), lr=1e-2, foreach=False)
    with tiermem.offload(opt, cfg, model=model, name="c") as tm:
        run_steps(model, opt, [0, 1])
        run = crash(tm)
    for n in (2, 3):
        shutil.copytree(image, run)
        model = Split()
        model.side.weight.detach().zero_()  # the resume must put the committed weights back
        opt = torch.optim.AdamW(model.groups(), lr=1e-2, foreach=False)
        with tiermem.offload(opt, cfg, model=model, name="c", resume=True) as tm:
            assert tm.resumed_step == n
            if n == 2:
                run_steps(model, opt, [2])
                crash(tm)
    ref = Split()
    run_steps(ref, torch.optim.AdamW(ref.groups(), lr=1e-2, foreach=False), [0, 1, 2])
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"resumed {n}")


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


class Split(torch.nn.Module):
    """A main layer and a side one used only at some steps, whose weight (4000 elements, a
    param group of its own) the share cut splits between 2 ranks: [0, 1024) and [1024,
    4000), each its rank's partition."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.main = torch.nn.Linear(40, 40)
            self.side = torch.nn.Linear(40, 100)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        y = self.main(x).sum(1)
        return y + self.side(x).sum(1) if side else y

    def groups(self) -> list[dict]:
        return [{"params": [self.side.weight]},
                {"params": [self.main.weight, self.main.bias, self.side.bias]}]


class _Keep(Exception):
    """Ends a block: every rank keeps its share on disk, as a crash would."""


def commit_writes_split(rank: int, world: int, tmp: str) -> None:
    """Crash-consistent ZeRO shares, fp32: the side layer's weight, split between the
    ranks, has no gradient in most steps. Each rank's weight all-gather wrote its peer's
    piece into the parameter its own piece is a view of, which moved the version counter
    the commit reads for edits: every commit rewrote the side piece's record on every rank
    (a write per step of a piece that did not change). Only a real edit makes a commit
    write it, and a resume's own all-gather of the weights is none either; the edit, made
    before or after a resume, is what the next resume finds."""
    model, ref = Split(), Split()
    opt = torch.optim.AdamW(model.groups(), lr=1e-2, foreach=False)
    ref_opt = torch.optim.AdamW(ref.groups(), lr=1e-2, foreach=False)
    cfg = small_cfg(tmp, timeout=30)
    cfg["swap"]["durability"] = "crash_consistent"
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 40, generator=g) for _ in range(9)]

    def step(i: int, m, o, side: bool = False) -> None:
        for mm, oo in ((m, o), (ref, ref_opt)):
            mm(xs[i], side).square().mean().backward()
            if oo is ref_opt:
                averaged(ref, world)
            oo.step()
            oo.zero_grad()

    def edit(m) -> None:
        with torch.no_grad():
            for mm in (m, ref):
                mm.side.weight.mul_(0.5)

    def side_writes(tm) -> collections.Counter:
        """Writes of the side piece's record, by the step whose commit (or update) made
        them."""
        store, off = tm.offloaded.tiers.store, tm.offloaded
        side = next(p.id for p in off.parts if p.segments[0].param.numel() in (1024, 2976))
        counts: collections.Counter = collections.Counter()
        write = store.write

        def counting(part, buf, **kw):
            if part.id == side:
                counts[off.steps_taken] += 1
            return write(part, buf, **kw)

        store.write = counting
        return counts

    try:
        with tiermem.offload(opt, cfg, model=model, name="split") as tm:
            counts = side_writes(tm)
            step(0, model, opt, side=True)
            for i in (1, 2, 3):
                step(i, model, opt)
            assert not {k: n for k, n in counts.items() if k >= 2}, counts
            edit(model)
            step(4, model, opt)  # the edit is committed at step 5, no update of its own
            assert counts[5] == 1, counts
            raise _Keep()
    except _Keep:
        pass
    # Resumed: the resume's all-gather of the weights is no edit; an edit before the
    # first step after a resume is one, as later ones are.
    for first, edit_at in ((5, 6), (7, 7), (8, None)):
        model = Split()
        model.side.weight.detach().zero_()  # the resume must put the committed weights back
        opt = torch.optim.AdamW(model.groups(), lr=1e-2, foreach=False)
        try:
            with tiermem.offload(opt, cfg, model=model, name="split", resume=True) as tm:
                assert tm.resumed_step == first, tm.resumed_step
                for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                    assert_same_tensor(p.detach(), q.detach(), f"rank {rank} resumed {n}")
                if edit_at is None:
                    step(first, model, opt, side=True)
                    break
                counts = side_writes(tm)
                for i in range(first, edit_at + 1):
                    if i == edit_at:
                        edit(model)
                    step(i, model, opt)
                assert dict(counts) == {edit_at + 1: 1}, counts
                raise _Keep()
        except _Keep:
            pass
    compare_runs(model, opt, ref, ref_opt, exact=True)


def run_named(rank: int, world: int, base: str, names: list[str]) -> dict:
    from dist_harness import scenario_results

    table = {
        "helpers-uneven-grads": helpers_uneven_grads,
        "dcp-uneven-grads": dcp_uneven_grads,
        "commit-writes-split": commit_writes_split,
    }

    def run(name):
        def go(r):
            d = os.path.join(base, name)
            os.makedirs(d, mode=0o700, exist_ok=True)
            barrier()  # every rank starts each scenario together
            table[name](r, world, d)
        return go

    return scenario_results(rank, {n: run(n) for n in names})
