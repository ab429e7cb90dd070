"""What each rank runs in tests/test_distributed_fsdp_generic.py: the generic path (a
third-party optimizer, or a subclass with a step of its own) over fully_shard (FSDP2)
parameters, each parameter stepped whole by one owner rank (dist/fsdp_whole.py); and the
generic path under a process group with torch.amp.GradScaler.

The reference on every rank is the plain optimizer on a plain copy of the model fed the
mean gradient (dist_scenarios.averaged): with 2 ranks FSDP2's mean is that one bitwise (a
sum of two; halving is exact), and the owner runs the optimizer's own step on the same
whole tensors, so weights, state and group values are compared bitwise.
"""

from __future__ import annotations

import copy
import os

import torch
from torch.distributed.tensor import DTensor, Shard

import tiermem
from tiermem.dist import dcp
from tiermem.errors import TierMemError
from tiermem.optim.rules import UnsupportedOptimizer

from dist_fsdp_whole import full, model_pair, same_weights, steps
from dist_generic import CountingSGD, LionLike, LossScaled, ScaledSGD
from dist_scenarios import averaged, barrier, groups_of, kept_at_exit, small_cfg
from offload_helpers import (Synthetic, compare_runs, compare_state_dicts, loss_of,
                             make_batches)


def groups(m: torch.nn.Module) -> list[dict]:
    """Two groups; the second holds the last layer's one-row weight, whose owner is rank 1
    (the owners are balanced by bytes, largest first), so rank 0 steps that group as an
    optimizer with no parameters and takes its values from rank 1."""
    return [{"params": [m[0].weight, m[0].bias, m[2].weight, m[2].bias, m[4].bias]},
            {"params": [m[4].weight], "lr": 5e-3}]


def _lion(ps):
    from lion_pytorch import Lion
    return Lion(ps, lr=1e-3, weight_decay=0.01)


def _lamb(ps):
    from pytorch_optimizer import Lamb
    return Lamb(ps, lr=1e-2, weight_decay=0.01)


def _adan(ps):
    from pytorch_optimizer import Adan
    return Adan(ps, lr=1e-2, weight_decay=0.01)


class OwnAdafactor(torch.optim.Adafactor):
    """torch's Adafactor with a step of its own: the generic path, not torch's rule."""

    @torch.no_grad()
    def step(self, closure=None):
        return super().step(closure)


def _schedulefree(ps):
    from schedulefree import AdamWScheduleFree
    return AdamWScheduleFree(ps, lr=1e-2, warmup_steps=2, weight_decay=0.01)


OPTS = {
    "lion": _lion,
    "lamb": _lamb,
    "adan": _adan,
    "schedulefree": _schedulefree,
    "counting-sgd": lambda ps: CountingSGD(ps, lr=1e-2, momentum=0.9),
    "lion-like": lambda ps: LionLike(ps, lr=1e-3, weight_decay=0.01),
    "adafactor-subclass": lambda ps: OwnAdafactor(ps, lr=1e-2, weight_decay=0.01),
    "scaled-sgd": lambda ps: ScaledSGD(ps, lr=1e-2, momentum=0.9),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01),  # not generic
}

# whose step runs on fully_shard parameters without tiermem, elementwise (bitwise as one
# process's): their state_dict under tiermem is compared with that one's, DTensor by DTensor
ELEMENTWISE = ("lion", "schedulefree", "counting-sgd")

MODULES = {"lion": "lion_pytorch", "lamb": "pytorch_optimizer", "adan": "pytorch_optimizer",
           "schedulefree": "schedulefree"}


def missing(name: str) -> str | None:
    """The PyPI package scenario `name` needs, if it is not installed."""
    import importlib.util

    module = next((m for k, m in MODULES.items() if k in name.split("-")), None)
    return module if module and importlib.util.find_spec(module) is None else None


def sharded(key: str, v, p) -> bool:
    """Whether state `key` of parameter `p` goes out sharded like it: a tensor of its shape
    (what the plain optimizer over fully_shard parameters makes, zeros_like(p)), but
    Adafactor's column statistics of a matrix, a reduction over its rows (replicated, as
    torch's Adafactor over fully_shard parameters gives them: dist_fsdp_whole), which has
    the shape of a one-row matrix."""
    return (isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(p.shape)
            and not (key == "col_var" and p.dim() == 2))


def same_sd(model, sd: dict, ref_sd: dict, what: str) -> None:
    """A state_dict of the FSDP2 model equals the plain one's: state tensors DTensors
    sharded like their parameter where `sharded` says so, every one compared whole; the
    group values too."""
    params = [p for g in sd["param_groups"] for p in g["params"]]
    by_index = dict(zip(params, [p for g in groups(model) for p in g["params"]]))
    whole = {"state": {}, "param_groups": sd["param_groups"]}
    for i, st in sd["state"].items():
        p = by_index[i]
        for k, v in st.items():
            if sharded(k, v, p):
                assert isinstance(v, DTensor) and tuple(v.placements) == (Shard(0),), \
                    (what, i, k, type(v), getattr(v, "placements", None))
        whole["state"][i] = {k: full(v) for k, v in st.items()}
    compare_state_dicts(whole, ref_sd, exact=True)


def same_opt_state(model, opt, ref_model, ref_opt, what: str) -> None:
    """opt.state after the block (DTensors like FSDP2's) equals the plain one's."""
    for p, q in zip(model.parameters(), ref_model.parameters()):
        st, sr = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert set(st) == set(sr), (what, set(st), set(sr))
        for k, v in sr.items():
            got = st[k]
            if sharded(k, v, q):
                assert isinstance(got, DTensor) and tuple(got.placements) == (Shard(0),), \
                    (what, k, type(got))
            if isinstance(v, torch.Tensor):
                assert torch.equal(full(got), v), (what, k)
            else:
                assert got == v, (what, k, got, v)
    for a, b in zip(opt.param_groups, ref_opt.param_groups):
        assert {k: v for k, v in a.items() if k != "params"} == \
            {k: v for k, v in b.items() if k != "params"}, what


def like_plain_fsdp2(rank: int, world: int, name: str, sd: dict, n: int) -> None:
    """`sd` is what the plain optimizer over fully_shard parameters (no tiermem) holds after
    the same `n` steps: the same keys, DTensors where it has DTensors, placed and shaped
    as its, with the same local shards. Only for optimizers whose math is elementwise
    (their step runs on DTensors, and a sharded norm would round otherwise)."""
    model, _ = model_pair()
    opt = OPTS[name](groups(model))
    g = torch.Generator().manual_seed(20 + rank)
    if callable(getattr(type(opt), "train", None)):
        opt.train()
    for _ in range(n):
        x, y = torch.randn(8, 61, generator=g), torch.randn(8, 1, generator=g)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    want = opt.state_dict()
    assert set(sd["state"]) == set(want["state"]), (set(sd["state"]), set(want["state"]))
    for i, sw in want["state"].items():
        st = sd["state"][i]
        assert set(st) == set(sw), (i, set(st), set(sw))
        for k, w in sw.items():
            got = st[k]
            assert type(got) is type(w), (i, k, type(got), type(w))
            if isinstance(w, DTensor):
                assert got.placements == w.placements and got.shape == w.shape, (i, k)
                assert torch.equal(got.to_local(), w.to_local()), (rank, name, i, k)
            elif isinstance(w, torch.Tensor):
                assert torch.equal(got, w), (rank, name, i, k)
            else:
                assert got == w, (rank, name, i, k, got, w)
    for a, b in zip(sd["param_groups"], want["param_groups"]):
        assert a == b, (a, b)


def parity(rank: int, world: int, tmp: str, name: str, durability: str = "scratch") -> None:
    """Weights after every step equal the plain optimizer's on the full model fed the mean
    gradient; state_dict() inside the block (DTensors like FSDP2's; the values the step
    keeps in the groups: pytorch-optimizer's step counts, schedule-free's k, CountingSGD's
    count of a group rank 0 owns nothing of) equals torch's, and loading it back steps on
    equal; weights edited between steps are taken, by the step and by schedule-free's
    eval()/train() (which read the weights); at exit opt.state holds DTensors like
    FSDP2's; a second block seeded from them goes on equal. crash_consistent keeps fp32
    masters of the owners' buffers: an edit reaches them as in one process."""
    model, ref_model = model_pair()
    opt, ref_opt = OPTS[name](groups(model)), OPTS[name](groups(ref_model))
    modes = callable(getattr(type(opt), "train", None))
    g = torch.Generator().manual_seed(20 + rank)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = durability
    with tiermem.offload(opt, cfg, name=name) as tm:
        plan = tm.plan()
        assert plan["mode"] == "fsdp2"
        # each parameter whole on one rank: the shares cover the parameters once
        assert sum(r["share_elements"] for r in plan["ranks"]) == \
            sum(p.numel() for p in model.parameters())
        assert plan["state_bytes"]["nvme"] > 0 or rank == 1, plan["state_bytes"]
        assert tm.layout.owner[5] == 1  # param_groups[1]'s one parameter: see groups()
        if modes:
            opt.train()
            ref_opt.train()
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        same_weights(model, ref_model, f"rank {rank} {name}")
        sd = opt.state_dict()
        same_sd(model, sd, ref_opt.state_dict(), f"rank {rank} {name} state_dict")
        if name in ELEMENTWISE:
            like_plain_fsdp2(rank, world, name, sd, 2)
        if modes:
            opt.eval()
            ref_opt.eval()
            same_weights(model, ref_model, f"rank {rank} {name} eval()")
            opt.train()
            ref_opt.train()
            same_weights(model, ref_model, f"rank {rank} {name} train()")
        opt.load_state_dict(sd)
        with torch.no_grad():  # an edit between steps is taken, as in one process
            model[2].weight.to_local().mul_(0.5)
            ref_model[2].weight.mul_(0.5)
        if modes:  # eval() reads the edited weights, not the owner's buffer of the last step
            opt.eval()
            ref_opt.eval()
            same_weights(model, ref_model, f"rank {rank} {name} eval() after an edit")
            opt.train()
            ref_opt.train()
        if name == "counting-sgd":
            opt.scale = ref_opt.scale = 0.5  # a setting on the optimizer, changed
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        same_weights(model, ref_model, f"rank {rank} {name} after load")
        same_sd(model, opt.state_dict(), ref_opt.state_dict(), f"rank {rank} {name} on")
    same_opt_state(model, opt, ref_model, ref_opt, f"rank {rank} {name} exit")
    if name == "counting-sgd":
        assert opt.calls == ref_opt.calls == 4, (opt.calls, ref_opt.calls)
    with tiermem.offload(opt, cfg, name=name + "2"):
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 1)
    same_weights(model, ref_model, f"rank {rank} {name} second block")
    same_opt_state(model, opt, ref_model, ref_opt, f"rank {rank} {name} second block")


def closure(rank: int, world: int, tmp: str) -> None:
    """step(closure): evaluated once, stepped on the mean gradient; an optimizer that reads
    the loss is refused on every rank before anything moves (each rank's closure returns
    its own batch's loss)."""
    model, ref_model = model_pair()
    opt, ref_opt = OPTS["lion-like"](groups(model)), OPTS["lion-like"](groups(ref_model))
    g = torch.Generator().manual_seed(60 + rank)
    with tiermem.offload(opt, small_cfg(tmp)):
        for i in range(2):
            x, y = torch.randn(8, 61, generator=g), torch.randn(8, 1, generator=g)

            def fn():
                (model(x) - y).square().mean().backward()
                return torch.tensor(float(i))

            def ref_fn():
                (ref_model(x) - y).square().mean().backward()
                averaged(ref_model, world)
                return torch.tensor(float(i))
            assert float(opt.step(fn)) == float(ref_opt.step(ref_fn)) == i
            opt.zero_grad()
            ref_opt.zero_grad()
            same_weights(model, ref_model, f"rank {rank} closure step {i}")
    model, _ = model_pair()
    opt = LossScaled(groups(model), lr=1e-3)
    before = [p.full_tensor() for p in model.parameters()]
    with tiermem.offload(opt, small_cfg(tmp), name="loss"):
        x = torch.randn(8, 61, generator=g)
        try:
            opt.step(lambda: model(x).square().mean())
        except UnsupportedOptimizer as exc:
            assert "uses the loss its closure returns" in str(exc), exc
        else:
            raise AssertionError("a loss-reading step(closure) over fully_shard ran")
        assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
        opt.zero_grad()


def crash_resume(rank: int, world: int, tmp: str, name: str) -> None:
    """crash_consistent, each rank's share kept on disk at exit: a new process's optimizer
    resumes on every rank (each owner's whole parameters from its masters, scattered into
    the shards; the values the step keeps from each group's owner) and goes on equal;
    `tiermem recover` of one rank's directory gives the plain optimizer's state_dict (whole
    tensors, the group values of each group's owner) and weights."""
    from tiermem.swap.recover import gather

    model, ref_model = model_pair()
    opt, ref_opt = OPTS[name](groups(model)), OPTS[name](groups(ref_model))
    modes = callable(getattr(type(opt), "train", None))
    g = torch.Generator().manual_seed(40 + rank)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="crash"):
        if modes:
            opt.train()
            ref_opt.train()
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
    assert not opt.state
    barrier()  # every rank's share kept: `tiermem recover` puts the whole parameters together
    got = gather(os.path.join(tmp, f"tiermem-crash-rank{rank}"))
    assert got["step"] == 2, got["step"]
    compare_state_dicts(got["optimizer"], ref_opt.state_dict(), exact=True)
    for k, v in ref_model.state_dict().items():
        assert torch.equal(got["model"][k], v), f"recovered {k}"
    with torch.no_grad():  # the resume must put the committed weights back
        for p in model.parameters():
            p.to_local().zero_()
    fresh = OPTS[name](groups(model))  # a new process's: the values come from the disk
    with tiermem.offload(fresh, cfg, model=model, name="crash", resume=True) as tm:
        assert tm.resumed_step == 2, tm.resumed_step
        same_weights(model, ref_model, f"rank {rank} resumed")
        same_sd(model, fresh.state_dict(), ref_opt.state_dict(), f"rank {rank} resumed")
        steps(rank, world, model, [fresh], ref_model, [ref_opt], g, 2)
        same_sd(model, fresh.state_dict(), ref_opt.state_dict(), f"rank {rank} resumed, on")
    same_weights(model, ref_model, f"rank {rank}")
    same_opt_state(model, fresh, ref_model, ref_opt, f"rank {rank} after resume")


class _Stop(Exception):
    pass


def resume_one_step_apart(rank: int, world: int, tmp: str, name: str) -> None:
    """Crash-consistent ranks one step apart, as a crash between two ranks' commits of step
    3 leaves them (made here by the last rank's manifest going back to its previous
    commit): the resume takes every rank back to step 2, the owners' weights scattered
    into the shards of a new model and the group values (CountingSGD's count of
    param_groups[1], which rank 1 owns) from each group's owner, bitwise, and training
    goes on equal to the reference. torch's Adafactor too (the whole-parameter rule, not
    the generic path): the rank going back rebuilt its share with a collective in it
    (the gather of DTensor state to the owners) that the other rank never entered."""
    from tiermem.swap.manifest import read_manifest

    model, _ = model_pair()
    opt = OPTS[name](groups(model))
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    g = torch.Generator().manual_seed(80 + rank)
    batches = [(torch.randn(8, 61, generator=g), torch.randn(8, 1, generator=g))
               for _ in range(5)]

    def train(model, opt, first, n, ref=False):
        for x, y in batches[first:first + n]:
            (model(x) - y).square().mean().backward()
            if ref:
                averaged(model, world)
            opt.step()
            opt.zero_grad()
    try:
        with tiermem.offload(opt, cfg, model=model, name="apart"):
            train(model, opt, 0, 3)
            raise _Stop()  # every rank keeps its share on disk
    except _Stop:
        pass
    run_dir = os.path.join(tmp, f"tiermem-apart-rank{rank}")
    assert read_manifest(run_dir, None).step == 3
    if rank == world - 1:
        os.replace(os.path.join(run_dir, "manifest.previous.json"),
                   os.path.join(run_dir, "manifest.json"))
    barrier()
    _, ref_model = model_pair()
    ref_opt = OPTS[name](groups(ref_model))
    train(ref_model, ref_opt, 0, 2, ref=True)
    model, _ = model_pair()  # the first weights: the resume puts step 2's back
    opt = OPTS[name](groups(model))
    with tiermem.offload(opt, cfg, model=model, name="apart", resume=True) as tm:
        assert tm.resumed_step == 2, tm.resumed_step
        same_weights(model, ref_model, f"rank {rank} step 2")
        same_sd(model, opt.state_dict(), ref_opt.state_dict(), f"rank {rank} step 2")
        train(model, opt, 2, 2)
        train(ref_model, ref_opt, 2, 2, ref=True)
        same_sd(model, opt.state_dict(), ref_opt.state_dict(), f"rank {rank} step 4")
    same_weights(model, ref_model, f"rank {rank} step 4")


def dcp_roundtrip(rank: int, world: int, tmp: str, name: str) -> None:
    """tiermem.dist.dcp.save of the owners' whole state at step 2; a new optimizer over the
    model (its weights at that step) loads it on 2 ranks, takes the group values (counts)
    from it, and steps on as the uninterrupted plain optimizer."""
    model, ref_model = model_pair()
    opt, ref_opt = OPTS[name](groups(model)), OPTS[name](groups(ref_model))
    g = torch.Generator().manual_seed(50 + rank)
    ckpt = os.path.join(tmp, "ckpt")
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a"))) as tm:
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        dcp.save(tm, ckpt)
    opt2 = OPTS[name](groups(model))
    with tiermem.offload(opt2, small_cfg(os.path.join(tmp, "b"))) as tm:
        dcp.load(tm, ckpt)
        same_sd(model, opt2.state_dict(), ref_opt.state_dict(), f"rank {rank} loaded")
        steps(rank, world, model, [opt2], ref_model, [ref_opt], g, 2)
        same_sd(model, opt2.state_dict(), ref_opt.state_dict(), f"rank {rank} loaded, on")
    same_weights(model, ref_model, f"rank {rank} after load")


def dcp_helpers(rank: int, world: int, tmp: str, name: str) -> None:
    """torchtitan's checkpoint of an FSDP2 model: get_state_dict into torch's dcp.save (the
    state as DTensors); a new run's template from get_state_dict (torch's lr-0 step on a
    never-stepped optimizer: a collective here), filled by dcp.load and handed to
    set_state_dict, goes on equal."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, ref_model = model_pair()
    opt, ref_opt = OPTS[name](groups(model)), OPTS[name](groups(ref_model))
    g = torch.Generator().manual_seed(70 + rank)
    ck = os.path.join(tmp, "ck")
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a"))):
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        model_sd, optim_sd = get_state_dict(model, opt)
        tdcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ck)
    model, _ = model_pair()  # the first weights: the checkpoint's must replace them
    opt = OPTS[name](groups(model))
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "b"))):
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        tdcp.load(sd, checkpoint_id=ck)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        same_weights(model, ref_model, f"rank {rank} loaded")
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 1)
        same_sd(model, opt.state_dict(), ref_opt.state_dict(), f"rank {rank} on")
    same_weights(model, ref_model, f"rank {rank}")
    same_opt_state(model, opt, ref_model, ref_opt, f"rank {rank}")


def refusals(rank: int, world: int, tmp: str) -> None:
    """What stays refused over fully_shard parameters, on every rank, naming what to do:
    state under a key that is no parameter, GradScaler (each rank's sees only its own
    gradient shards). (add_param_group inside the block works: tests/dist_addgroup.py.)"""
    model, _ = model_pair()
    opt = LionLike(groups(model))
    opt.state["k"] = torch.tensor(0)
    try:
        with tiermem.offload(opt, small_cfg(tmp), name="loose"):
            pass
    except UnsupportedOptimizer as exc:
        assert "it keeps state under 'k', a key that is no parameter" in str(exc), exc
    else:
        raise AssertionError("state under a key that is no parameter was tiered")

    opt = OPTS["lion-like"](groups(model))
    d = os.path.join(tmp, "amp")  # a failed exit keeps the share here
    os.makedirs(d, mode=0o700, exist_ok=True)
    try:
        with tiermem.offload(opt, small_cfg(d), name="amp"):
            scaler = torch.amp.GradScaler("cpu")
            x = torch.randn(8, 61, generator=torch.Generator().manual_seed(rank))
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
    except TierMemError as exc:
        assert "GradScaler" in str(exc) and "fully_shard parameters" in str(exc), exc
    else:
        raise AssertionError(f"rank {rank}: GradScaler over fully_shard parameters was taken")


def gradscaler(rank: int, world: int, tmp: str, name: str) -> None:
    """The generic path under a process group with DDP's all-reduced gradients
    (distributed.grads: allreduced) and torch.amp.GradScaler: an optimizer without
    _step_supports_amp_scaling is unscaled by GradScaler itself in p.grad (the mean, alike
    on every rank) and its step skipped by GradScaler on every rank alike (rank 0's inf
    reaches every rank through the all-reduce); equal to the plain run, bitwise, skipped
    steps (the first, before any state, and a later one) included, and steps the user
    unscales first to clip. One that sets it
    (scaled-sgd) is refused at the step on every rank, naming the way out: the flag set
    False on it, after which it runs as the others."""
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = OPTS[name](groups_of(model)), OPTS[name](groups_of(ref_model))
    if getattr(opt, "_step_supports_amp_scaling", False):
        before = [p.detach().clone() for p in model.parameters()]
        d = os.path.join(tmp, "own")  # a failed exit keeps the share here
        os.makedirs(d, mode=0o700, exist_ok=True)
        try:
            with tiermem.offload(opt, small_cfg(d, grads="allreduced"), model=model):
                scaler = torch.amp.GradScaler("cpu", init_scale=1000.0)
                tokens, target = make_batches(model, 1, seed=10 + rank)[0][0]
                scaler.scale(loss_of(model, tokens, target, False)).backward()
                averaged(model, world)
                scaler.step(opt)
        except TierMemError as exc:
            assert "_step_supports_amp_scaling = False" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: an optimizer's own GradScaler handling ran")
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt = OPTS[name](groups_of(model))
        for o in (opt, ref_opt):
            o.zero_grad()
            o._step_supports_amp_scaling = False
    batches = make_batches(model, 4, seed=10 + rank)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1000.0) for _ in range(2)]
    with tiermem.offload(opt, small_cfg(tmp, grads="allreduced"), model=model):
        if callable(getattr(type(opt), "train", None)):
            opt.train()
            ref_opt.train()
        for i, micro in enumerate(batches):
            for m, o, scaler in ((model, opt, scalers[0]), (ref_model, ref_opt, scalers[1])):
                for tokens, target in micro:
                    loss = loss_of(m, tokens, target, False)
                    scaler.scale(loss * float("inf") if i in (0, 2) and rank == 0
                                 else loss).backward()
                averaged(m, world)  # DDP's all-reduce
                if i in (1, 2):  # unscaled by the user, to clip (an inf step too)
                    scaler.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                scaler.step(o)
                scaler.update()
                o.zero_grad()
            compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        assert opt.state_dict()["state"], "no step was taken"
    assert scalers[0].get_scale() == scalers[1].get_scale() < 1000.0
    compare_runs(model, opt, ref_model, ref_opt, exact=True)
    compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
    barrier()


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {
        "lion": lambda r, d: parity(r, world, d, "lion"),
        "lamb": lambda r, d: parity(r, world, d, "lamb"),
        "adan": lambda r, d: parity(r, world, d, "adan"),
        "schedulefree": lambda r, d: parity(r, world, d, "schedulefree"),
        "counting-sgd": lambda r, d: parity(r, world, d, "counting-sgd"),
        "adafactor-subclass": lambda r, d: parity(r, world, d, "adafactor-subclass"),
        "schedulefree-crash-consistent": lambda r, d: parity(r, world, d, "schedulefree",
                                                             "crash_consistent"),
        "closure": lambda r, d: closure(r, world, d),
        "crash-resume-schedulefree": lambda r, d: crash_resume(r, world, d, "schedulefree"),
        "crash-resume-counting-sgd": lambda r, d: crash_resume(r, world, d, "counting-sgd"),
        "dcp-counting-sgd": lambda r, d: dcp_roundtrip(r, world, d, "counting-sgd"),
        "resume-one-step-apart": lambda r, d: resume_one_step_apart(r, world, d,
                                                                    "counting-sgd"),
        "resume-one-step-apart-adafactor": lambda r, d: resume_one_step_apart(
            r, world, d, "adafactor"),
        "dcp-helpers-lion": lambda r, d: dcp_helpers(r, world, d, "lion"),
        "dcp-helpers-counting-sgd": lambda r, d: dcp_helpers(r, world, d, "counting-sgd"),
        "refusals": lambda r, d: refusals(r, world, d),
        "gradscaler-allreduced-lion": lambda r, d: gradscaler(r, world, d, "lion"),
        "gradscaler-allreduced-counting-sgd": lambda r, d: gradscaler(r, world, d,
                                                                      "counting-sgd"),
        "gradscaler-allreduced-own-scaling": lambda r, d: gradscaler(r, world, d,
                                                                     "scaled-sgd"),
    }
    return run_in_dirs(rank, base, table, names)
