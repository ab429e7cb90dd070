"""The Adagrad update on one partition's segments: one signature, several kernels.

Like kernels/adam.py: each kernel is a plain function with one keyword-only signature,
picked by `adagrad_update(kernel=...)`. `steps` hold each segment's step count after
this step's increment (torch's functions are handed private copies: they increment).

"native" (native/rules.c) updates the parameters and the sums in one pass and hashes the
sums (and, asked, the parameters) chunk by chunk while in cache, returning the CRC32C of
each. Its arithmetic is that of torch's fused CPU Adagrad (FusedAdagradKernel.cpp)
bitwise; the last numel % vector-width elements of each tensor, which torch's fused
kernel updates in a separately compiled scalar loop, are handed to torch's fused kernel.
torch's for-loop and foreach Adagrad round differently (addcdiv, a few elements in a
thousand differ by an ulp or two), so "match" runs the native kernel only for fused
groups (see rules/torch_family.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.optim import adagrad as _torch_adagrad

from tiermem.kernels.native_rules import (check_native, crc_arrays, native_threads,
                                          refuse_checksums, tail_length, with_tail_crcs)
from tiermem._lib import ffi, lib


def adagrad_native(*, params: list[Tensor], grads: list[Tensor], state_sums: list[Tensor],
                   steps: list[Tensor], lr: float, lr_decay: float, weight_decay: float,
                   eps: float, maximize: bool, checksums: Sequence[str] = (),
                   num_threads: int | None = None) -> list[dict[str, int]]:
    """tiermem's one-pass kernel; per segment {"sum"/"params": CRC32C} of the arrays named
    in `checksums`, as the step left them (empty dicts without)."""
    k = len(params)
    for name, lst in (("grads", grads), ("state_sums", state_sums), ("steps", steps)):
        if len(lst) != k:
            raise ValueError(f"{name}: {len(lst)} entries for {k} params")
    mask = crc_arrays(checksums, state="sum")
    threads = native_threads(num_threads)
    out = []
    for i in range(k):
        n = params[i].numel()
        check_native(params[i], f"params[{i}]", n)
        check_native(grads[i], f"grads[{i}]", n)
        check_native(state_sums[i], f"state_sums[{i}]", n)
        step = float(steps[i])
        tail = tail_length(n)
        body = n - tail
        crcs = ffi.new("uint32_t[2]")
        rc = lib.tm_adagrad_step(
            ffi.cast("float *", params[i].data_ptr()),
            ffi.cast("float *", state_sums[i].data_ptr()),
            ffi.cast("const float *", grads[i].data_ptr()), body, float(lr), float(lr_decay),
            float(weight_decay), float(eps), step, int(maximize), threads, mask,
            crcs if mask else ffi.NULL)
        if rc != 0:
            raise ValueError(f"tm_adagrad_step refused its arguments (step {step}, rc {rc})")
        if tail:
            torch._fused_adagrad_([params[i][body:]], [grads[i][body:]],
                                  [state_sums[i][body:]],
                                  [torch.tensor(step, dtype=torch.float32)], lr=float(lr),
                                  lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                                  maximize=maximize, grad_scale=None, found_inf=None)
        out.append(with_tail_crcs(mask, crcs, body, {"sum": state_sums[i],
                                                      "params": params[i]}))
    return out


def adagrad_torch(impl: str) -> Callable[..., None]:
    """torch's `_<impl>_adagrad` behind the kernel signature (no checksums in its pass)."""
    fn = getattr(_torch_adagrad, f"_{impl}_adagrad")

    def run(*, params, grads, state_sums, steps, lr, lr_decay, weight_decay, eps, maximize,
            checksums=(), num_threads=None):
        # (num_threads sizes tiermem's native pass; torch's kernels run on torch's count)
        refuse_checksums(impl, checksums)
        before = [s - 1 for s in steps]  # torch increments the counts it is given
        fn(params, grads, state_sums, before, None, None, has_sparse_grad=False,
           differentiable=False, has_complex=False, lr=lr, weight_decay=weight_decay,
           lr_decay=lr_decay, eps=eps, maximize=maximize)
    run.__name__ = f"adagrad_{impl}"
    return run


KERNELS: dict[str, Callable[..., list[dict[str, int]] | None]] = {
    "native": adagrad_native,
    "fused": adagrad_torch("fused"),
    "single_tensor": adagrad_torch("single_tensor"),
    "multi_tensor": adagrad_torch("multi_tensor"),
}


def adagrad_update(*, kernel: str, **kwargs) -> list[dict[str, int]] | None:
    """Run `kernel` ("native", "fused", "single_tensor" or "multi_tensor") on one
    partition; the native kernel's per-segment CRCs, else None."""
    return KERNELS[kernel](**kwargs)
