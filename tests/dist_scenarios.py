"""What each rank runs in the distributed tests (imported by the spawned processes).

The reference on every rank is a plain torch optimizer on a copy of the model, fed
the same local batches, whose gradients are averaged with an all-reduce: one
process's AdamW on the global batch's mean gradient. tiermem's run on the same
rank must match it (bitwise with 2 ranks, where a sum of two does not depend on
the order; within assert_close_tensor with 3).
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from typing import Iterator

import torch
import torch.distributed as dist

import tiermem
from tiermem.dist.collectives import PeerError
from tiermem.swap.manifest import read_manifest

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
           ddp: bool = False, amsgrad: bool = False, lanes: str | None = None,
           step_device: str = "cpu") -> None:
    """lanes (a step_device): the model counts as a device one (streams=DeferredBackend())
    and its updated weights reach it through emulated streams, which run their work only
    when something waits for it: the weight all-gather must wait for them first."""
    streams = None
    if lanes:
        from tiermem.device.lanes import DeferredBackend
        streams, step_device = DeferredBackend(), lanes
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    check = assert_same_tensor if world == 2 and not ddp else assert_close_tensor
    # Over 3 ranks (or under DDP) the mean gradient is summed in another order than the
    # reference's all_reduce (a ring's order follows the bucket cuts), so an element whose
    # ranks' gradients cancel differs by an ulp of the terms, ~1e-9; Adam's step,
    # lr*g/(|g|+eps), moves by up to lr*1e-9/eps there: 1e-3 at eps 1e-8, well past the
    # tolerance, 1e-7 at 1e-4. Bitwise runs keep torch's default.
    eps = 1e-8 if check is assert_same_tensor else 1e-4
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.05, amsgrad=amsgrad,
                            eps=eps, foreach=False)
    ref_opt = torch.optim.AdamW(groups_of(ref_model), lr=1e-2, weight_decay=0.05,
                                amsgrad=amsgrad, eps=eps, foreach=False)
    batches = make_batches(model, STEPS, seed=10 + rank)
    # find_unused_parameters: the side branch is unused in some steps (else DDP never syncs).
    net = (torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
           if ddp else model)
    cfg = config(tmp, backend=backend, host=host, partition_size="64KiB")
    cfg["distributed"] = {"grads": grads, "bucket_size": "32KiB", "timeout": 120}
    cfg["optimizer"]["step_device"] = step_device
    with tiermem.offload(opt, cfg, model=model, streams=streams) as tm:
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
    # The weight all-gather starts during the update: with several partitions and windows
    # per share, some window is launched before the last partition is updated.
    assert all(s["windows_early"] > 0 for s in stats), [s["windows_early"] for s in stats]
    # At exit every rank holds the whole state again, as the plain optimizer does.
    compare_runs(model, opt, ref_model, ref_opt, exact=check is assert_same_tensor)


def int8_parity(rank: int, world: int, tmp: str, master: str = "fp32",
                rounding: str = "nearest", moments: str = "int8") -> None:
    """optimizer.state_dtype int8 on shares: quantisation blocks sit at multiples of 256
    elements of each parameter (shares are cut on CUT_ALIGN) and stochastic rounding draws
    from the stream of (step, the user's parameter) at the element's place in it, so each
    rank's run equals the plain-torch int8 reference on whole parameters fed the mean
    gradient, bit for bit, whatever the rounding. master kahan/none: a bf16 model whose
    shares of weights (and Kahan terms) are updated by their owner and gathered, with
    `moments` int8, fp32 or bf16 (the same streams)."""
    from test_state_int8 import ReferenceInt8Adam, hyper

    model = Synthetic() if master == "fp32" else Synthetic().to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.05, foreach=False)
    groups = groups_of(ref_model)
    firsts = [sum(len(g["params"]) for g in groups[:k]) for k in range(len(groups))]
    refs = [ReferenceInt8Adam(g["params"], hyper(lr=g.get("lr", 1e-2), weight_decay=0.05),
                              rounding=rounding, master_weights=master, first=first,
                              moments=moments)
            for g, first in zip(groups, firsts)]
    batches = make_batches(model, STEPS, seed=10 + rank)
    cfg = small_cfg(tmp, host="128KiB")
    cfg["optimizer"] = {"kernel": "native", "state_dtype": moments,
                        "state_rounding": rounding, "master_weights": master}
    with tiermem.offload(opt, cfg, model=model) as tm:
        for i, micro in enumerate(batches):
            local_backward(model, micro, i, rank)
            opt.step()
            opt.zero_grad()
            local_backward(ref_model, micro, i, rank)
            averaged(ref_model, world)
            for ref in refs:
                ref.step()
                ref.zero_grad()
            for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
                assert_same_tensor(p.detach(), q.detach(), f"rank {rank} step {i} {n}")
        sd = opt.state_dict()  # collective: every rank gets the whole state
        tm.discard()
    index = 0
    for ref in refs:
        for j in range(len(ref.params)):
            if ref.steps[j]:
                for k, t in ref.moments(j).items():
                    assert_same_tensor(sd["state"][index][k].reshape(-1), t,
                                       f"rank {rank} param {index} {k}")
            index += 1


def barrier() -> None:
    dist.barrier()


def small_cfg(tmp: str, backend: str = "threads", **kw) -> dict:
    cfg = config(tmp, backend=backend, host=kw.pop("host", "0"), partition_size="64KiB")
    cfg["distributed"] = {"bucket_size": "32KiB", "timeout": kw.pop("timeout", 120), **kw}
    return cfg


@contextlib.contextmanager
def kept_at_exit() -> Iterator[None]:
    """No host memory for the whole state at the block's exit: each rank keeps its share on
    disk, with the warning that says so (expected here, not shown)."""
    import warnings
    from unittest import mock

    with mock.patch("tiermem.dist.sharded.available_memory", return_value=0), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def train_pair(rank, world, model, opt, ref_model, ref_opt, steps, first=0):
    batches = make_batches(model, first + steps, seed=10 + rank)[first:]
    for i, micro in enumerate(batches, start=first):
        local_backward(model, micro, i, rank)
        opt.step()
        opt.zero_grad()
        local_backward(ref_model, micro, i, rank)
        averaged(ref_model, world)
        ref_opt.step()
        ref_opt.zero_grad()


def pair(amsgrad=False):
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    mk = lambda m: torch.optim.AdamW(groups_of(m), lr=1e-2, weight_decay=0.05,  # noqa: E731
                                     amsgrad=amsgrad, foreach=False)
    return model, mk(model), ref_model, mk(ref_model)


def state_dict_roundtrip(rank: int, world: int, tmp: str) -> None:
    """opt.state_dict() inside the block gathers torch's format from every share (collective);
    load_state_dict puts each rank's pieces back; training goes on equal to the reference."""
    from offload_helpers import compare_state_dicts

    model, opt, ref_model, ref_opt = pair(amsgrad=True)
    with tiermem.offload(opt, small_cfg(tmp)):
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
        sd = opt.state_dict()
        compare_state_dicts(sd, ref_opt.state_dict(), exact=True)
        for st in sd["state"].values():  # scramble, then load the saved copy back
            st["exp_avg"] = st["exp_avg"].clone()
        opt.load_state_dict(sd)
        train_pair(rank, world, model, opt, ref_model, ref_opt, 1, first=2)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


class _Stop(Exception):
    pass


def resume_one_step_apart(rank: int, world: int, tmp: str) -> None:
    """Crash-consistent ranks one step apart, as a crash between two ranks' commits of step 3
    leaves them (made here by the last rank's manifest going back to its previous commit,
    its step-3 records written but named by no manifest): the resume takes every rank back
    to step 2, bitwise, and training goes on equal to the reference."""
    model, opt, ref_model, ref_opt = pair()
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    try:
        with tiermem.offload(opt, cfg, model=model, name="apart"):
            train_pair(rank, world, model, opt, ref_model, ref_opt, 3)
            raise _Stop()  # every rank keeps its share on disk
    except _Stop:
        pass
    run_dir = os.path.join(tmp, f"tiermem-apart-rank{rank}")
    assert read_manifest(run_dir, None).step == 3
    assert read_manifest(run_dir, None, previous=True).step == 2
    if rank == world - 1:
        os.replace(os.path.join(run_dir, "manifest.previous.json"),
                   os.path.join(run_dir, "manifest.json"))
    barrier()
    model, opt, ref_model, ref_opt = pair()
    for i, micro in enumerate(make_batches(ref_model, 2, seed=10 + rank)):
        local_backward(ref_model, micro, i, rank)
        averaged(ref_model, world)
        ref_opt.step()
        ref_opt.zero_grad()
    with tiermem.offload(opt, cfg, model=model, name="apart", resume=True) as tm:
        assert tm.resumed_step == 2, tm.resumed_step
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert_same_tensor(p.detach(), q.detach(), f"rank {rank} step 2 {n}")
        # The step gone back to is the latest on disk now: a crash here resumes it again.
        assert read_manifest(run_dir, None).step == 2
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2, first=2)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def kept_guard(rank: int, world: int, tmp: str) -> None:
    """Issue 16 on the sharded path: after an exit that keeps each rank's share on disk (it
    does not fit in host memory, or the block ended on an exception), opt.step() raises naming
    the rank's directory and the exact resume call, name= included, instead of starting Adam
    over at step 1; that call, followed as printed, continues the run bitwise."""
    import warnings
    from unittest import mock

    model, opt, ref_model, ref_opt = pair()
    cfg = small_cfg(tmp)
    with mock.patch("tiermem.dist.sharded.available_memory", return_value=0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tiermem.offload(opt, cfg, model=model, name="keep"):
                train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
    said = [str(w.message) for w in caught if "does not fit" in str(w.message)]
    assert said and "name='keep', resume=True" in said[0], said
    assert not opt.state
    run_dir = os.path.join(tmp, f"tiermem-keep-rank{rank}")
    try:
        opt.step()
    except tiermem.TierMemError as exc:
        text = str(exc)
        assert f"rank {rank}'s share" in text and run_dir in text, text
        assert "tiermem.offload(optimizer, config, model=model, name='keep', resume=True)" \
            in text, text
    else:
        raise AssertionError("opt.step() after a keep-on-disk exit did not raise")
    with tiermem.offload(opt, cfg, model=model, name="keep", resume=True) as tm:
        assert tm.resumed_step == 2, tm.resumed_step
        train_pair(rank, world, model, opt, ref_model, ref_opt, 1, first=2)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)

    # An exception that ends the block keeps every share on disk too: a caller who catches
    # it and steps on must hear where the state went.
    model, opt, *_ = pair()
    try:
        with tiermem.offload(opt, cfg, model=model, name="err"):
            train_pair(rank, world, model, opt, *pair()[2:], 1)
            raise _Stop()
    except _Stop:
        pass
    try:
        opt.step()
    except tiermem.TierMemError as exc:
        assert "tiermem-err-rank" in str(exc) and "name='err', resume=True" in str(exc), exc
    else:
        raise AssertionError("opt.step() after an exit on an exception did not raise")


def placeholders(rank: int, world: int, tmp: str) -> None:
    """{rank} / {local_rank} pick a directory per rank; ranks sharing one path never collide
    (run directories tiermem-<name>-rank<r>)."""
    model, opt, *_ = pair()
    cfg = small_cfg(os.path.join(tmp, "drive{rank}"))
    cfg["swap"]["paths"].append(os.path.join(tmp, "local{local_rank}"))
    with tiermem.offload(opt, cfg, name="ph") as tm:
        assert tm.plan()["local_rank"] == rank  # one host: local rank = rank
        for d in (f"drive{rank}", f"local{rank}"):
            assert os.path.isdir(os.path.join(tmp, d, f"tiermem-ph-rank{rank}")), d
        barrier()
    shared = os.path.join(tmp, "shared")
    with tiermem.offload(opt, small_cfg(shared), name="sh"):
        barrier()
        assert sorted(os.listdir(shared)) == [f"tiermem-sh-rank{r}" for r in range(world)]
        barrier()


def dcp_save(rank: int, world: int, tmp: str, ckpt: str) -> None:
    """Save after 2 steps; the expected whole state goes to ckpt + '.expected.pt'."""
    from tiermem.dist import dcp

    model, opt, ref_model, ref_opt = pair(amsgrad=True)
    with tiermem.offload(opt, small_cfg(tmp, host="128KiB")) as tm:
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
        figures = dcp.save(tm, ckpt)
        parts = tm.offloaded.parts
        share = sum(p.record_bytes for p in parts)
        biggest = max(p.record_bytes for p in parts)
        item = 4 * max(s.length for p in parts for s in p.segments)
    # Streamed: every record read once, and at most one record copy plus the one item DCP
    # is writing alive at once (what DCP's writer still references holds no bytes), well
    # below this rank's share of the state.
    assert figures["records_read"] == len(parts), figures
    assert figures["peak_live_bytes"] <= biggest + item < share, (figures, biggest, share)
    compare_runs(model, opt, ref_model, ref_opt, exact=world == 2)
    if rank == 0:
        torch.save(type(opt).state_dict(opt), ckpt + ".expected.pt")
    barrier()


def dcp_master_modes(rank: int, world: int, tmp: str) -> None:
    """A bf16 model's checkpoint of Kahan terms (scratch) loaded by fp32 masters under
    crash_consistent, and back: each rank makes its pieces' kinds the checkpoint lacks
    (the master: weight + term; the term from the master; the record's weights from the
    model) as load_state_dict would from the state_dict."""
    from offload_helpers import compare_state_dicts
    from tiermem.dist import dcp

    model = Synthetic().to(torch.bfloat16)
    batches = make_batches(model, 2, seed=10 + rank)

    def cfg(name, master, durability):
        c = small_cfg(os.path.join(tmp, name), host="64KiB")
        c["optimizer"] = {"kernel": "native", "master_weights": master}
        c["swap"]["durability"] = durability
        return c

    modes = [("kahan", "scratch"), ("fp32", "crash_consistent"), ("kahan", "crash_consistent")]
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, foreach=False)
    with tiermem.offload(opt, cfg("a", *modes[0]), model=model) as tm:
        for i, micro in enumerate(batches):
            local_backward(model, micro, i, rank)
            opt.step()
            opt.zero_grad()
        dcp.save(tm, os.path.join(tmp, "ck0"))
        sd = opt.state_dict()
    for n, mode in enumerate(modes[1:], start=1):
        want = torch.optim.AdamW(groups_of(copy.deepcopy(model)), lr=1e-2, foreach=False)
        with tiermem.offload(want, cfg(f"w{n}", *mode)):
            want.load_state_dict(sd)
            expected = want.state_dict()
        opt = torch.optim.AdamW(groups_of(model), lr=1e-2, foreach=False)
        with tiermem.offload(opt, cfg(f"b{n}", *mode), model=model) as tm:
            dcp.load(tm, os.path.join(tmp, f"ck{n - 1}"))
            compare_state_dicts(opt.state_dict(), expected, exact=True)
            dcp.save(tm, os.path.join(tmp, f"ck{n}"))
            sd = opt.state_dict()


def dcp_load(rank: int, world: int, tmp: str, ckpt: str) -> None:
    """Load a checkpoint written with another world size (different partitions too) and get
    exactly the state that was saved."""
    from offload_helpers import compare_state_dicts
    from tiermem.dist import dcp

    model, opt, *_ = pair(amsgrad=True)
    cfg = small_cfg(tmp, host="64KiB")
    cfg["pipeline"]["partition_size"] = "128KiB"
    with tiermem.offload(opt, cfg) as tm:
        figures = dcp.load(tm, ckpt)
        sd = opt.state_dict()
    assert figures["peak_staged"] <= len(opt.param_groups) + 1, figures
    compare_state_dicts(sd, torch.load(ckpt + ".expected.pt"), exact=True)


def repad_shards_like_old_torch(model) -> int:
    """Before torch 2.11, fully_shard's lazy init (the first forward) re-padded an uneven
    shard into new storage and swapped the parameter's local tensor. Make this torch do the
    same now (its reset_sharded_param skips the copy only while the storage is the one it
    padded at fully_shard): returns how many local tensors moved on this rank."""
    moved = 0
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fp in (group.fsdp_params if group is not None else ()):
            before = fp.sharded_param._local_tensor.data_ptr()
            fp._sharded_param_data = fp._sharded_param_data.clone()
            fp.reset_sharded_param()
            moved += fp.sharded_param._local_tensor.data_ptr() != before
    return moved


def sharded_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The FSDP2 scenarios' model, fully_shard-ed (1031 rows over 2 ranks: the last shard of
    the first layer is uneven), and a plain copy of it for the reference."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(61, 1031), torch.nn.Tanh(),
                                torch.nn.Linear(1031, 33))
    ref_model = copy.deepcopy(model)
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    return model, ref_model


def sharded_steps(rank: int, world: int, model, opt, ref_model, ref_opt, g, steps: int
                  ) -> None:
    """`steps` steps of the FSDP2 model on this rank's batches; the reference (when given)
    on the mean gradient."""
    for _ in range(steps):
        x, y = torch.randn(8, 61, generator=g), torch.randn(8, 33, generator=g)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if ref_opt is None:
            continue
        (ref_model(x) - y).square().mean().backward()
        averaged(ref_model, world)
        ref_opt.step()
        ref_opt.zero_grad()


def fsdp2(rank: int, world: int, tmp: str, repad: bool = False) -> None:
    """fully_shard parameters (DTensors): tiermem tiers each rank's local shard; weights and
    state equal a plain AdamW on the mean gradient. repad: the shards move to new storage
    after tiermem.offload started, as older torch did at the first forward."""
    from torch.distributed.tensor import DTensor

    model, ref_model = sharded_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05,
                                foreach=False)
    g = torch.Generator().manual_seed(20 + rank)
    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        assert tm.plan()["mode"] == "fsdp2"
        local = sum(p.to_local().numel() for p in model.parameters())
        assert tm.plan()["share_elements"] == local
        if repad:
            # 1031 rows over 2 ranks: the last rank's shard of model[0] is padded.
            assert (repad_shards_like_old_torch(model) > 0) == (rank == world - 1)
        sharded_steps(rank, world, model, opt, ref_model, ref_opt, g, 3)
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert_close_tensor(p.full_tensor().detach(), q.detach(), f"rank {rank} {n}")
    for p, q in zip(model.parameters(), ref_model.parameters()):
        st, sr = opt.state[p], ref_opt.state[q]
        assert isinstance(st["exp_avg"], DTensor)
        assert float(st["step"]) == float(sr["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close_tensor(st[k].full_tensor(), sr[k], f"rank {rank} state {k}")


# torch's elementwise optimizers under ZeRO and FSDP2: the eager accumulator (Adagrad),
# per-parameter scalars (ASGD's eta and mu, NAdam's mu_product), no step count in the state
# (SGD), state of two kinds and a sign-based rule (RMSprop, Rprop)
TORCH_FAMILY = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05)),
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    (torch.optim.ASGD, dict(lr=0.01, t0=1)),
    (torch.optim.NAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    (torch.optim.Rprop, dict(lr=0.01)),
]


def torch_family(rank: int, world: int, tmp: str) -> None:
    """Each of TORCH_FAMILY over ZeRO shares (two groups, a parameter some rank owns none
    of, grads None on some ranks in a step): weights and state equal the plain optimizer on
    the mean gradient (bitwise with 2 ranks); state_dict() inside the block gathers torch's
    format, per-parameter scalars included, and loading it back steps on equal."""
    from offload_helpers import compare_state_dicts

    import inspect

    exact = world == 2
    for n, (cls, kw) in enumerate(TORCH_FAMILY):
        if not exact and "eps" in inspect.signature(cls).parameters:
            # An element whose ranks' gradients cancel holds ~1e-9 of rounding (see
            # parity()); the state keeps g / (sqrt(avg) + eps) with no lr in front
            # (RMSprop's momentum_buffer), so eps must be 1e-2 for it to stay under 1e-6.
            kw = {**kw, "eps": 1e-2}
        model = Synthetic()
        ref_model = copy.deepcopy(model)
        opt, ref_opt = cls(groups_of(model), **kw), cls(groups_of(ref_model), **kw)
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, str(n)), host="64KiB")):
            # before any step: nothing, or Adagrad's accumulators as its __init__ made them
            compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
            train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
            # (SGD without momentum: torch keeps no entry, opt.state stays false)
            assert bool(opt.state) == bool(ref_opt.state), cls.__name__
            sd = opt.state_dict()
            compare_state_dicts(sd, ref_opt.state_dict(), exact=exact)
            opt.load_state_dict(sd)
            train_pair(rank, world, model, opt, ref_model, ref_opt, 2, first=2)
        compare_runs(model, opt, ref_model, ref_opt, exact=exact)
        barrier()


def fsdp2_torch_family(rank: int, world: int, tmp: str) -> None:
    """TORCH_FAMILY on fully_shard parameters: each rank tiers its local shard; weights and
    state (DTensors) equal the plain optimizer's on the mean gradient."""
    for n, (cls, kw) in enumerate(TORCH_FAMILY):
        model, ref_model = sharded_pair()
        opt, ref_opt = cls(model.parameters(), **kw), cls(ref_model.parameters(), **kw)
        g = torch.Generator().manual_seed(20 + rank)
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, str(n)))):
            sharded_steps(rank, world, model, opt, ref_model, ref_opt, g, 3)
            assert bool(opt.state) == bool(ref_opt.state), cls.__name__
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_close_tensor(p.full_tensor().detach(), q.detach(), f"{cls.__name__} {p.shape}")
            st, sr = opt.state.get(p, {}), ref_opt.state.get(q, {})
            assert set(st) == set(sr), (cls.__name__, sorted(st), sorted(sr))
            for k, v in sr.items():
                got = st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k]
                assert_close_tensor(torch.as_tensor(got), torch.as_tensor(v),
                                    f"{cls.__name__} state {k}")
        barrier()


RECOVERED = [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05, foreach=False)),
             (torch.optim.ASGD, dict(lr=0.01, t0=1))]


def recover_kept(rank: int, world: int, tmp: str) -> None:
    """Crash-consistent runs whose shares stay on disk at exit (no host memory for them), to
    be put back together by `tiermem recover` in the test process: rank 0 saves what the
    plain optimizer and model hold after the same steps beside them. FSDP2's shards too."""

    for n, (cls, kw) in enumerate(RECOVERED):
        model = Synthetic()
        ref_model = copy.deepcopy(model)
        opt, ref_opt = cls(groups_of(model), **kw), cls(groups_of(ref_model), **kw)
        cfg = small_cfg(tmp)
        cfg["swap"]["durability"] = "crash_consistent"
        with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name=f"kept{n}"):
            train_pair(rank, world, model, opt, ref_model, ref_opt, 3)
        if rank == 0:
            torch.save({"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict()},
                       os.path.join(tmp, f"kept{n}.expected.pt"))
    model, _ = sharded_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    g = torch.Generator().manual_seed(20 + rank)
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="fsdp"):
        sharded_steps(rank, world, model, opt, None, None, g, 2)
        # the shards' whole values, as every rank sees them
        want = {"model": {k: v.full_tensor() for k, v in model.state_dict().items()},
                "optimizer": {i: opt.state_dict()["state"][i]["momentum_buffer"]
                              .full_tensor() for i in range(4)}}
    if rank == 0:
        torch.save(want, os.path.join(tmp, "fsdp.expected.pt"))
    barrier()


def resume_kept_scalars(rank: int, world: int, tmp: str) -> None:
    """A crash-consistent ASGD run kept on disk resumes on every rank with its shares'
    per-parameter scalars (eta, mu) and continues as the uninterrupted reference."""

    kw = dict(lr=0.01, t0=1)
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.ASGD(groups_of(model), **kw)
    ref_opt = torch.optim.ASGD(groups_of(ref_model), **kw)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="asgd"):
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
    assert not opt.state
    with tiermem.offload(opt, cfg, model=model, name="asgd", resume=True) as tm:
        assert tm.resumed_step == 2, tm.resumed_step
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2, first=2)
    compare_runs(model, opt, ref_model, ref_opt, exact=world == 2)


def resume_other_world(rank: int, world: int, tmp: str) -> None:
    """Shares kept by a run of world - 1 ranks (a subgroup), resumed on all `world`: each
    share is another world size's cut of the model, so every rank refuses, those with a
    directory naming both world sizes (not the config, which did not change), the new rank
    naming the manifest it lacks."""

    fewer = dist.new_group(list(range(world - 1)))  # collective: every rank makes it
    model, opt, *_ = pair()
    cfg = small_cfg(tmp)
    if rank < world - 1:
        with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="w",
                                             process_group=fewer):
            for i, micro in enumerate(make_batches(model, 2, seed=10 + rank)):
                local_backward(model, micro, i, rank)
                opt.step()
                opt.zero_grad()
    barrier()
    model, opt, *_ = pair()
    try:
        with tiermem.offload(opt, cfg, model=model, name="w", resume=True):
            pass
    except tiermem.TierMemError as exc:
        if rank < world - 1:
            assert f"it holds the share of rank {rank} of {world - 1}, and this is rank " \
                f"{rank} of {world}; a resume continues on the same world size" in str(exc), exc
        else:
            assert "manifest.json does not exist" in str(exc), exc
    else:
        raise AssertionError("a resume on another world size was not refused")
    dist.destroy_process_group(fewer)


def rank_raises(rank: int, world: int, tmp: str) -> None:
    """The last rank raises before its second step: the others get, within
    distributed.timeout, an error naming it and its exception."""
    model, opt, *_ = pair()
    batches = make_batches(model, 2, seed=10 + rank)
    started = time.monotonic()
    try:
        with tiermem.offload(opt, small_cfg(tmp, timeout=3)):
            for i, micro in enumerate(batches):
                if i == 1 and rank == world - 1:
                    raise ValueError(f"boom on rank {rank}")
                local_backward(model, micro, i, rank)
                opt.step()
                opt.zero_grad()
    except ValueError as exc:
        assert rank == world - 1 and "boom" in str(exc)
        return
    except PeerError as exc:
        assert rank != world - 1
        assert f"rank {world - 1} failed: ValueError: boom on rank {world - 1}" in str(exc), exc
        assert "step 2" in str(exc), exc
        assert time.monotonic() - started < 100  # bounded (the test would hang otherwise)
        return
    raise AssertionError(f"rank {rank}: no error")


def rank_dies(rank: int, world: int, tmp: str) -> None:
    """The last rank is killed (SIGKILL: no word to anyone) in its second step, after it
    updated its first partition. The others finish updating their shares, get a PeerError
    naming it (its heartbeat stopped), and keep their shares on disk at step 2, the step
    they completed, with a manifest (the state is recoverable, not handed back)."""
    model, opt, *_ = pair()
    batches = make_batches(model, 2, seed=10 + rank)
    tm = None
    try:
        with tiermem.offload(opt, small_cfg(tmp, timeout=2), name="dies") as tm:
            if rank == world - 1:
                update = tm.offloaded._update

                def update_then_die(part, views, stats):
                    update(part, views, stats)
                    if tm.offloaded.steps_taken == 1:  # inside step 2
                        os.kill(os.getpid(), signal.SIGKILL)

                tm.offloaded._update = update_then_die
            for i, micro in enumerate(batches):
                local_backward(model, micro, i, rank)
                opt.step()
                opt.zero_grad()
    except PeerError as exc:
        assert rank != world - 1
        assert f"rank {world - 1} died or froze (its heartbeat stopped" in str(exc), exc
        assert f"rank {world - 1} died or froze (its heartbeat stopped; it beats every " \
               f"0.2 s) at step 2" in str(exc), exc
        assert tm is not None and tm.kept_on_disk, "the share was not kept on disk"
        kept = read_manifest(tm.kept_on_disk, None)
        assert kept.step == 2, kept.step
        assert kept.files and all(os.path.exists(os.path.join(tm.kept_on_disk, f))
                                  for f in kept.files), kept.files
        return
    raise AssertionError(f"rank {rank}: no error")


def gradscaler(rank: int, world: int, tmp: str) -> None:
    """torch.amp.GradScaler over ranks. With gradients all-reduced before it (DDP's;
    distributed.grads: allreduced) a fused AdamW under it equals the plain one, bitwise,
    its skipped steps included (rank 0's inf reaches every rank through the all-reduce):
    the first, after which torch's fused step has made the state of the parameters with
    gradients (step 0, zero moments), and a later one.
    With reduce_scatter each rank's GradScaler sees only its own gradients: every rank
    refuses the step at step(), also where only rank 0 found an inf (its GradScaler would
    skip the step while the other's waits in a collective, were the hand-over not taken)."""
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    mk = lambda m: torch.optim.AdamW(groups_of(m), lr=1e-2, weight_decay=0.05,  # noqa: E731
                                     fused=True)
    opt, ref_opt = mk(model), mk(ref_model)
    batches = make_batches(model, STEPS, seed=10 + rank)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1000.0) for _ in range(2)]
    with tiermem.offload(opt, small_cfg(tmp, grads="allreduced"), model=model):
        for i, micro in enumerate(batches):
            for m, o, scaler in ((model, opt, scalers[0]), (ref_model, ref_opt, scalers[1])):
                for tokens, target in micro:
                    loss = loss_of(m, tokens, target, used_side(i, rank))
                    scaler.scale(loss * float("inf") if i in (0, 2) and rank == 0
                                 else loss).backward()
                averaged(m, world)  # DDP's all-reduce
                scaler.step(o)
                scaler.update()
                o.zero_grad()
            if i == 0:  # a collective: every rank gathers the whole state
                from offload_helpers import compare_state_dicts
                want = ref_opt.state_dict()
                assert want["state"] and all(float(st["step"]) == 0
                                             for st in want["state"].values())
                compare_state_dicts(opt.state_dict(), want, exact=True)
                assert bool(opt.state)
    assert scalers[0].get_scale() == scalers[1].get_scale() < 1000.0
    compare_runs(model, opt, ref_model, ref_opt)
    for fused in (False, True):
        model = Synthetic()
        opt = torch.optim.AdamW(groups_of(model), lr=1e-2, fused=fused)
        (tokens, target), = make_batches(model, 1, seed=10 + rank)[0]
        d = os.path.join(tmp, f"reduce-scatter-fused-{fused}")  # a failed exit keeps it
        os.makedirs(d, mode=0o700, exist_ok=True)
        try:
            with tiermem.offload(opt, small_cfg(d), model=model):
                scaler = torch.amp.GradScaler("cpu")
                loss = loss_of(model, tokens, target, False)
                scaler.scale(loss * float("inf") if rank == 0 else loss).backward()
                scaler.step(opt)
        except tiermem.TierMemError as exc:
            assert "GradScaler" in str(exc) and "reduce_scatter" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: GradScaler with reduce_scatter not refused")
    # grads: allreduced declared, but a loop without DDP: rank 0's GradScaler alone finds
    # the inf and skips while rank 1 steps; both must say so, not pair rank 0's next step
    # with rank 1's this one
    from tiermem.dist.collectives import RankMismatch
    model = Synthetic()
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, fused=True)
    (tokens, target), = make_batches(model, 1, seed=10 + rank)[0]
    d = os.path.join(tmp, "allreduced-not-reduced")
    os.makedirs(d, mode=0o700, exist_ok=True)
    with tiermem.offload(opt, small_cfg(d, grads="allreduced"), model=model):
        scaler = torch.amp.GradScaler("cpu")
        loss = loss_of(model, tokens, target, False)
        scaler.scale(loss * float("inf") if rank == 0 else loss).backward()
        try:
            scaler.step(opt)
        except RankMismatch as exc:
            assert "skipped by GradScaler" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: a skip on one rank and a step on the other "
                                 "went on")


# -- torch.distributed.checkpoint.state_dict's helpers (torchtitan's, Accelerate's) ----------


def same_fqn_state(sd: dict, ref_sd: dict, exact: bool = True) -> None:
    """Two optimizer state_dicts keyed by parameter names (the helpers' layout) hold the same
    state, step counts included; DTensors (FSDP2) are compared whole."""
    check = assert_same_tensor if exact else assert_close_tensor
    assert set(sd["state"]) == set(ref_sd["state"]), (sorted(sd["state"]),
                                                       sorted(ref_sd["state"]))
    for name, ref_st in ref_sd["state"].items():
        assert set(sd["state"][name]) == set(ref_st), name
        for k, v in ref_st.items():
            a = sd["state"][name][k]
            a = a.full_tensor() if hasattr(a, "full_tensor") else a
            if k == "step":
                assert float(a) == float(v), f"{name}: step {float(a)} != {float(v)}"
            else:
                check(a, v, f"{name}[{k!r}]")
    assert [g["params"] for g in sd["param_groups"]] == [
        g["params"] for g in ref_sd["param_groups"]]


def dcp_helpers_take_no_step(rank: int, world: int, tmp: str,
                             grads: str = "reduce_scatter") -> None:
    """get_optimizer_state_dict / get_state_dict inside the block, over ZeRO shares: torch
    takes an empty opt.state for a never-stepped optimizer and steps it with zero gradients
    and lr 0; the tiered opt.state must be true whenever the plain one is, on every rank
    alike (that step is a collective), or every count goes one up and every moment decays.
    Adagrad's state is made at construction: no step before the first real one either.
    allreduced: the gradients averaged before the step, as DDP does."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict

    from tiermem.dist import dcp

    cases = [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
             (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.1))]
    for n, (cls, kw) in enumerate(cases if grads == "reduce_scatter" else cases[:1]):
        model = Synthetic()
        ref_model = copy.deepcopy(model)
        opt, ref_opt = cls(groups_of(model), **kw), cls(groups_of(ref_model), **kw)
        batches = make_batches(model, 3, seed=10 + rank)

        def steps(first, last):
            for i in range(first, last):
                local_backward(model, batches[i], i, rank)
                if grads == "allreduced":
                    averaged(model, world)
                opt.step()
                opt.zero_grad()
                local_backward(ref_model, batches[i], i, rank)
                averaged(ref_model, world)
                ref_opt.step()
                ref_opt.zero_grad()

        ck = os.path.join(tmp, f"ck{n}")
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, str(n)), grads=grads),
                             model=model) as tm:
            # never stepped: torch makes AdamW's state with its lr-0 step, tiered or not;
            # Adagrad's is there already
            same_fqn_state(get_optimizer_state_dict(model, opt),
                           get_optimizer_state_dict(ref_model, ref_opt))
            steps(0, 2)
            ref_sd = copy.deepcopy(get_optimizer_state_dict(ref_model, ref_opt))
            same_fqn_state(get_optimizer_state_dict(model, opt), ref_sd)
            same_fqn_state(get_state_dict(model, opt)[1], ref_sd)
            dcp.save(tm, ck)
            steps(2, 3)
        compare_runs(model, opt, ref_model, ref_opt, exact=True)
        # tiermem's own checkpoint loaded into a block never stepped: it holds state now
        opt = cls(groups_of(model), **kw)
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, f"load{n}"), grads=grads),
                             model=model) as tm:
            dcp.load(tm, ck)
            same_fqn_state(get_optimizer_state_dict(model, opt), ref_sd)
        barrier()
    if grads != "reduce_scatter":
        return
    # 40 elements, under one share cut: rank 0 owns none of them and its own share holds no
    # state, yet its opt.state must answer as rank 1's (else it alone steps, and waits)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 8)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref_model))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + rank))
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "tiny"), timeout=30)) as tm:
        assert (tm.plan()["share_elements"] == 0) == (rank == 0)
        for m, o in ((model, opt), (ref_model, ref_opt)):
            m(x).square().mean().backward()
            if o is ref_opt:
                averaged(m, world)
            o.step()
            o.zero_grad()
        same_fqn_state(get_optimizer_state_dict(model, opt),
                       get_optimizer_state_dict(ref_model, ref_opt))
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def dcp_helpers_load(rank: int, world: int, tmp: str) -> None:
    """set_optimizer_state_dict inside the block, over ZeRO shares: it hands load_state_dict
    the state under parameter names, which each rank must map to its pieces as torch maps
    them (by place in the groups' params), or nothing is loaded and the run starts over.
    flatten_optimizer_state_dict=True reads each parameter's state names from opt.state[p]
    ({} inside the block): refused on every rank alike; before the block it loads."""
    from offload_helpers import compare_state_dicts
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    ref_model, ref_opt = pair(amsgrad=True)[2:]
    for i, micro in enumerate(make_batches(ref_model, 2, seed=10 + rank)):  # the checkpoint's
        local_backward(ref_model, micro, i, rank)
        averaged(ref_model, world)
        ref_opt.step()
        ref_opt.zero_grad()
    sd = copy.deepcopy(get_optimizer_state_dict(ref_model, ref_opt))
    flat_sd = copy.deepcopy(get_optimizer_state_dict(ref_model, ref_opt, options=flat))
    want = copy.deepcopy(ref_opt.state_dict())
    for n, how in enumerate(["names", "flattened inside", "flattened before"]):
        m, ref_m = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
        opt, ref_o = (torch.optim.AdamW(groups_of(x), lr=1e-2, weight_decay=0.05,
                                        amsgrad=True, foreach=False) for x in (m, ref_m))
        ref_o.load_state_dict(copy.deepcopy(want))
        if how == "flattened before":
            set_optimizer_state_dict(m, opt, copy.deepcopy(flat_sd), options=flat)
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, str(n))), model=m):
            if how == "names":
                set_optimizer_state_dict(m, opt, copy.deepcopy(sd))
            elif how == "flattened inside":
                try:
                    set_optimizer_state_dict(m, opt, copy.deepcopy(flat_sd), options=flat)
                except tiermem.TierMemError as exc:
                    assert "flatten_optimizer_state_dict" in str(exc), exc
                else:
                    raise AssertionError(f"rank {rank}: a flattened load inside the block "
                                         "was not refused")
                opt.load_state_dict(copy.deepcopy(want))  # refused, it changed nothing
            compare_state_dicts(opt.state_dict(), want, exact=True)
            train_pair(rank, world, m, opt, ref_m, ref_o, 1, first=2)
        compare_runs(m, opt, ref_m, ref_o, exact=True)
        barrier()


def dcp_helpers_roundtrip(rank: int, world: int, tmp: str) -> None:
    """torchtitan's checkpoint over ZeRO shares: get_state_dict into dcp.save; a new run
    makes its template with get_state_dict (never stepped: torch's lr-0 step, tiered or
    not), fills it with dcp.load and hands it to set_state_dict (parameter names), then
    goes on equal to the plain run, bitwise."""
    import torch.distributed.checkpoint as tdcp
    from offload_helpers import compare_state_dicts
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, ref_model, ref_opt = pair(amsgrad=True)
    ck = os.path.join(tmp, "ck")
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a")), model=model):
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
        model_sd, optim_sd = get_state_dict(model, opt)
        tdcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ck)
    model = Synthetic(seed=1)  # other weights: the checkpoint's must replace them
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.05, amsgrad=True,
                            foreach=False)
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "b")), model=model):
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        tdcp.load(sd, checkpoint_id=ck)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        train_pair(rank, world, model, opt, ref_model, ref_opt, 1, first=2)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def fsdp2_dcp_helpers(rank: int, world: int, tmp: str) -> None:
    """The helpers on fully_shard parameters: get_optimizer_state_dict takes no step (and
    full_state_dict gathers rank 0 the whole state); a new run's template from
    get_state_dict, filled by dcp.load and handed to set_state_dict under parameter names,
    loads each rank's shard exactly; both go on equal to the plain AdamW."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         get_state_dict, set_state_dict)

    mk = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05,  # noqa: E731
                                     foreach=False)
    model, ref_model = sharded_pair()
    opt, ref_opt = mk(model), mk(ref_model)
    g = torch.Generator().manual_seed(20 + rank)
    ck = os.path.join(tmp, "ck")
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a"))):
        sharded_steps(rank, world, model, opt, ref_model, ref_opt, g, 2)
        ref_sd = copy.deepcopy(get_optimizer_state_dict(ref_model, ref_opt))
        same_fqn_state(get_optimizer_state_dict(model, opt), ref_sd, exact=False)
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))  # a collective: every rank calls it
        if rank == 0:
            same_fqn_state(full, ref_sd, exact=False)
        model_sd, optim_sd = get_state_dict(model, opt)
        tdcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ck)
    model, _ = sharded_pair()  # the first weights: the checkpoint's must replace them
    opt = mk(model)
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "b"))):
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        tdcp.load(sd, checkpoint_id=ck)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        same_fqn_state(get_optimizer_state_dict(model, opt), ref_sd, exact=False)
        sharded_steps(rank, world, model, opt, ref_model, ref_opt, g, 1)
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_close_tensor(p.full_tensor().detach(), q.detach(), f"rank {rank} {n}")
        st, sr = opt.state[p], ref_opt.state[q]
        assert float(st["step"]) == float(sr["step"]) == 3.0, n
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close_tensor(st[k].full_tensor(), sr[k], f"rank {rank} {n} state {k}")


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {
        "parity-threads": lambda r, d: parity(r, world, d, "threads"),
        "parity-io_uring-mixed-amsgrad": lambda r, d: parity(r, world, d, "io_uring",
                                                             host="256KiB", amsgrad=True),
        "ddp-allreduced": lambda r, d: parity(r, world, d, "threads", grads="allreduced",
                                              ddp=True),
        "parity-lanes-cpu": lambda r, d: parity(r, world, d, "threads", lanes="cpu"),
        "parity-lanes-device": lambda r, d: parity(r, world, d, "threads", lanes="device"),
        "state-dict": lambda r, d: state_dict_roundtrip(r, world, d),
        "int8-nearest": lambda r, d: int8_parity(r, world, d),
        "int8-kahan": lambda r, d: int8_parity(r, world, d, "kahan"),
        "int8-none-stochastic": lambda r, d: int8_parity(r, world, d, "none", "stochastic"),
        "fp32-kahan": lambda r, d: int8_parity(r, world, d, "kahan", moments="fp32"),
        "bf16-none-stochastic": lambda r, d: int8_parity(r, world, d, "none", "stochastic",
                                                         "bf16"),
        # bf16 moments beside an fp32 model (native/adam.c's pass): the same streams
        "bf16-fp32-stochastic": lambda r, d: int8_parity(r, world, d, "fp32", "stochastic",
                                                         "bf16"),
        "resume-one-step-apart": lambda r, d: resume_one_step_apart(r, world, d),
        "placeholders": lambda r, d: placeholders(r, world, d),
        "kept-guard": lambda r, d: kept_guard(r, world, d),
        "dcp-save": lambda r, d: dcp_save(r, world, d, extra["ckpt"]),
        "dcp-load": lambda r, d: dcp_load(r, world, d, extra["ckpt"]),
        "dcp-master-modes": lambda r, d: dcp_master_modes(r, world, d),
        "torch-family": lambda r, d: torch_family(r, world, d),
        "fsdp2-torch-family": lambda r, d: fsdp2_torch_family(r, world, d),
        "resume-other-world": lambda r, d: resume_other_world(r, world, d),
        "recover-kept": lambda r, d: recover_kept(r, world, d),
        "resume-kept-scalars": lambda r, d: resume_kept_scalars(r, world, d),
        "fsdp2": lambda r, d: fsdp2(r, world, d),
        "fsdp2-repadded": lambda r, d: fsdp2(r, world, d, repad=True),
        "gradscaler": lambda r, d: gradscaler(r, world, d),
        "rank-raises": lambda r, d: rank_raises(r, world, d),
        "rank-dies": lambda r, d: rank_dies(r, world, d),
        "dcp-helpers-no-step": lambda r, d: dcp_helpers_take_no_step(r, world, d),
        "dcp-helpers-no-step-allreduced": lambda r, d: dcp_helpers_take_no_step(
            r, world, d, "allreduced"),
        "dcp-helpers-load": lambda r, d: dcp_helpers_load(r, world, d),
        "dcp-helpers-roundtrip": lambda r, d: dcp_helpers_roundtrip(r, world, d),
        "fsdp2-dcp-helpers": lambda r, d: fsdp2_dcp_helpers(r, world, d),
        "adagrad-added-group": lambda r, d: adagrad_added_group(r, world, d),
        "fsdp2-adagrad-added-group": lambda r, d: fsdp2_adagrad_added_group(r, world, d),
        "dcp-adagrad-stateless": lambda r, d: dcp_adagrad_stateless(r, world, d),
        "crash-edit-unstepped": lambda r, d: crash_edit_unstepped(r, world, d),
    }

    return run_in_dirs(rank, base, table, names)


# -- found by a 2-rank search over the dimensions a single-process search found buggy ---------


def adagrad_added_group(rank: int, world: int, tmp: str) -> None:
    """An Adagrad group added with add_param_group before the block: torch makes Adagrad's
    state in __init__ only, so the added group holds none until its first step, which fills
    its accumulators from the defaults' initial_accumulator_value. The shadow optimizer's
    own __init__ made zeros for it (its defaults' value): state_dict() listed state torch
    has not made, the first step started from 0 (side.bias 5e-3 off), and the exit left
    state for parameters torch never stepped."""
    from offload_helpers import compare_state_dicts

    kw = dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)

    def make(m):
        groups = groups_of(m)
        o = torch.optim.Adagrad(groups[:1], **kw)
        o.add_param_group(groups[1])
        return o

    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref_model)
    with tiermem.offload(opt, small_cfg(tmp, timeout=60), model=model):
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        # step 0 leaves the side branch unused: side.bias still has no state after it
        train_pair(rank, world, model, opt, ref_model, ref_opt, 1)
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2, first=1)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def fsdp2_adagrad_added_group(rank: int, world: int, tmp: str) -> None:
    """adagrad_added_group on fully_shard parameters (the shadow is built alike): the
    second layer's group, added before the block, starts from initial_accumulator_value
    at its first step (it was 2.weight 4e-3 off at step 0)."""
    kw = dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)

    def make(m):
        ps = list(m.parameters())
        o = torch.optim.Adagrad(ps[:2], **kw)
        o.add_param_group({"params": ps[2:]})
        return o

    model, ref_model = sharded_pair()
    opt, ref_opt = make(model), make(ref_model)
    g = torch.Generator().manual_seed(20 + rank)
    with tiermem.offload(opt, small_cfg(tmp, timeout=60)):
        sharded_steps(rank, world, model, opt, ref_model, ref_opt, g, 2)
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_close_tensor(p.full_tensor().detach(), q.detach(), f"rank {rank} {n}")
        st, sr = opt.state[p], ref_opt.state[q]
        assert set(st) == set(sr), (n, sorted(st), sorted(sr))
        assert float(st["step"]) == float(sr["step"]) == 2.0, n
        assert_close_tensor(st["sum"].full_tensor(), sr["sum"], f"rank {rank} {n} sum")


def dcp_adagrad_stateless(rank: int, world: int, tmp: str) -> None:
    """tiermem.dist.dcp between Adagrads built two ways: one given every group at
    construction (its __init__ makes every parameter's state: step 0, sum at
    initial_accumulator_value), one given the last group with add_param_group (no state
    for it until its first step). A load must leave the parameters holding state or not
    as the checkpoint says, as torch's load_state_dict of the state_dict does; it kept the
    loading optimizer's own: side.bias's first step started from the saved zeros (5e-3
    off), or state_dict() left out the saved state."""
    from offload_helpers import compare_state_dicts
    from tiermem.dist import dcp

    kw = dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)

    def make(m, added):
        groups = groups_of(m)
        if not added:
            return torch.optim.Adagrad(groups, **kw)
        o = torch.optim.Adagrad(groups[:1], **kw)
        o.add_param_group(groups[1])
        return o

    for n, added in enumerate((True, False)):
        model = Synthetic()
        ref_model = copy.deepcopy(model)
        opt, ref_opt = make(model, added), make(ref_model, added)
        ck = os.path.join(tmp, f"ck{n}")
        # step 0 leaves the side branch unused: side.bias is never stepped when saved
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, f"a{n}"), timeout=60),
                             model=model) as tm:
            train_pair(rank, world, model, opt, ref_model, ref_opt, 1)
            dcp.save(tm, ck)
        opt, saved = make(model, not added), copy.deepcopy(ref_opt.state_dict())
        ref_opt = make(ref_model, not added)
        ref_opt.load_state_dict(saved)
        with tiermem.offload(opt, small_cfg(os.path.join(tmp, f"b{n}"), timeout=60),
                             model=model) as tm:
            dcp.load(tm, ck)
            compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
            train_pair(rank, world, model, opt, ref_model, ref_opt, 2, first=1)
        compare_runs(model, opt, ref_model, ref_opt, exact=True)
        barrier()


def crash_edit_unstepped(rank: int, world: int, tmp: str) -> None:
    """A crash-consistent fp32 run whose weights are replaced (model.load_state_dict)
    before a step in which some parameters take no step (the side branch, unused at step
    3): the commit of that step kept their masters of before the load (a master was
    refreshed from the model's weights only by its parameter's update), so a resume put
    side.weight back as it was before it (0.27 off the uninterrupted run). One process
    had it too."""
    model, opt, ref_model, ref_opt = pair()
    cfg = small_cfg(tmp, timeout=60)
    cfg["swap"]["durability"] = "crash_consistent"
    other = Synthetic(seed=3).state_dict()
    try:
        with tiermem.offload(opt, cfg, model=model, name="edit"):
            train_pair(rank, world, model, opt, ref_model, ref_opt, 3)
            for m in (model, ref_model):
                with torch.no_grad():
                    m.load_state_dict(other)
            assert not side_used(3) and not used_side(3, rank)
            train_pair(rank, world, model, opt, ref_model, ref_opt, 1, first=3)
            raise _Stop()  # every rank keeps its share on disk, as a crash would
    except _Stop:
        pass
    barrier()
    model, opt = pair()[:2]
    with tiermem.offload(opt, cfg, model=model, name="edit", resume=True) as tm:
        assert tm.resumed_step == 4, tm.resumed_step
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert_same_tensor(p.detach(), q.detach(), f"rank {rank} resumed {n}")
