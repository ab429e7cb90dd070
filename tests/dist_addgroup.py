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
from unittest import mock

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


def _zero_pair(first, added, make):
    """The model and its reference copy, the `added` parameters frozen in both, and the
    optimizer of the `first` ones for each."""
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    for m in (model, ref_model):
        _frozen(m, added, True)
    named, ref_named = dict(model.named_parameters()), dict(ref_model.named_parameters())
    return model, ref_model, make([named[n] for n in first]), make([ref_named[n] for n in first])


def _unfreeze_and_add(pairs, added) -> None:
    """BackboneFinetuning's unfreeze_and_add_param_group, on each (model, optimizer)."""
    for m, o in pairs:
        _frozen(m, added, False)
        ps = dict(m.named_parameters())
        o.add_param_group({"params": [ps[n] for n in added], "lr": 5e-3})


def _recovered_equal(tmp, rank, ref_model, ref_opt) -> None:
    """`tiermem recover` of this rank's kept directory: step 4, the plain run's state and
    weights."""
    from tiermem.swap.recover import gather

    got = gather(os.path.join(tmp, f"tiermem-crash-rank{rank}"))
    assert got["step"] == 4, got["step"]
    compare_state_dicts(got["optimizer"], ref_opt.state_dict(), exact=True)
    for k, v in ref_model.state_dict().items():
        assert torch.equal(got["model"][k], v), f"recovered {k}"


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
    model, ref_model, opt, ref_opt = _zero_pair(first, added, make)
    allreduced = grads == "allreduced"
    batches = make_batches(model, 6, seed=10 + rank)
    pairs = ((model, opt, False), (ref_model, ref_opt, True))
    with tiermem.offload(opt, small_cfg(tmp, backend=backend, grads=grads), model=model) as tm:
        _zero_steps(rank, world, pairs, batches, range(2), allreduced)
        before = tm.plan()["share_elements"]
        _unfreeze_and_add(((model, opt), (ref_model, ref_opt)), added)
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


def zero_crash_resume(rank: int, world: int, tmp: str) -> None:
    """crash_consistent Adafactor over ZeRO shares, a group of frozen parameters added inside
    the block (committed with the add), kept on disk at exit: `tiermem recover` of one
    rank's directory gives the plain optimizer's state_dict and weights, and a run whose
    optimizer is built with every group resumes on every rank and goes on equal."""
    first, added, make = ZERO["adafactor"]
    model, ref_model, opt, ref_opt = _zero_pair(first, added, make)
    batches = make_batches(model, 6, seed=10 + rank)
    pairs = ((model, opt, False), (ref_model, ref_opt, True))
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="crash"):
        _zero_steps(rank, world, pairs, batches, range(2), False)
        _unfreeze_and_add(((model, opt), (ref_model, ref_opt)), added)
        _zero_steps(rank, world, pairs, batches, range(2, 4), False)
    barrier()  # every rank's share kept
    _recovered_equal(tmp, rank, ref_model, ref_opt)
    model = Synthetic(seed=1)  # the resume must put the committed weights back
    named = dict(model.named_parameters())
    opt = make([named[n] for n in first])
    opt.add_param_group({"params": [named[n] for n in added], "lr": 5e-3})
    pairs = ((model, opt, False), (ref_model, ref_opt, True))
    with tiermem.offload(opt, cfg, model=model, name="crash", resume=True) as tm:
        assert tm.resumed_step == 4, tm.resumed_step
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        _zero_steps(rank, world, pairs, batches, range(4, 6), False)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def zero_differs(rank: int, world: int, tmp: str) -> None:
    """Over ZeRO shares add_param_group is no collective: the ranks compare the groups they
    added at their next agreement (the step's), where a group added with other settings, or
    other parameters of the same count, on one rank is refused on every rank, the digests
    saying which differs (both had gone on: the first with each owner's own lr, the second
    into collectives of other sizes)."""
    import re

    from tiermem.dist.collectives import RankMismatch

    first, added, make = ZERO["adafactor"]
    cases = (("lr", lambda ps: {"params": [ps[n] for n in added],
                                "lr": 5e-3 if rank == 0 else 1e-3}),
             ("shapes", lambda ps: {"params": [ps["fc2.weight" if rank == 0 else
                                                  "side.weight"]]}))
    for k, (what, group) in enumerate(cases):
        model = Synthetic()
        ps = dict(model.named_parameters())
        opt = make([ps[n] for n in first])
        batch = make_batches(model, 1, seed=10 + rank)[0]
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, str(k)), timeout=20),
                             model=model, name=f"differs{k}") as tm:
            opt.add_param_group(group(ps))
            local_backward(model, batch, 0, rank)
            try:
                opt.step()
            except RankMismatch as exc:
                assert "The ranks added param groups that differ" in str(exc), exc
                said = re.findall(r"shapes and dtypes (\w+), settings (\w+)", str(exc))
                assert len(said) == 2, exc
                (s0, h0), (s1, h1) = said
                assert (s0 == s1, h0 == h1) == ((True, False) if what == "lr" else
                                                (False, True)), (what, said)
            else:
                raise AssertionError(f"rank {rank}: groups with other {what} were stepped")
            tm.discard()
        barrier()


# -- over fully_shard parameters: each parameter owned whole by one rank -----------------

def _fsdp_opts():
    from dist_generic import CountingSGD

    return {
        "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01),
        "muon": lambda ps: torch.optim.Muon(ps, lr=2e-2, weight_decay=0.01),
        # the generic path: a subclass of SGD with a step of its own, counting in its groups
        "counting-sgd": lambda ps: CountingSGD(ps, lr=1e-2, momentum=0.9),
    }


def _fsdp_groups(m: torch.nn.Module, name: str) -> tuple[list, list[list]]:
    """The first layer's parameters, and the two groups added later (frozen until then): the
    second layer's (1031 x 33: both ranks own some, uneven shards), then the last layer's
    (one row: rank 1's shard is empty; rank 1 owns all of it, so rank 0 steps that group
    with no parameters). Muon is given the matrices only."""
    keep = (lambda p: p.dim() == 2) if name == "muon" else (lambda p: True)
    first = [p for p in m[0].parameters() if keep(p)]
    return first, [[p for p in m[k].parameters() if keep(p)] for k in (2, 4)]


LRS = (5e-3, 2e-3)  # the added groups' lr


def _whole_sd(sd: dict) -> dict:
    from dist_fsdp_whole import full

    return {"state": {i: {k: full(v) for k, v in st.items()} for i, st in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def _fsdp_add(model, opt, ref_model, ref_opt, name: str, k: int) -> None:
    """The k-th later group unfrozen and added, to both optimizers."""
    for m, o in ((model, opt), (ref_model, ref_opt)):
        group = _fsdp_groups(m, name)[1][k]
        for p in group:
            p.requires_grad_(True)
        o.add_param_group({"params": group, "lr": LRS[k]})


def _fsdp_start(name: str):
    from dist_fsdp_whole import model_pair

    model, ref_model = model_pair()
    for m in (model, ref_model):
        for group in _fsdp_groups(m, name)[1]:
            for p in group:
                p.requires_grad_(False)
    make = _fsdp_opts()[name]
    return model, make(_fsdp_groups(model, name)[0]), ref_model, \
        make(_fsdp_groups(ref_model, name)[0])


def fsdp_added(rank: int, world: int, tmp: str, name: str, backend: str = "threads") -> None:
    """Groups of parameters frozen when the block opened are added on every rank, after two
    steps and after three (a collective over fully_shard parameters: the owners of the new
    parameters are chosen and their weights gathered to them); the weights after every
    step, state_dict() after each add and later, and opt.state at exit (DTensors) equal the
    plain optimizer's that added the same groups. The generic path's group values too
    (CountingSGD's count of the last group, which rank 0 owns nothing of)."""
    from dist_fsdp_whole import same_weights, steps

    model, opt, ref_model, ref_opt = _fsdp_start(name)
    g = torch.Generator().manual_seed(20 + rank)
    with tiermem.offload(opt, small_cfg(tmp, backend=backend), name=name) as tm:
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        for i in range(2, 6):
            if i in (2, 3):
                _fsdp_add(model, opt, ref_model, ref_opt, name, i - 2)
                compare_state_dicts(_whole_sd(opt.state_dict()), ref_opt.state_dict(),
                                    exact=True)
            steps(rank, world, model, [opt], ref_model, [ref_opt], g, 1)
            same_weights(model, ref_model, f"rank {rank} step {i + 1}")
        compare_state_dicts(_whole_sd(opt.state_dict()), ref_opt.state_dict(), exact=True)
        plan = tm.plan()
        held = [p for grp in opt.param_groups for p in grp["params"]]
        assert sum(r["share_elements"] for r in plan["ranks"]) == sum(p.numel() for p in held)
        last = len(tm.layout.params) - len(opt.param_groups[-1]["params"])
        assert set(tm.layout.owner[last:]) == {1}, tm.layout.owner
    compare_state_dicts(_whole_sd(opt.state_dict()), ref_opt.state_dict(), exact=True)


def fsdp_crash_resume(rank: int, world: int, tmp: str) -> None:
    """crash_consistent Adafactor over fully_shard parameters, two groups added inside the
    block (each committed with its add), saved with tiermem.dist.dcp and kept on disk at
    exit: `tiermem recover` of one rank's directory gives the plain optimizer's state_dict
    and weights; a new run's optimizer built with every group resumes on every rank (the
    added parameters' owners as at the adds, their weights from the owners' masters) and
    goes on equal, as does a fresh run that loads the checkpoint."""
    from dist_fsdp_whole import model_pair, same_weights, steps
    from tiermem.dist import dcp

    model, opt, ref_model, ref_opt = _fsdp_start("adafactor")
    g = torch.Generator().manual_seed(40 + rank)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="crash") as tm:
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        for k in range(2):
            _fsdp_add(model, opt, ref_model, ref_opt, "adafactor", k)
            steps(rank, world, model, [opt], ref_model, [ref_opt], g, 1)
        dcp.save(tm, os.path.join(tmp, "ck"))
    assert not opt.state
    barrier()  # every rank's share kept
    _recovered_equal(tmp, rank, ref_model, ref_opt)
    for how in ("resume", "dcp"):
        fresh_model, _ = model_pair()  # the first weights: the resume must put them back
        if how == "dcp":
            with torch.no_grad():
                for p, q in zip(fresh_model.parameters(), model.parameters()):
                    p.to_local().copy_(q.to_local())
        first, rest = _fsdp_groups(fresh_model, "adafactor")
        fresh = _fsdp_opts()["adafactor"](first)
        for group, lr in zip(rest, LRS):
            fresh.add_param_group({"params": group, "lr": lr})
        r_model, r_opt = copy.deepcopy((ref_model, ref_opt))
        with tiermem.offload(fresh, cfg, model=fresh_model, name="crash" if how == "resume"
                             else "fresh", resume=how == "resume") as tm:
            if how == "dcp":
                dcp.load(tm, os.path.join(tmp, "ck"))
            else:
                assert tm.resumed_step == 4, tm.resumed_step
            same_weights(fresh_model, r_model, f"rank {rank} {how}")
            compare_state_dicts(_whole_sd(fresh.state_dict()), r_opt.state_dict(), exact=True)
            steps(rank, world, fresh_model, [fresh], r_model, [r_opt], g, 2)
        same_weights(fresh_model, r_model, f"rank {rank} {how}, on")
        compare_state_dicts(_whole_sd(fresh.state_dict()), r_opt.state_dict(), exact=True)
        barrier()


def fsdp_refusals(rank: int, world: int, tmp: str) -> None:
    """Over fully_shard parameters add_param_group is a collective, added on every rank or on
    none: a group with other settings, or other parameters, on one rank is refused on every
    rank naming what differs; a group one rank refuses (torch's check) is refused on the
    others naming that rank's reason; a rank stepping while another adds is named. Nothing
    is added anywhere, and the block goes on to add the group alike and step."""
    from dist_fsdp_whole import model_pair
    from tiermem.dist.collectives import RankMismatch
    from tiermem.errors import TierMemError

    model, _ = model_pair()
    opt = _fsdp_opts()["adafactor"]([model[0].weight])
    x = torch.randn(8, 61, generator=torch.Generator().manual_seed(rank))

    def refused(group: dict, *why: str, kind: type = TierMemError) -> None:
        try:
            opt.add_param_group(group)
        except kind as exc:
            assert all(w in str(exc) for w in why), (rank, exc)
        else:
            raise AssertionError(f"rank {rank}: not refused: {why}")
        assert len(opt.param_groups) == 1, rank
        assert len(tm.layout.params) == 1 and len(tm.shadow.param_groups) == 1, rank

    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        refused({"params": [model[2].weight], "lr": 5e-3 if rank == 0 else 1e-3},
                "the ranks' groups differ in 'lr' (rank 0: 0.005, rank 1: 0.001)",
                "not added on any rank")
        refused({"params": [model[2].weight] + ([model[2].bias] if rank else [])},
                "differ in the number of parameters (rank 0: 1, rank 1: 2)")
        refused({"params": [model[2].weight if rank == 0 else model[4].weight]},
                "differ in parameter 0's shape and dtype (rank 0: [33, 1031] torch.float32, "
                "rank 1: [1, 33] torch.float32)")
        # rank 1 adds a parameter already in a group: torch refuses it there
        if rank == 1:
            refused({"params": [model[0].weight]}, "more than one parameter group",
                    kind=ValueError)
        else:
            refused({"params": [model[2].weight]}, "rank 1 refused it (ValueError",
                    "not added on any rank")
        # the rule refuses it on every rank alike, before any collective
        refused({"params": [model[2].weight], "differentiable": True},
                "differentiable=True is not supported", kind=Exception)
        # this rank's shadow optimizer refuses it after the owners were chosen (its tiers
        # could not take it): the layout gives back what it took, owners' loads included
        lay = tm.layout
        before = (list(lay._load), lay.share_elements, set(lay.buffer), len(lay.spans))
        with mock.patch.object(tm.offloaded.tiers, "add", side_effect=OSError("no room")):
            refused({"params": [model[2].weight]}, "no room", kind=OSError)
        assert (list(lay._load), lay.share_elements, set(lay.buffer), len(lay.spans)) == \
            before, rank
        model(x).square().mean().backward()
        try:
            opt.step() if rank == 0 else opt.add_param_group({"params": [model[2].weight]})
        except RankMismatch as exc:
            assert "opt.add_param_group()" in str(exc) and "opt.step()" in str(exc), exc
        else:
            raise AssertionError("a step on one rank and an add on another went ahead")
        assert len(opt.param_groups) == 1, rank
        opt.add_param_group({"params": [model[2].weight]})
        opt.step()
        assert len(tm.layout.params) == 2
        # balanced on what the ranks own: rank 0 owns model[0].weight (61 x 1031)
        assert tm.layout.owner == [0, 1], tm.layout.owner
        tm.discard()


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {
        "zero-adafactor": lambda r, d: zero_added(r, world, d, "adafactor"),
        "zero-adafactor-allreduced-io_uring": lambda r, d: zero_added(
            r, world, d, "adafactor", "allreduced", "io_uring"),
        "zero-muon": lambda r, d: zero_added(r, world, d, "muon"),
        "zero-crash-resume": lambda r, d: zero_crash_resume(r, world, d),
        "zero-differs": lambda r, d: zero_differs(r, world, d),
        "fsdp-adafactor": lambda r, d: fsdp_added(r, world, d, "adafactor"),
        "fsdp-adafactor-io_uring": lambda r, d: fsdp_added(r, world, d, "adafactor",
                                                           "io_uring"),
        "fsdp-muon": lambda r, d: fsdp_added(r, world, d, "muon"),
        "fsdp-counting-sgd": lambda r, d: fsdp_added(r, world, d, "counting-sgd"),
        "fsdp-crash-resume": lambda r, d: fsdp_crash_resume(r, world, d),
        "fsdp-refusals": lambda r, d: fsdp_refusals(r, world, d),
    }
    return run_in_dirs(rank, base, table, names)
