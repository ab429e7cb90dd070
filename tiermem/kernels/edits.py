"""The fp32 master of a low-precision weight takes the weight's elements changed since a
step wrote it from the master (native/edits.c): the rule a step applies to a model's
weights edited between steps (optim/offloaded.py, take_edits)."""

from __future__ import annotations

import torch
from torch import Tensor

from tiermem._lib import ffi, lib
from tiermem.kernels.native_rules import native_threads

_CODES = {torch.bfloat16: 1, torch.float16: 2}


def take_edits(master: Tensor, weights: Tensor, *, threads: int | None = None) -> int:
    """`master` (fp32) takes each element of `weights` that is not what it rounds to
    (nearest even), compared as values as torch's `!=` compares them; fp32 weights are
    taken whole. `weights` may be on another device (a device model's, updated on the
    host). Returns the elements taken (all of them for fp32 weights), or -1 for a master
    on a device, where counting them would make the host wait for the device."""
    if weights.dtype == master.dtype:
        master.copy_(weights)
        return master.numel()
    if master.numel() == 0:
        return 0
    w = weights.to(master.device)
    code = _CODES.get(w.dtype)
    if master.is_cpu and code is not None and master.dtype == torch.float32 \
            and master.is_contiguous() and w.is_contiguous():
        got = lib.tm_take_edits(ffi.cast("float *", master.data_ptr()),
                                ffi.cast("uint16_t *", w.data_ptr()), master.numel(), code,
                                native_threads(threads))
        if got < 0:
            raise ValueError(f"tm_take_edits rejected its arguments ({got})")
        return int(got)
    changed = w != master.to(w.dtype)  # (a device's master: its kernels are fast enough)
    master.copy_(torch.where(changed, w.to(master.dtype), master))
    return int(changed.sum()) if master.is_cpu else -1


def keep_kahan_terms(comp: Tensor, weights: Tensor) -> None:
    """An edited low-precision weight's Kahan terms (master_weights kahan: what the fp32
    value adds to the weight) kept only where they still fit it: where the weight plus its
    term rounds to the weight, as every term a step writes does but one at an exact tie
    (half a spacing, the weight odd). Where an edit moved the weight (a mask to 0, a clamp,
    a model loaded after the optimizer's state), the term belonged to the weight of before
    and is dropped: the edited weight is the value, as it is for the plain optimizer."""
    comp.masked_fill_((weights.float() + comp.float()).to(weights.dtype) != weights, 0)
