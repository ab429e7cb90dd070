"""Shared pieces of the tier-manager tests: small synthetic models, a training loop that
runs the same way with and without tiermem, tiermem configs, and bitwise comparisons.

The reference for every parity test is a plain torch optimizer on a deep copy of the same
model, fed the same batches; CPU forward/backward on identical weights gives identical
gradients, so any difference in the results comes from the optimizer step.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from adam_helpers import assert_bitwise

from tiermem.io import io_uring_status

_URING_OK, _URING_WHY = io_uring_status()


def backend_params() -> list:
    """pytest params for both backends; io_uring skipped where the kernel refuses it."""
    import pytest

    return [pytest.param("io_uring", marks=pytest.mark.skipif(not _URING_OK, reason=_URING_WHY)),
            pytest.param("threads")]


def available_backends() -> list[str]:
    return ["io_uring", "threads"] if _URING_OK else ["threads"]


# -- models ---------------------------------------------------------------------------


class Synthetic(nn.Module):
    """Embedding -> Linear -> tanh -> Linear with odd sizes, plus a side branch that only
    some steps use (so its parameters have grad None in the other steps)."""

    def __init__(self, vocab: int = 509, dim: int = 61, hidden: int = 1031, out: int = 33,
                 seed: int = 0) -> None:
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(seed)
            self.emb = nn.Embedding(vocab, dim)
            self.fc1 = nn.Linear(dim, hidden)
            self.fc2 = nn.Linear(hidden, out)
            self.side = nn.Linear(dim, out)
        self.vocab = vocab
        self.out = out

    def forward(self, tokens: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.emb(tokens).mean(1)
        y = self.fc2(torch.tanh(self.fc1(h)))
        if use_side:
            y = y + self.side(h)
        return y


def side_used(step: int) -> bool:
    """The side branch is used on steps 1, 4, 7, ... (never on the first)."""
    return step % 3 == 1


def make_batches(model: Synthetic, steps: int, *, micro: int = 1, seed: int = 1,
                 batch: int = 8, seq: int = 5) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`steps` lists of `micro` (tokens, target) micro-batches."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, model.vocab, (batch, seq), generator=g),
              torch.randn(batch, model.out, generator=g)) for _ in range(micro)]
            for _ in range(steps)]


def loss_of(model: Synthetic, tokens: torch.Tensor, target: torch.Tensor,
            use_side: bool) -> torch.Tensor:
    y = model(tokens, use_side)
    return (y.float() - target).square().mean()


def train(model: Synthetic, opt: torch.optim.Optimizer, batches, *, start: int = 0,
          clip: float | None = None, sched: Any = None, closure: bool = False,
          after_step: Callable[[int], None] | None = None) -> list[float]:
    """The loop both sides run: gradient accumulation over the micro-batches of a step,
    optional clipping, step (optionally through a closure), zero_grad, scheduler step."""
    losses = []
    for i, micro in enumerate(batches, start=start):
        use_side = side_used(i)

        def backward() -> torch.Tensor:
            total = torch.zeros(())
            for tokens, target in micro:
                loss = loss_of(model, tokens, target, use_side) / len(micro)
                loss.backward()
                total = total + loss.detach()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            return total

        if closure:
            def fn() -> torch.Tensor:
                return backward()
            loss = opt.step(fn)
        else:
            loss = backward()
            opt.step()
        losses.append(float(loss))
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if after_step is not None:
            after_step(i)
    return losses


# -- configs --------------------------------------------------------------------------


def config(swap: Path | str, *, backend: str = "threads", host: int | str = 0,
           partition_size: int | str = "64KiB", buffer_count: int = 3, prefetch_depth: int = 2,
           zigzag: bool = True, kernel: str = "match", placement: Sequence[dict] = (),
           block_size: int | str = "16KiB", queue_depth: int = 8,
           o_direct: Any = "auto", write_back: str = "deferred") -> dict:
    """A tiermem config dict; defaults are transfer-bound: tiny partitions, few buffers."""
    return {
        "swap": {"paths": [str(swap)]},
        "io": {"backend": backend, "queue_depth": queue_depth, "block_size": block_size,
               "o_direct": o_direct},
        "tiers": {"gpu": {"capacity": 0}, "host": {"capacity": host}},
        "pipeline": {"partition_size": partition_size, "buffer_count": buffer_count,
                     "prefetch_depth": prefetch_depth, "zigzag": zigzag,
                     "write_back": write_back},
        "placement": [dict(r) for r in placement],
        "optimizer": {"kernel": kernel},
    }


def swap_dir(swap: Path | str, name: str = "default") -> Path:
    return Path(swap) / f"tiermem-{name}"


# -- comparisons ----------------------------------------------------------------------


assert_same_tensor = assert_bitwise  # bitwise: the name most tests know it by


def assert_close_tensor(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Fused and unfused Adam evaluate the same formula with a different operation order
    # (and fused uses FMA), so they differ by a few ulps per step; 1e-5 relative / 1e-6
    # absolute after a handful of steps is far below any real error (a stale or wrong
    # partition differs by the size of an update, ~lr).
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def lowp_step(model, opt, ref_params, ref, micro, i, names, check=True):
    """One step of a low-precision model and of its fp32 reference (same grads, upcast);
    with `check`, the model's weights must be the reference's rounded to their dtype."""
    tokens, target = micro[0]
    loss_of(model, tokens, target, side_used(i)).backward()
    for p, r in zip(model.parameters(), ref_params):
        # the reference master weights get the same low-precision grads, upcast
        r.grad = None if p.grad is None else p.grad.float()
    opt.step()
    ref.step()
    if check:
        for n, p, r in zip(names, model.parameters(), ref_params):
            assert_same_tensor(p.detach(), r.detach().to(p.dtype), f"step {i}: weight {n}")
    opt.zero_grad()
    ref.zero_grad()


def has_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    return bool(opt.state.get(p))


def compare_runs(model: nn.Module, opt: torch.optim.Optimizer, ref_model: nn.Module,
                 ref_opt: torch.optim.Optimizer, *, exact: bool = True,
                 state_dtype: torch.dtype | None = None) -> None:
    """Every parameter and every state tensor of (model, opt) against the reference.

    state_dtype: cast the reference's state tensors to this dtype first (low-precision
    models, whose reference runs in fp32)."""
    check = assert_same_tensor if exact else assert_close_tensor
    pairs = list(zip(model.named_parameters(), ref_model.named_parameters()))
    assert len(pairs) == len(list(ref_model.parameters()))
    for (name, p), (_, q) in pairs:
        check(p.detach(), q.detach().to(p.dtype), f"param {name}")
        assert has_state(opt, p) == has_state(ref_opt, q), (
            f"{name}: state present {has_state(opt, p)} vs reference {has_state(ref_opt, q)}")
        if not has_state(ref_opt, q):
            continue
        st, sr = opt.state[p], ref_opt.state[q]
        assert set(st) == set(sr), f"{name}: state keys {sorted(st)} != {sorted(sr)}"
        for k in sr:
            a, b = st[k], sr[k]
            if k == "step":
                assert float(a) == float(b), f"{name}: step {float(a)} != {float(b)}"
                continue
            if state_dtype is not None:
                b = b.to(state_dtype)
            check(a, b, f"{name} state[{k!r}]")


def same_state_value(a, b, what: str, check=assert_bitwise) -> None:
    """One optimizer state value: a tensor by `check`, a number exactly, a dict
    (bitsandbytes nests its codes, maps and scales in one key) key by key, a list or tuple
    (SOAP's per-side matrices) item by item, a tensor subclass made of plain tensors
    (torchao's low-bit state) by what it is made of."""
    if hasattr(type(b), "__tensor_flatten__"):
        assert type(a) is type(b), f"{what}: {type(a).__name__} against {type(b).__name__}"
        names, context = b.__tensor_flatten__()
        assert a.__tensor_flatten__() == (names, context), f"{what}: made otherwise"
        for n in names:
            same_state_value(getattr(a, n), getattr(b, n), f"{what}.{n}", check)
    elif isinstance(b, dict):
        assert isinstance(a, dict) and set(a) == set(b), f"{what} keys"
        for k in b:
            same_state_value(a[k], b[k], f"{what}[{k!r}]", check)
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{what}: {a!r} against {b!r}"
        for n, (x, y) in enumerate(zip(a, b)):
            same_state_value(x, y, f"{what}[{n}]", check)
    elif isinstance(b, torch.Tensor) and b.dim() > 0:
        check(a, b, what)
    else:  # the step count, and per-parameter scalars
        assert float(a) == float(b), f"{what}: {a} != {b}"


def compare_state_dicts(sd: dict, ref_sd: dict, *, exact: bool = True) -> None:
    """Two torch-format optimizer state_dicts hold the same per-parameter state (and the
    same entries under keys that are no parameter: MADGRAD's state['k'])."""
    check = assert_same_tensor if exact else assert_close_tensor

    def same(a, b, what: str) -> None:
        same_state_value(a, b, what, check)

    assert set(sd["state"]) == set(ref_sd["state"])
    for i, sr in ref_sd["state"].items():
        st = sd["state"][i]
        if not isinstance(i, int):
            same(st, sr, f"state[{i!r}]")
            continue
        for k, b in sr.items():
            assert k in st, f"state[{i}] lacks {k!r}"
            same(st[k], b, f"state[{i}][{k!r}]")
    assert len(sd["param_groups"]) == len(ref_sd["param_groups"])
    for g, (a, b) in enumerate(zip(sd["param_groups"], ref_sd["param_groups"])):
        assert a["params"] == b["params"], f"param_groups[{g}]['params']"
        for k in b.keys() - {"params"}:
            assert k in a and a[k] == b[k], f"param_groups[{g}][{k!r}]: {a.get(k)} != {b[k]}"


def twin(model_cls: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """A model and an identical deep copy (the reference)."""
    m = model_cls()
    return m, copy.deepcopy(m)


def twin_optimizers(cls, kw: dict, sizes: Sequence[int], seed: int = 0):
    """(params, cls(params), reference params, cls(reference)): two optimizers over the
    same random 1-d parameters, one to tier and one to compare with."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=g) for n in sizes]
    ps = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.clone()) for t in init]
    return ps, cls(ps, **kw), ref, cls(ref, **kw)


def listdir(path: Path | str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.exists(path) else []


# -- scratch mounts ---------------------------------------------------------------------


import contextlib


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "1m"):
    """A fresh tmpfs of `size` on `where` for the duration; skips when it cannot be mounted.
    mode=0700: tiermem refuses swap paths others can write (a tmpfs root is 1777)."""
    from conftest import mounted

    with mounted(where, "tmpfs", f"size={size},mode=0700") as d:
        yield d
