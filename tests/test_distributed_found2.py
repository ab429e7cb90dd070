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
import torch.distributed as dist

import tiermem
from dist_harness import launch
from dist_scenarios import (averaged, barrier, groups_of, local_backward, pair, same_fqn_state,
                            small_cfg, train_pair)
from offload_helpers import (Synthetic, assert_same_tensor, compare_runs, compare_state_dicts,
                             config, make_batches)
from test_distributed import outcome

FOUND = ["helpers-uneven-grads", "dcp-uneven-grads", "commit-writes-split", "added-groups",
         "added-groups-crash", "added-group-one-rank", "fsdp2-added-group",
         "appended-group-refused", "allreduced-uneven-grads", "two-blocks"]


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
        # rank 0 loads (not a collective); the others' lr-0 step meets rank 0's next step
        _refused_fast(lambda: set_optimizer_state_dict(model, opt, copy.deepcopy(sd)),
                      expect=rank != 0, why=why, timeout=timeout)
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


# -- add_param_group under a process group ------------------------------------------------


def _grown(rank: int, world: int, model, opt, ref_model, ref_opt, steps, adds: dict, *,
           allreduced: bool = False) -> None:
    """Steps of the Synthetic model on every rank's batches, the reference on the mean
    gradient; before step i, the groups adds[i] (parameter names) are added to both
    optimizers. The gradients are cleared whole (model.zero_grad()): a parameter in no
    group yet keeps no gradient from one step to the next, so the mean the reference
    takes of it is the one tiermem's reduce-scatter takes. allreduced: the model's
    gradients averaged before the step, as DDP's are."""
    batches = make_batches(model, max(steps) + 1, seed=10 + rank)
    for i in steps:
        for g in adds.get(i, ()):
            for m, o in ((model, opt), (ref_model, ref_opt)):
                named = dict(m.named_parameters())
                o.add_param_group({**g, "params": [named[n] for n in g["params"]]})
        for m, o in ((model, opt), (ref_model, ref_opt)):
            local_backward(m, batches[i], i, rank)
            if allreduced or m is ref_model:
                averaged(m, world)
            o.step()
            m.zero_grad()


FIRST = ["emb.weight", "fc1.weight", "fc1.bias"]
# Added before step 1: fc2 and side.weight (36k elements: the cut falls in fc2.weight, each
# rank owns pieces); before step 3: side.bias alone (33 elements: rank 0 owns none of it).
ADDS = {1: [{"params": ["fc2.weight", "fc2.bias", "side.weight"], "lr": 5e-3}],
        3: [{"params": ["side.bias"], "weight_decay": 0.0}]}


def _adamw(model, names, **kw) -> torch.optim.Optimizer:
    named = dict(model.named_parameters())
    return torch.optim.AdamW([named[n] for n in names], lr=1e-2, weight_decay=0.05,
                             foreach=False, **kw)


def _refused_adds(tm, opt) -> None:
    """Groups refused by the layout (mixed dtypes) or by the shadow optimizer's rule
    (differentiable=True) leave the optimizer, the shares and the tiers as they were (the
    run then goes on bitwise)."""
    lay, off = tm.layout, tm.offloaded

    def shape():
        return (len(opt.param_groups), len(lay.params), lay.share_elements, len(lay.windows),
                len(off.origins), len(off.share["pieces"]), len(off.parts),
                len(tm.shadow.param_groups), dict(lay.shadow_index))

    before = shape()
    for group, why in (({"params": [torch.nn.Parameter(torch.zeros(3)),
                                    torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]},
                        "mixes dtypes"),
                       ({"params": [torch.nn.Parameter(torch.zeros(2048))],
                         "differentiable": True}, "differentiable=True is not supported")):
        try:
            opt.add_param_group(group)
        except tiermem.TierMemError as exc:
            assert why in str(exc), exc
        else:
            raise AssertionError(f"not refused: {why}")
        assert shape() == before, (shape(), before)


def added_groups(rank: int, world: int, tmp: str) -> None:
    """add_param_group inside the block under a process group (it was refused): every rank
    adds the same group, which is cut into shares as at set-up; weights, state_dict() and
    the state at exit equal the plain AdamW's that added the same groups, bitwise, for
    both gradient modes, and Adagrad's (whose added groups hold no state until stepped)."""
    def adagrad(m):  # state made by __init__ only: an added group starts with none
        named = dict(m.named_parameters())
        return torch.optim.Adagrad([named[n] for n in FIRST], lr=0.05,
                                   initial_accumulator_value=0.1)

    def adamw(m):
        return _adamw(m, FIRST, amsgrad=True)

    for n, (grads, make) in enumerate((("reduce_scatter", adamw), ("allreduced", adamw),
                                       ("reduce_scatter", adagrad))):
        model = Synthetic()
        ref_model = copy.deepcopy(model)
        opt, ref_opt = make(model), make(ref_model)
        cfg = small_cfg(os.path.join(tmp, str(n)), timeout=30, grads=grads)
        with tiermem.offload(opt, cfg, model=model) as tm:
            set_up = tm.plan()["share_elements"]
            if n == 0:
                _refused_adds(tm, opt)
            run = (rank, world, model, opt, ref_model, ref_opt)
            _grown(*run, range(3), ADDS, allreduced=grads == "allreduced")
            compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
            _grown(*run, range(3, 5), ADDS, allreduced=grads == "allreduced")
            shares = tm.layout.shares
            assert sum(s.size(r) for s in shares for r in range(world)) == sum(
                p.numel() for p in model.parameters())
            assert tm.layout.share_elements > set_up
        compare_runs(model, opt, ref_model, ref_opt, exact=True)
        barrier()


def added_groups_crash(rank: int, world: int, tmp: str) -> None:
    """Groups added under crash_consistent are committed with the step they are added at;
    a run kept on disk after them resumes with the optimizer built with every group (each
    rank's manifest says where its pieces of the added groups lie) and goes on bitwise, as
    a dcp.save of it loaded into a fresh run does; `tiermem recover` of the kept shares
    gives the plain optimizer's state_dict and weights."""
    from tiermem.dist import dcp
    from tiermem.swap.recover import gather

    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = _adamw(model, FIRST), _adamw(ref_model, FIRST)
    cfg = small_cfg(tmp, timeout=30)
    cfg["swap"]["durability"] = "crash_consistent"
    try:
        with tiermem.offload(opt, cfg, model=model, name="grow") as tm:
            _grown(rank, world, model, opt, ref_model, ref_opt, range(4), ADDS)
            dcp.save(tm, os.path.join(tmp, "ck"))
            raise _Keep()
    except _Keep:
        pass
    barrier()  # every rank's share kept: `tiermem recover` puts them back together
    got = gather(os.path.join(tmp, f"tiermem-grow-rank{rank}"))
    compare_state_dicts(got["optimizer"], ref_opt.state_dict(), exact=True)
    for k, v in ref_model.state_dict().items():
        assert_same_tensor(got["model"][k], v, f"recovered {k}")
    # Resumed without the group added last (which rank 0 owns none of): every rank refuses,
    # naming the groups (rank 0, whose pieces are the same, accepted it and blamed rank 1,
    # which blamed the world size)
    m = Synthetic()
    opt = _adamw(m, FIRST)
    named = dict(m.named_parameters())
    opt.add_param_group({**ADDS[1][0], "params": [named[n] for n in ADDS[1][0]["params"]]})
    try:
        with tiermem.offload(opt, cfg, model=m, name="grow", resume=True):
            pass
    except tiermem.TierMemError as exc:
        assert "over 7 parameters in 3 param groups, and this optimizer has 6 parameters in " \
            "2 param groups" in str(exc), exc
    else:
        raise AssertionError("resumed without the added group")
    barrier()
    for how in ("resume", "dcp"):
        m = Synthetic(seed=1)  # the resume must put the committed weights back
        if how == "dcp":
            m.load_state_dict(model.state_dict())
        opt = _adamw(m, FIRST)
        named = dict(m.named_parameters())
        for i in (1, 3):
            for g in ADDS[i]:
                opt.add_param_group({**g, "params": [named[n] for n in g["params"]]})
        r_model, r_opt = copy.deepcopy((ref_model, ref_opt))
        with tiermem.offload(opt, cfg, model=m, name="grow" if how == "resume" else "fresh",
                             resume=how == "resume") as tm:
            if how == "dcp":
                dcp.load(tm, os.path.join(tmp, "ck"))
            else:
                assert tm.resumed_step == 4, tm.resumed_step
            compare_state_dicts(opt.state_dict(), r_opt.state_dict(), exact=True)
            _grown(rank, world, m, opt, r_model, r_opt, range(4, 6), {})
        compare_runs(m, opt, r_model, r_opt, exact=True)
        barrier()


def added_group_one_rank(rank: int, world: int, tmp: str) -> None:
    """A group added on one rank only: the next step would communicate other shapes on each
    rank; every rank refuses it at once instead, naming each rank's parameter count."""
    model = Synthetic()
    opt = _adamw(model, FIRST)
    with tiermem.offload(opt, small_cfg(tmp, timeout=20), model=model) as tm:
        if rank == 1:
            opt.add_param_group({"params": [model.side.bias]})
        local_backward(model, make_batches(model, 1, seed=10 + rank)[0], 0, rank)
        _refused_fast(opt.step, expect=True, why="over 3 parameters in 1 param groups",
                      timeout=20)
        tm.discard()
    barrier()


def appended_group_refused(rank: int, world: int, tmp: str) -> None:
    """A group appended to opt.param_groups by hand (not add_param_group) mid-run: one
    process refuses it at the next step; under a process group the step zipped the user's
    groups with the shadow's and passed over it, so side.bias was never updated (2e-2
    off plain AdamW after 2 steps), silently. Every rank refuses it now, as one process
    does; groups replaced by equal ones (Lightning's BaseFinetuning) still step."""
    model = Synthetic()
    opt = _adamw(model, FIRST)
    batches = make_batches(model, 3, seed=10 + rank)
    with tiermem.offload(opt, small_cfg(tmp, timeout=20), model=model) as tm:
        for i in range(2):
            local_backward(model, batches[i], i, rank)
            opt.step()
            model.zero_grad()
        opt.param_groups = [dict(g) for g in opt.param_groups]  # the same parameters
        opt.param_groups.append({**opt.param_groups[0], "params": [model.side.bias]})
        local_backward(model, batches[2], 2, rank)
        try:
            opt.step()
        except tiermem.TierMemError as exc:
            assert "changed inside the tiermem.offload block other than through " \
                "add_param_group" in str(exc), exc
        else:
            raise AssertionError("a group appended to param_groups was not refused")
        opt.param_groups.pop()
        opt.step()
        tm.discard()


def allreduced_uneven_grads(rank: int, world: int, tmp: str) -> None:
    """distributed.grads: allreduced with gradients on different parameters per rank (a
    hand-made average that skips the side branch, used on rank 0 only): no collective
    agreed on which parameters have gradients, so side.* was stepped by none of its owners
    (rank 1, with none) while rank 0's gradient went nowhere, silently. Every rank now
    refuses the step, saying what allreduced needs; with the same set it steps on."""
    model = Synthetic()
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2)
    with tiermem.offload(opt, small_cfg(tmp, timeout=20, grads="allreduced"), model=model) as tm:
        local_backward(model, make_batches(model, 3, seed=10 + rank)[2], 2, rank)
        assert (model.side.weight.grad is not None) == (rank == 0)  # used_side(2, rank)
        for n, p in model.named_parameters():
            if not n.startswith("side"):
                dist.all_reduce(p.grad)
                p.grad /= world
        _refused_fast(opt.step, expect=True, why="every rank must have gradients for the "
                      "same parameters", timeout=20)
        for p in model.side.parameters():
            p.grad = None
        opt.step()
        tm.discard()


def two_blocks(rank: int, world: int, tmp: str) -> None:
    """Two offload blocks open at once over one group (a GAN's two optimizers, AdamW and SGD)
    step bitwise as the plain ones. A rank stepping one while the other steps the other (two
    models of one shape) paired the two steps' collectives and went on with each other's
    gradients, silently; every rank refuses it now, naming each rank's block."""
    a, b = Synthetic(), Synthetic(seed=1)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    opts = [torch.optim.AdamW(groups_of(a), lr=1e-2, foreach=False),
            torch.optim.SGD(groups_of(b), lr=0.05, momentum=0.9)]
    refs = [torch.optim.AdamW(groups_of(ref_a), lr=1e-2, foreach=False),
            torch.optim.SGD(groups_of(ref_b), lr=0.05, momentum=0.9)]
    batches = make_batches(a, 3, seed=10 + rank)
    with tiermem.offload(opts[0], small_cfg(os.path.join(tmp, "a"), timeout=20), model=a,
                         name="a"), \
            tiermem.offload(opts[1], small_cfg(os.path.join(tmp, "b"), timeout=20), model=b,
                            name="b"):
        for i in range(2):
            for m, o, r, ro in ((a, opts[0], ref_a, refs[0]), (b, opts[1], ref_b, refs[1])):
                for mm, oo in ((m, o), (r, ro)):
                    local_backward(mm, batches[i], i, rank)
                    if mm is r:
                        averaged(mm, world)
                    oo.step()
                    oo.zero_grad()
    compare_runs(a, opts[0], ref_a, refs[0], exact=True)
    compare_runs(b, opts[1], ref_b, refs[1], exact=True)
    opts = [torch.optim.AdamW(groups_of(m), lr=1e-2) for m in (a, b)]
    with tiermem.offload(opts[0], small_cfg(os.path.join(tmp, "c"), timeout=20), model=a,
                         name="c") as t1, \
            tiermem.offload(opts[1], small_cfg(os.path.join(tmp, "d"), timeout=20), model=b,
                            name="d") as t2:
        local_backward((a, b)[rank], batches[2], 2, rank)
        _refused_fast(opts[rank].step, expect=True, why="rank 1 is in opt.step() over 7 "
                      "parameters in 2 param groups of tiermem.offload(name='d')", timeout=20)
        t1.discard()
        t2.discard()


def fsdp2_added_group(rank: int, world: int, tmp: str) -> None:
    """add_param_group on fully_shard parameters: the added group's local shards are tiered
    from then on; weights and state equal the plain AdamW's that added the same group."""
    from dist_scenarios import sharded_pair

    from offload_helpers import assert_close_tensor

    model, ref_model = sharded_pair()
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    ref_opt = torch.optim.AdamW(ref_model[0].parameters(), lr=1e-2, weight_decay=0.05,
                                foreach=False)
    g = torch.Generator().manual_seed(20 + rank)
    with tiermem.offload(opt, small_cfg(tmp, timeout=30)):
        for i in range(3):
            if i == 1:
                opt.add_param_group({"params": list(model[2].parameters()), "lr": 5e-3})
                ref_opt.add_param_group({"params": list(ref_model[2].parameters()),
                                         "lr": 5e-3})
            x, y = torch.randn(8, 61, generator=g), torch.randn(8, 33, generator=g)
            for m, o in ((model, opt), (ref_model, ref_opt)):
                (m(x) - y).square().mean().backward()
                if m is ref_model:
                    averaged(m, world)
                o.step()
                m.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_close_tensor(p.full_tensor().detach(), q.detach(), f"rank {rank} {n}")
        st, sr = opt.state[p], ref_opt.state[q]
        assert float(st["step"]) == float(sr["step"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close_tensor(st[k].full_tensor(), sr[k], f"rank {rank} {n} {k}")


def run_named(rank: int, world: int, base: str, names: list[str]) -> dict:
    from dist_harness import scenario_results

    table = {
        "helpers-uneven-grads": helpers_uneven_grads,
        "dcp-uneven-grads": dcp_uneven_grads,
        "commit-writes-split": commit_writes_split,
        "added-groups": added_groups,
        "added-groups-crash": added_groups_crash,
        "added-group-one-rank": added_group_one_rank,
        "fsdp2-added-group": fsdp2_added_group,
        "appended-group-refused": appended_group_refused,
        "allreduced-uneven-grads": allreduced_uneven_grads,
        "two-blocks": two_blocks,
    }

    def run(name):
        def go(r):
            d = os.path.join(base, name)
            os.makedirs(d, mode=0o700, exist_ok=True)
            barrier()  # every rank starts each scenario together
            table[name](r, world, d)
        return go

    return scenario_results(rank, {n: run(n) for n in names})
