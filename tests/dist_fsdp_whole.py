"""What each rank runs in tests/test_distributed_fsdp_whole.py: torch's Adafactor and Muon
over fully_shard (FSDP2) parameters, each parameter stepped whole by one owner rank.

torch's own Adafactor and Muon do not run on DTensors (in-place ops on partial norms), so
the reference on every rank is the plain optimizer on a plain copy of the model fed the
mean gradient (dist_scenarios.averaged). With 2 ranks FSDP2's mean is that one bitwise
(a sum of two; halving is exact), and the owner runs torch's own kernel on the same whole
tensors: weights and state are compared bitwise.
"""

from __future__ import annotations

import copy
import os

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import tiermem

from dist_scenarios import averaged, barrier, kept_at_exit, small_cfg
from offload_helpers import assert_same_tensor


def model_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """1031 rows over 2 ranks (uneven shards) and a last layer of one row (rank 1's shard
    of it is empty)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(61, 1031), torch.nn.Tanh(),
                                torch.nn.Linear(1031, 33), torch.nn.Tanh(),
                                torch.nn.Linear(33, 1))
    ref = copy.deepcopy(model)
    for layer in (model[0], model[2], model[4], model):
        fully_shard(layer)
    return model, ref


def matrices(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in m.parameters() if p.dim() == 2]


def others(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in m.parameters() if p.dim() != 2]


OPTS = {
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01),
    "muon": lambda ps: torch.optim.Muon(ps, lr=2e-2, weight_decay=0.01),
}


def full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def same_state(model, opt, ref_model, ref_opt, what: str) -> None:
    """opt.state (DTensors, FSDP2's form) equals the plain optimizer's whole state."""
    for p, q in zip(model.parameters(), ref_model.parameters()):
        st, sr = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert set(st) == set(sr), (what, set(st), set(sr))
        for k, v in sr.items():
            got = st[k]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert isinstance(got, DTensor), (what, k, type(got))
                # the parameter's rows sharded as it is; a matrix's column statistics are
                # a reduction over its rows: replicated
                want = Replicate() if k == "col_var" and p.dim() == 2 else Shard(0)
                assert tuple(got.placements) == (want,), (what, k, got.placements)
            assert_same_tensor(full(got).float(), v.float(), f"{what} state {k}")


def same_weights(model, ref_model, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_same_tensor(p.full_tensor().detach(), q.detach(), f"{what} {n}")


def steps(rank, world, model, opts, ref_model, ref_opts, g, n) -> None:
    for _ in range(n):
        x, y = torch.randn(8, 61, generator=g), torch.randn(8, 1, generator=g)
        (model(x) - y).square().mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        (ref_model(x) - y).square().mean().backward()
        averaged(ref_model, world)
        for o in ref_opts:
            o.step()
            o.zero_grad()


def parity(rank: int, world: int, tmp: str, name: str, backend: str = "threads") -> None:
    """Weights after every step and state_dict() inside the block equal the plain
    optimizer's; loading that state_dict back steps on equal; at exit opt.state holds
    DTensors like FSDP2's; a second block seeded from them (a collective gather of each
    DTensor entry to its owner) goes on equal; weights edited between steps are taken.
    Muon is paired with AdamW for the non-matrices, as users do: two blocks, one per
    optimizer."""
    model, ref_model = model_pair()
    params = matrices if name == "muon" else (lambda m: list(m.parameters()))
    opt, ref_opt = OPTS[name](params(model)), OPTS[name](params(ref_model))
    opts, ref_opts = [opt], [ref_opt]
    if name == "muon":
        opts.append(torch.optim.AdamW(others(model), lr=1e-2, foreach=False))
        ref_opts.append(torch.optim.AdamW(others(ref_model), lr=1e-2, foreach=False))
    g = torch.Generator().manual_seed(20 + rank)
    cfg = small_cfg(tmp, backend=backend)
    with tiermem.offload(opt, cfg, name=name) as tm:
        extra = (tiermem.offload(opts[1], small_cfg(tmp), name="adamw")
                 if name == "muon" else None)
        if extra is not None:
            extra.__enter__()
        try:
            assert tm.plan()["mode"] == "fsdp2"
            # each parameter whole on one rank: the shares cover the parameters once
            held = params(model)
            assert sum(r["share_elements"] for r in tm.plan()["ranks"]) == \
                sum(p.numel() for p in held)
            steps(rank, world, model, opts, ref_model, ref_opts, g, 2)
            same_weights(model, ref_model, f"rank {rank}")
            sd = opt.state_dict()
            ref_sd = ref_opt.state_dict()
            assert set(sd["state"]) == set(ref_sd["state"])
            for k, st in ref_sd["state"].items():
                for key, v in st.items():
                    assert_same_tensor(full(sd["state"][k][key]).float(), v.float(),
                                        f"state_dict {k} {key}")
            opt.load_state_dict(sd)
            with torch.no_grad():  # an edit between steps is taken, as in one process
                model[2].weight.to_local().mul_(0.5)
                ref_model[2].weight.mul_(0.5)
            steps(rank, world, model, opts, ref_model, ref_opts, g, 2)
            same_weights(model, ref_model, f"rank {rank} after load")
        finally:
            if extra is not None:
                extra.__exit__(None, None, None)
    same_state(model, opt, ref_model, ref_opt, f"rank {rank} exit")
    with tiermem.offload(opt, cfg, name=name + "2"):
        steps(rank, world, model, opts, ref_model, ref_opts, g, 1)
    same_weights(model, ref_model, f"rank {rank} second block")
    same_state(model, opt, ref_model, ref_opt, f"rank {rank} second block")


def owns_nothing(rank: int, world: int, tmp: str) -> None:
    """Muon over one parameter of one row: rank 0 owns it, rank 1 owns nothing and holds an
    empty shard of it; a state_dict of whole tensors (one process's) loads."""
    model, ref_model = model_pair()
    opt = OPTS["muon"]([model[4].weight])
    ref_opt = OPTS["muon"]([ref_model[4].weight])
    g = torch.Generator().manual_seed(30 + rank)
    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        assert tm.plan()["share_elements"] == (33 if rank == 0 else 0)
        assert model[4].weight.to_local().numel() == (33 if rank == 0 else 0)
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 1)
        earlier = copy.deepcopy(ref_opt.state_dict())  # whole tensors, as one process saves
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        opt.load_state_dict(earlier)  # the owner takes the whole entry as it is
        ref_opt.load_state_dict(earlier)
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 1)
    same_weights(model, ref_model, f"rank {rank}")
    same_state(model, opt, ref_model, ref_opt, f"rank {rank}")


def crash_resume(rank: int, world: int, tmp: str) -> None:
    """crash_consistent Adafactor kept on disk at exit: `tiermem recover` of one rank's
    directory gives the plain optimizer's state_dict and weights; the run resumes on every
    rank (each owner's whole parameters from its masters, scattered into the shards) and
    goes on equal."""
    from tiermem.swap.recover import gather

    model, ref_model = model_pair()
    opt = OPTS["adafactor"](list(model.parameters()))
    ref_opt = OPTS["adafactor"](list(ref_model.parameters()))
    g = torch.Generator().manual_seed(40 + rank)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="crash"):
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
    assert not opt.state
    barrier()  # every rank's share kept: `tiermem recover` puts the whole parameters together
    got = gather(os.path.join(tmp, f"tiermem-crash-rank{rank}"))
    assert got["step"] == 2
    want = ref_opt.state_dict()
    assert set(got["optimizer"]["state"]) == set(want["state"])
    for k, st in want["state"].items():
        for key, v in st.items():
            assert_same_tensor(got["optimizer"]["state"][k][key].float(), v.float(),
                                f"recovered {k} {key}")
    for k, v in ref_model.state_dict().items():
        assert_same_tensor(got["model"][k], v, f"recovered {k}")
    with torch.no_grad():  # the resume must put the committed weights back
        for p in model.parameters():
            p.to_local().zero_()
    with tiermem.offload(opt, cfg, model=model, name="crash", resume=True) as tm:
        assert tm.resumed_step == 2, tm.resumed_step
        same_weights(model, ref_model, f"rank {rank} resumed")
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
    same_weights(model, ref_model, f"rank {rank}")
    same_state(model, opt, ref_model, ref_opt, f"rank {rank}")


def dcp_helpers(rank: int, world: int, tmp: str) -> None:
    """torchtitan's checkpoint of an FSDP2 model: get_state_dict into torch's dcp.save (the
    state as DTensors, Adafactor's column statistics replicated); a new run's template from
    get_state_dict (torch's lr-0 step on a never-stepped optimizer: a collective here),
    filled by dcp.load and handed to set_state_dict, goes on equal."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, ref_model = model_pair()
    mk = OPTS["adafactor"]
    opt, ref_opt = mk(list(model.parameters())), mk(list(ref_model.parameters()))
    g = torch.Generator().manual_seed(50 + rank)
    ck = os.path.join(tmp, "ck")
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a"))):
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 2)
        model_sd, optim_sd = get_state_dict(model, opt)
        tdcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ck)
    model, _ = model_pair()  # the first weights: the checkpoint's must replace them
    opt = mk(list(model.parameters()))
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "b"))):
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        tdcp.load(sd, checkpoint_id=ck)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        same_weights(model, ref_model, f"rank {rank} loaded")
        steps(rank, world, model, [opt], ref_model, [ref_opt], g, 1)
    same_weights(model, ref_model, f"rank {rank}")
    same_state(model, opt, ref_model, ref_opt, f"rank {rank}")


def refusals(rank: int, world: int, tmp: str) -> None:
    """A step without gradients moves nothing; a load of DTensor state that is not the same
    on every rank is refused on every rank (its owner gathers each entry from every rank's
    shards), and so is a load on one rank while another steps. (add_param_group inside the
    block: tests/dist_addgroup.py.)"""
    from tiermem.dist.collectives import RankMismatch
    from tiermem.errors import TierMemError

    model, _ = model_pair()
    opt = OPTS["adafactor"]([model[0].weight])
    with tiermem.offload(opt, small_cfg(tmp)):
        before = model[0].weight.full_tensor()
        opt.step()  # no gradient on any rank: nothing moves, as in the plain optimizer
        assert torch.equal(model[0].weight.full_tensor(), before)
        x = torch.randn(8, 61, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        opt.step()
        sd = opt.state_dict()
        good = copy.copy(sd)
        sd = {**sd, "state": {k: dict(v) for k, v in sd["state"].items()}}
        if rank == 1:  # another state on one rank: its owner could not gather the entry
            del sd["state"][0]["row_var"]
        try:
            opt.load_state_dict(sd)
        except TierMemError as exc:
            assert "DTensor entries for other parameters or keys on different ranks" in \
                str(exc), exc
        else:
            raise AssertionError("a state_dict that differs between ranks was loaded")
        # a load is a collective here: a rank stepping meanwhile is named, not paired with
        try:
            opt.load_state_dict(good) if rank == 0 else opt.step()
        except RankMismatch as exc:
            assert "opt.load_state_dict()" in str(exc) and "opt.step()" in str(exc), exc
        else:
            raise AssertionError("a load on one rank and a step on another went ahead")


def other_group(rank: int, world: int, tmp: str) -> None:
    """process_group= other than the FSDP2 mesh's: the owners' gathers would run over ranks
    that do not hold the shards; refused, naming the ranks."""
    import torch.distributed as dist
    from tiermem.errors import TierMemError

    model, _ = model_pair()
    group = dist.new_group([0])  # every rank creates it; rank 0 alone is in it
    if rank != 0:
        return
    opt = OPTS["adafactor"](list(model.parameters()))
    try:
        with tiermem.offload(opt, small_cfg(tmp), process_group=group):
            pass
    except TierMemError as exc:
        assert "pass the FSDP2 mesh's group as process_group=" in str(exc), exc
    else:
        raise AssertionError("a process group other than the mesh's was taken")


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {
        "adafactor": lambda r, d: parity(r, world, d, "adafactor"),
        "adafactor-io_uring": lambda r, d: parity(r, world, d, "adafactor",
                                                   backend="io_uring"),
        "muon": lambda r, d: parity(r, world, d, "muon"),
        "owns-nothing": lambda r, d: owns_nothing(r, world, d),
        "crash-resume": lambda r, d: crash_resume(r, world, d),
        "dcp-helpers": lambda r, d: dcp_helpers(r, world, d),
        "refusals": lambda r, d: refusals(r, world, d),
        "other-group": lambda r, d: other_group(r, world, d),
    }
    return run_in_dirs(rank, base, table, names)
