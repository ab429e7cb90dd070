"""The SGD update on one partition's segments: one signature, several kernels.

Like kernels/adam.py: each kernel is a plain function with one keyword-only signature,
picked by `sgd_update(kernel=...)`. Tensors come as lists of segment views (params,
grads, momentum buffers, the buffers empty when momentum is 0); `first[i]`: segment i's
parameter takes its first step, so its buffer starts as this step's gradient.

"native" (native/rules.c) runs one pass per segment that updates the parameters and the
buffer and hashes the buffer (and, asked, the parameters) chunk by chunk while they are
in cache: it returns the CRC32C of each, so a record about to be written needs no
second pass. Its arithmetic is that of torch's fused CPU SGD's vector body (FusedSGDKernel.cpp),
which torch's for-loop and foreach SGD compute bitwise alike on the CPU for every
element; to match the fused kernel (`match="fused"`), the last numel % vector-width
elements of each tensor, which it updates in a separately compiled scalar loop that
rounds differently, are handed to torch's fused kernel itself (a parameter
is cut into segments at multiples of 1024 elements, so a segment's tail is its
parameter's). tests/test_native_rules.py holds it bitwise to the plain torch optimizer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.optim import sgd as _torch_sgd

from tiermem.kernels.native_rules import (check_native, crc_arrays, native_threads,
                                          refuse_checksums, tail_length, with_tail_crcs)
from tiermem._lib import ffi, lib


def sgd_native(*, params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
               first: list[bool], lr: float, momentum: float, dampening: float,
               weight_decay: float, nesterov: bool, maximize: bool,
               checksums: Sequence[str] = (), match: str = "fused",
               num_threads: int | None = None) -> list[dict[str, int]]:
    """tiermem's one-pass kernel; per segment {"momentum_buffer"/"params": CRC32C} of the
    arrays named in `checksums`, as the step left them (empty dicts without).

    match: the torch implementation to equal bitwise: "fused" (its scalar tail loop is
    run by torch), or "single_tensor" / "multi_tensor" (which round every element as the
    fused vector body does: the native pass covers all)."""
    if match not in ("fused", "single_tensor", "multi_tensor"):
        raise ValueError(f"match: {match!r}; expected fused, single_tensor or multi_tensor")
    k = len(params)
    with_buf = momentum != 0
    if with_buf and len(momentum_buffers) != k:
        raise ValueError(f"momentum_buffers: {len(momentum_buffers)} tensors for {k} params")
    if len(grads) != k or len(first) != k:
        raise ValueError(f"grads/first: {len(grads)}/{len(first)} entries for {k} params")
    mask = crc_arrays(checksums, state="momentum_buffer" if with_buf else None)
    threads = native_threads(num_threads)
    out = []
    for i in range(k):
        n = params[i].numel()
        check_native(params[i], f"params[{i}]", n)
        check_native(grads[i], f"grads[{i}]", n)
        buf = momentum_buffers[i] if with_buf else None
        if buf is not None:
            check_native(buf, f"momentum_buffers[{i}]", n)
        tail = tail_length(n) if match == "fused" else 0
        body = n - tail
        crcs = ffi.new("uint32_t[2]")
        rc = lib.tm_sgd_step(
            ffi.cast("float *", params[i].data_ptr()),
            ffi.NULL if buf is None else ffi.cast("float *", buf.data_ptr()),
            ffi.cast("const float *", grads[i].data_ptr()), body, float(lr), float(momentum),
            float(dampening), float(weight_decay), int(nesterov), int(maximize),
            int(first[i]), threads, mask, crcs if mask else ffi.NULL)
        if rc != 0:
            raise ValueError(f"tm_sgd_step refused its arguments (rc {rc})")
        if tail:
            torch._fused_sgd_([params[i][body:]], [grads[i][body:]],
                              [buf[body:]] if buf is not None else [],
                              weight_decay=weight_decay, momentum=momentum,
                              lr=float(lr),
                              dampening=dampening, nesterov=nesterov, maximize=maximize,
                              is_first_step=bool(first[i]), grad_scale=None, found_inf=None)
        out.append(with_tail_crcs(mask, crcs, body, {"momentum_buffer": buf,
                                                      "params": params[i]}))
    return out


def sgd_torch(impl: str) -> Callable[..., list[dict[str, int]] | None]:
    """torch's `_<impl>_sgd` behind the kernel signature (no checksums in its pass)."""
    fn = getattr(_torch_sgd, f"_{impl}_sgd")

    def run(*, params, grads, momentum_buffers, first, lr, momentum, dampening,
            weight_decay, nesterov, maximize, checksums=(), match=impl, num_threads=None):
        # (num_threads sizes tiermem's native pass; torch's kernels run on torch's count)
        refuse_checksums(impl, checksums)
        kw = dict(weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                  nesterov=nesterov, maximize=maximize, has_sparse_grad=False)
        if momentum == 0:
            fn(params, grads, [None] * len(params), None, None, **kw)
            return None
        if impl == "fused" and any(first) and not all(first):
            # the fused kernel takes all-first or none-first lists: run the two apart
            for want in (True, False):
                idx = [j for j, f in enumerate(first) if f == want]
                run(params=[params[j] for j in idx], grads=[grads[j] for j in idx],
                    momentum_buffers=[momentum_buffers[j] for j in idx],
                    first=[want] * len(idx), lr=lr, momentum=momentum, dampening=dampening,
                    weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
            return None
        # torch starts a buffer from the first gradient (not from zero): a segment at its
        # parameter's first step gets None, and the buffer torch made is copied in.
        given: list[Tensor | None] = [None if f else b for b, f in zip(momentum_buffers, first)]
        fn(params, grads, given, None, None, **kw)
        for j, f in enumerate(first):
            if f and given[j] is not momentum_buffers[j]:
                momentum_buffers[j].copy_(given[j])
        return None
    run.__name__ = f"sgd_{impl}"
    return run


KERNELS: dict[str, Callable[..., list[dict[str, int]] | None]] = {
    "native": sgd_native,
    "fused": sgd_torch("fused"),
    "single_tensor": sgd_torch("single_tensor"),
    "multi_tensor": sgd_torch("multi_tensor"),
}


def sgd_update(*, kernel: str, **kwargs) -> list[dict[str, int]] | None:
    """Run `kernel` ("native", "fused", "single_tensor" or "multi_tensor") on one partition;
    the native kernel's per-segment CRCs, else None."""
    return KERNELS[kernel](**kwargs)
