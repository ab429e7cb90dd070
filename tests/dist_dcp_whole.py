"""What each rank runs in tests/test_dcp_whole.py, and the optimizers both use: tiermem.dist.dcp
checkpoints of rules that step whole parameters (torch's Adafactor and Muon, the generic
path) on ZeRO shares of whole parameters, loaded into another world size.

Every run (2 ranks, or one process) steps on the mean of the two ranks' gradients:
rank r's batches are make_batches(seed=10 + r), with dist_scenarios.used_side's side
branch; the mean of two is one sum in any order, so all runs are bitwise equal.
"""

from __future__ import annotations

import copy
import os

import torch

import tiermem
from tiermem.dist import dcp

from dist_scenarios import groups_of, local_backward, small_cfg, used_side
from offload_helpers import Synthetic, assert_same_tensor, loss_of, make_batches

STEPS, SAVED_AT = 5, 2
WORLD = 2


class LionLike(torch.optim.Optimizer):
    """Lion, written here: the sign of an interpolated momentum, one state tensor."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return None


class Nested(torch.optim.Optimizer):
    """State a checkpoint must carry whole: a list of two buffers (one a row statistic of
    another shape), a per-parameter count and number; a count kept in each group and one
    on the optimizer itself, both of which scale the step (lost, the steps after a load
    differ)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            lr = group["lr"] / (1 + 0.1 * group["k"]) * (1 + 0.01 * self.calls)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    rows = p.shape[:1] if p.dim() else ()
                    st["bufs"] = [torch.zeros_like(p), torch.zeros(rows)]
                    st["n"] = 0
                    st["scale"] = 1.0
                m, r = st["bufs"]
                st["n"] += 1
                st["scale"] = st["scale"] * 0.9 + 0.1
                m.mul_(0.9).add_(p.grad)
                sq = p.grad.square()
                r.mul_(0.5).add_(sq.reshape(sq.shape[0], -1).mean(1) if p.dim() else sq)
                p.add_(m, alpha=-lr * st["scale"] / st["n"])
        return None


def _schedulefree(m):
    from schedulefree import AdamWScheduleFree
    return AdamWScheduleFree(groups_of(m), lr=1e-2, warmup_steps=2, weight_decay=0.01)


OPTIMIZERS = {
    "adafactor": lambda m: torch.optim.Adafactor(groups_of(m), lr=0.01),
    "muon": lambda m: torch.optim.Muon([p for p in m.parameters() if p.dim() == 2], lr=0.01),
    "lion-like": lambda m: LionLike(groups_of(m), lr=1e-3, weight_decay=0.01),
    "nested": lambda m: Nested(groups_of(m)),
    "schedulefree": _schedulefree,
}


def missing(name: str) -> str | None:
    """The PyPI package optimizer `name` needs, if it is not installed."""
    import importlib.util

    if name == "schedulefree" and importlib.util.find_spec("schedulefree") is None:
        return "schedulefree"
    return None


def modes(opt) -> None:
    """schedule-free steps in training mode (its step() refuses to run outside it)."""
    if callable(getattr(type(opt), "train", None)):
        opt.train()


def every_batch() -> list[list]:
    return [make_batches(Synthetic(), STEPS, seed=10 + r) for r in range(WORLD)]


def mean_backward(model, batches, step: int) -> None:
    """In one process, the mean of the two ranks' gradients (as averaged() leaves them)."""
    for r in range(WORLD):
        for tokens, target in batches[r][step]:
            loss_of(model, tokens, target, used_side(step, r)).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(WORLD)


def plain_run(name: str) -> list[dict]:
    """The plain optimizer on the mean gradient from the start: the model's weights after
    each step."""
    model = Synthetic()
    opt = OPTIMIZERS[name](model)
    modes(opt)
    batches, out = every_batch(), []
    for i in range(STEPS):
        mean_backward(model, batches, i)
        opt.step()
        opt.zero_grad()
        out.append(copy.deepcopy(model.state_dict()))
    return out


def weights_equal(model, weights: dict, what: str) -> None:
    for n, p in model.named_parameters():
        assert_same_tensor(p.detach(), weights[n], f"{what}: {n}")


def one_process_save(name: str, tmp: str, ckpt: str) -> None:
    """A checkpoint of one process after SAVED_AT steps on the mean gradient."""
    model = Synthetic()
    opt = OPTIMIZERS[name](model)
    batches = every_batch()
    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        modes(opt)
        for i in range(SAVED_AT):
            mean_backward(model, batches, i)
            opt.step()
            opt.zero_grad()
        dcp.save(tm, ckpt)
    torch.save(model.state_dict(), ckpt + ".weights.pt")


def one_process_load(name: str, tmp: str, ckpt: str, partition_size: str = "128KiB") -> None:
    """A checkpoint (of any world size) loaded in one process, which steps on as the plain
    optimizer that never stopped."""
    plain = plain_run(name)
    model = Synthetic()
    model.load_state_dict(torch.load(ckpt + ".weights.pt"))
    opt = OPTIMIZERS[name](model)
    batches = every_batch()
    cfg = small_cfg(tmp)
    cfg["pipeline"]["partition_size"] = partition_size
    with tiermem.offload(opt, cfg) as tm:
        modes(opt)
        dcp.load(tm, ckpt)
        for i in range(SAVED_AT, STEPS):
            mean_backward(model, batches, i)
            opt.step()
            opt.zero_grad()
            weights_equal(model, plain[i], f"{name}, loaded in one process, step {i}")


def _rank_steps(rank, model, opt, batches, steps, plain, what) -> None:
    for i in steps:
        local_backward(model, batches[rank][i], i, rank)
        opt.step()
        opt.zero_grad()
        weights_equal(model, plain[i], f"rank {rank} {what} step {i}")


def two_ranks(rank: int, world: int, tmp: str, name: str, shared: str) -> None:
    """Save on 2 ranks after SAVED_AT steps (each rank writes the parameters it owns) and
    step on; load the one-process checkpoint `shared`/one-<name> (1 -> 2, other
    partitions): both step on as the plain optimizer."""
    assert world == WORLD
    plain = plain_run(name)
    batches = every_batch()
    model = Synthetic()
    opt = OPTIMIZERS[name](model)
    ckpt = os.path.join(shared, f"two-{name}")
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a"))) as tm:
        modes(opt)
        _rank_steps(rank, model, opt, batches, range(SAVED_AT), plain, "saving run")
        figures = dcp.save(tm, ckpt)
        # streamed: each record read once, in partition order, and at most one record copy
        # and one item of it held at once
        parts = tm.offloaded.parts
        assert figures["records_read"] == len(parts), (figures, len(parts))
        biggest = max((p.record_bytes for p in parts), default=0)
        assert figures["peak_live_bytes"] <= 2 * biggest, (figures, biggest)
        if rank == 0:
            torch.save(model.state_dict(), ckpt + ".weights.pt")
        _rank_steps(rank, model, opt, batches, range(SAVED_AT, STEPS), plain, "saving run")
    # (2 -> 2 with other partitions: the FSDP2 scenario; 2 -> 1: the test, in one process)
    source = os.path.join(shared, f"one-{name}")
    model = Synthetic()
    model.load_state_dict(torch.load(source + ".weights.pt"))
    opt = OPTIMIZERS[name](model)
    cfg = small_cfg(os.path.join(tmp, "b"))
    cfg["pipeline"]["partition_size"] = "128KiB"
    with tiermem.offload(opt, cfg) as tm:
        modes(opt)
        dcp.load(tm, source)
        _rank_steps(rank, model, opt, batches, range(SAVED_AT, STEPS), plain,
                    "loading one process's checkpoint")


def other_refused(rank: int, world: int, tmp: str, shared: str) -> None:
    """A checkpoint of another optimizer is refused on every rank, before any record
    changed."""
    import pytest

    model = Synthetic()
    opt = OPTIMIZERS["nested"](model)
    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        with pytest.raises(tiermem.TierMemError, match="holds the state of "
                                                       "dist_dcp_whole.LionLike"):
            dcp.load(tm, os.path.join(shared, "two-lion-like"))


def run_named(rank: int, world: int, base: str, names: list[str], shared: str) -> dict:
    from dist_harness import run_in_dirs

    table = {f"two-ranks-{n}": (lambda n: lambda r, d: two_ranks(r, world, d, n, shared))(n)
             for n in OPTIMIZERS}
    table["other-refused"] = lambda r, d: other_refused(r, world, d, shared)
    table["fsdp2"] = lambda r, d: fsdp2(r, world, d, shared)
    return run_in_dirs(rank, base, table, names)


# -- FSDP2: each parameter whole on its owner rank --------------------------------------


def fsdp2_model(weights: dict | None = None, shard: bool = True) -> torch.nn.Module:
    """dist_fsdp_whole.model_pair's model (1031 rows over 2 ranks: uneven shards; a last
    layer of one row), fully_shard'ed, with `weights`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(61, 1031), torch.nn.Tanh(),
                                torch.nn.Linear(1031, 33), torch.nn.Tanh(),
                                torch.nn.Linear(33, 1))
    if weights is not None:
        model.load_state_dict(weights)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4], model):
            fully_shard(layer)
    return model


def fsdp2_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(20 + rank)
    return [(torch.randn(8, 61, generator=g), torch.randn(8, 1, generator=g))
            for _ in range(STEPS)]


def fsdp2_adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.01)


def fsdp2_mean_step(model, opt, i: int) -> None:
    """Step i in one process on the mean of the two ranks' gradients."""
    for r in range(WORLD):
        x, y = fsdp2_data(r)[i]
        (model(x) - y).square().mean().backward()
    for p in model.parameters():
        p.grad.div_(WORLD)
    opt.step()
    opt.zero_grad()


def fsdp2_plain() -> list[dict]:
    """The plain optimizer on the mean gradient: the weights after each step."""
    model = fsdp2_model(shard=False)
    opt = fsdp2_adafactor(model.parameters())
    out = []
    for i in range(STEPS):
        fsdp2_mean_step(model, opt, i)
        out.append(copy.deepcopy(model.state_dict()))
    return out


def fsdp2_one_save(tmp: str, shared: str) -> None:
    """One process's checkpoint of the FSDP2 model's Adafactor (plain parameters), for the
    owners to load (1 -> 2)."""
    model = fsdp2_model(shard=False)
    opt = fsdp2_adafactor(model.parameters())
    ckpt = os.path.join(shared, "one-fsdp2-adafactor")
    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        for i in range(SAVED_AT):
            fsdp2_mean_step(model, opt, i)
        dcp.save(tm, ckpt)
    torch.save(model.state_dict(), ckpt + ".weights.pt")


def fsdp2(rank: int, world: int, tmp: str, shared: str) -> None:
    """Adafactor over fully_shard parameters: each owner writes its parameters' whole state;
    the checkpoint loads on 2 ranks (other partitions, other owners' records) and, in the
    test, in one process; every run steps on as the plain optimizer."""
    plain = fsdp2_plain()
    data = fsdp2_data(rank)
    ckpt = os.path.join(shared, "fsdp2-adafactor")

    def steps(model, opt, first: int, what: str) -> None:
        for i in range(first, STEPS):
            x, y = data[i]
            (model(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
            for n, p in model.named_parameters():
                assert_same_tensor(p.full_tensor().detach(), plain[i][n],
                                   f"rank {rank} {what} step {i}: {n}")
            if i + 1 == SAVED_AT and what == "saving run":
                return

    model = fsdp2_model()
    opt = fsdp2_adafactor(model.parameters())
    with tiermem.offload(opt, small_cfg(os.path.join(tmp, "a"))) as tm:
        assert tm.plan()["mode"] == "fsdp2"
        steps(model, opt, 0, "saving run")
        dcp.save(tm, ckpt)
        weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(weights, ckpt + ".weights.pt")
        steps(model, opt, SAVED_AT, "saving run, on")
    for source, size in ((ckpt, "128KiB"), (os.path.join(shared, "one-fsdp2-adafactor"),
                                            "64KiB")):
        torch.distributed.barrier()  # rank 0 wrote the weights
        model = fsdp2_model(torch.load(source + ".weights.pt"))
        opt = fsdp2_adafactor(model.parameters())
        cfg = small_cfg(os.path.join(tmp, f"load-{size}"))
        cfg["pipeline"]["partition_size"] = size
        with tiermem.offload(opt, cfg) as tm:
            dcp.load(tm, source)
            steps(model, opt, SAVED_AT, f"loading {os.path.basename(source)}")


def fsdp2_one_process(tmp: str, shared: str) -> None:
    """The FSDP2 ranks' checkpoint in one process (plain parameters)."""
    plain = fsdp2_plain()
    ckpt = os.path.join(shared, "fsdp2-adafactor")
    model = fsdp2_model(torch.load(ckpt + ".weights.pt"), shard=False)
    opt = fsdp2_adafactor(model.parameters())
    with tiermem.offload(opt, small_cfg(tmp)) as tm:
        dcp.load(tm, ckpt)
        for i in range(SAVED_AT, STEPS):
            fsdp2_mean_step(model, opt, i)
            weights_equal(model, plain[i], f"FSDP2's checkpoint in one process, step {i}")
