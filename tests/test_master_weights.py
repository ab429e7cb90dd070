"""optimizer.master_weights kahan / none against an fp32 master, over many steps.

The bitwise tests (tests/test_state_int8.py) hold every combination of weights and
moments to kernels.lowbit's reference; these check that the reference is the right
arithmetic: a bf16 (or fp16) model trained through tiermem.offload with fp32 moments follows
torch.optim.AdamW on an fp32 copy of the same weights fed the same gradients.

- kahan: weight + compensation term is the fp32 master up to the rounding of the term
  (8 bits below the weight's last bit): after T steps within 1e-3 of the distance the
  master moved, far closer than the bf16 weights alone can be.
- none: stochastic rounding adds, per step, an independent error of mean 0 and at most
  one ulp; after T steps its root mean square stays within sqrt(T) / 2 ulps (ulp of the
  larger of the start and end magnitude) and its mean near 0 (unbiased), where
  rounding to nearest (plain AdamW on bf16 weights) drifts.
docs/guide/numerics.md quotes these figures and bounds.
"""

from __future__ import annotations

import math

import pytest
import torch

import tiermem

from offload_helpers import config

T = 200
N = 32 * 1024
LR, WD = 1e-3, 0.1


def _start(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, generator=g) * 0.05).to(dtype)


def _grad(t: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + t)
    return (torch.randn(N, generator=g) * 1e-2 + 1e-3).to(dtype)


def _fp32_master(dtype: torch.dtype) -> torch.Tensor:
    p = torch.nn.Parameter(_start(dtype).float())
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD)
    for t in range(T):
        p.grad = _grad(t, dtype).float()
        opt.step()
    return p.detach()


def _offloaded(tmp_path, master: str, moments: str, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the low-precision weights, weight + Kahan term as state_dict()'s master_param)
    after T steps through tiermem.offload."""
    p = torch.nn.Parameter(_start(dtype))
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD)
    cfg = config(tmp_path, kernel="auto", host="64MiB")
    cfg["optimizer"].update(state_dtype=moments, master_weights=master)
    with tiermem.offload(opt, cfg):
        for t in range(T):
            p.grad = _grad(t, dtype)
            opt.step()
        eff = opt.state_dict()["state"][0]["master_param"]
    return p.detach(), eff


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unit in the last place of `dtype` (bf16 or fp16) at |x|."""
    bits, tiny = (7, 2.0 ** -126) if dtype == torch.bfloat16 else (10, 2.0 ** -14)
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(tiny))) - bits)


DTYPES = [torch.bfloat16, torch.float16]
_MASTERS: dict[torch.dtype, torch.Tensor] = {}


def _master(dtype: torch.dtype) -> torch.Tensor:
    if dtype not in _MASTERS:
        _MASTERS[dtype] = _fp32_master(dtype)
    return _MASTERS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kahan_with_fp32_moments_tracks_an_fp32_master(tmp_path, dtype):
    master = _master(dtype)
    weights, eff = _offloaded(tmp_path, "kahan", "fp32", dtype)
    moved = (master - _start(dtype).float()).norm()
    err = (eff - master).norm() / moved
    assert err < 1e-3, f"weight + Kahan term off the fp32 master by {err:.2e} of its path"
    # the compensation term is what keeps it there: the bf16 weights alone are further off
    assert (weights.float() - master).norm() / moved > 10 * err


@pytest.mark.parametrize("dtype", DTYPES)
def test_none_with_fp32_moments_stays_within_the_stochastic_rounding_bound(tmp_path, dtype):
    master = _master(dtype)
    weights, _ = _offloaded(tmp_path, "none", "fp32", dtype)
    start = _start(dtype).float()
    ulp = _ulp(torch.maximum(start.abs(), master.abs()), dtype)
    e = (weights.float() - master) / ulp
    rms = e.square().mean().sqrt().item()
    assert rms < math.sqrt(T) / 2, f"rms error {rms:.2f} ulp after {T} steps"
    # unbiased: the mean error is a small fraction of its spread (N elements average it)
    assert abs(e.mean().item()) < 0.05 * rms, (e.mean().item(), rms)
    if dtype == torch.float16:
        return  # plain AdamW on fp16 weights keeps fp16 moments: eps 1e-8 underflows to 0
    # rounding to nearest instead (plain AdamW on the bf16 weights) is biased
    p = torch.nn.Parameter(_start(dtype))
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD)
    for t in range(T):
        p.grad = _grad(t, dtype)
        opt.step()
    nearest = (p.detach().float() - master) / ulp
    assert abs(nearest.mean().item()) > 10 * abs(e.mean().item())
