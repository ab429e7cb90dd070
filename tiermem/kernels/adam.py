"""The Adam/AdamW update on one partition's segments: one signature, several kernels.

Like torch/optim/adam.py, each kernel is a plain function with one keyword-only
signature, picked by `adam_update(kernel=...)`. Tensors come as lists of
segment views: fp32 parameters (the model's own, or master copies in the
record), gradients of the same dtype and device, and the state views. `steps`
hold each segment's step count *after* this step's increment; several
segments of one parameter share one step tensor. `torch_tails` gives, per segment, how
many of its last elements torch's fused kernel would run in its scalar loop
(kernels.native_adam.tail_len): the native kernel gives them that loop's arithmetic;
torch's own kernels have their own and ignore it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.optim import adam as _torch_adam


def adam_fused(*, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor],
               lr: float | Tensor, beta1: float, beta2: float, eps: float,
               weight_decay: float, amsgrad: bool, maximize: bool,
               decoupled_weight_decay: bool, weights_out: list[Tensor | None] | None = None,
               checksums: Sequence[str] = (), rounding: str | None = None,
               seeds: list[int] | None = None, offsets: list[int] | None = None,
               num_threads: int | None = None, torch_tails: list[int] | None = None) -> None:
    """torch's fused Adam kernel (one pass per tensor, vectorised, threaded on torch's
    thread count: num_threads sizes tiermem's native pass only)."""
    _refuse_in_pass("fused", weights_out, checksums, rounding)
    fn = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    if steps and steps[0].device != params[0].device:
        # torch's fused CUDA kernels read the step counts on the device (a fused torch
        # optimizer keeps them there); tiermem keeps them on the host.
        steps = steps_on(params[0].device, steps)
    fn(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
       amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
       maximize=maximize, grad_scale=None, found_inf=None)


def steps_on(device: torch.device, steps: list[Tensor]) -> list[Tensor]:
    """The host step counts as fp32 scalars on `device`, made there by fill kernels queued
    on the current stream: a copy from pageable host memory would make the host wait for
    that stream to drain (torch copies pageable memory synchronously)."""
    values = [float(s) for s in steps]
    if all(v == values[0] for v in values):  # the usual case: one fill for the partition
        return list(torch.full((len(values),), values[0], device=device).unbind())
    return [torch.full((), v, device=device) for v in values]


def _torch_impl(impl: Callable) -> Callable:
    def run(*, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
            exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor],
            lr: float | Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
            amsgrad: bool, maximize: bool, decoupled_weight_decay: bool,
            weights_out: list[Tensor | None] | None = None, checksums: Sequence[str] = (),
            rounding: str | None = None, seeds: list[int] | None = None,
            offsets: list[int] | None = None, num_threads: int | None = None,
            torch_tails: list[int] | None = None) -> None:
        # (num_threads sizes tiermem's native pass; torch's loops run on torch's count)
        _refuse_in_pass(impl.__name__, weights_out, checksums, rounding)
        # torch's own loops increment the steps they are given: hand them
        # private copies of the count before this step.
        before = [s - 1 for s in steps]
        impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], before,
             grad_scale=None, found_inf=None, amsgrad=amsgrad, has_complex=False, beta1=beta1,
             beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
             capturable=False, differentiable=False,
             decoupled_weight_decay=decoupled_weight_decay)
    run.__doc__ = f"torch's {impl.__name__} on the segments (what an unfused optimizer runs)."
    return run


adam_single_tensor = _torch_impl(_torch_adam._single_tensor_adam)
adam_multi_tensor = _torch_impl(_torch_adam._multi_tensor_adam)


def adam_native(*, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor],
                lr: float | Tensor, beta1: float, beta2: float, eps: float,
                weight_decay: float, amsgrad: bool, maximize: bool,
                decoupled_weight_decay: bool, weights_out: list[Tensor | None] | None = None,
                checksums: Sequence[str] = (), rounding: str | None = None,
                seeds: list[int] | None = None, offsets: list[int] | None = None,
                num_threads: int | None = None,
                torch_tails: list[int] | None = None) -> list[dict[str, int]] | None:
    """tiermem's own C kernel (tiermem.kernels.native_adam): torch fused's update (bit for
    bit, given torch_tails where torch_tail_width knows torch's scalar loop; else within
    1e-6 relative) in one SIMD pass per contiguous run, on CPU tensors; grads may also be
    bf16 or fp16.

    In the same pass it can also (the in-pass options, which only this kernel has) write
    each segment's low-precision model weights (weights_out[i], rounded to nearest even
    from the fp32 params[i]), return the CRC32C of the arrays named in `checksums` per
    segment, and store bf16 moments rounded as `rounding` says, drawing segment i's
    stochastic bits from stream `seeds[i]` at `offsets[i]`. With checksums or rounding it
    returns one {array: CRC32C} per segment (empty without checksums); else None.
    num_threads: the pass's threads (None: torch's count)."""
    from tiermem.kernels import native_adam as impl  # the native module, loaded on first use

    if weights_out is not None and all(w is None for w in weights_out):
        weights_out = None  # an fp32 model's own weights: nothing to write besides them
    if not checksums and rounding is None:
        # One C call per run of segments that lie end to end (a host record's state always
        # does; the model's weights and grads often do), low-precision weights out or not:
        # each call hands its work to the kernel's threads and waits for the last of them.
        impl.adam_native(params=params, grads=grads, exp_avgs=exp_avgs,
                         exp_avg_sqs=exp_avg_sqs, max_exp_avg_sqs=max_exp_avg_sqs,
                         steps=steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                         decoupled_weight_decay=decoupled_weight_decay,
                         weights_out=weights_out, num_threads=num_threads,
                         torch_tails=torch_tails)
        return None
    rounded = {} if rounding is None else {"rounding": rounding}
    out = []
    for i, master in enumerate(params):
        if rounding is not None:
            rounded.update(seed=seeds[i], offset=offsets[i])
        out.append(impl.adam_fused_mixed(
            master=master, grad=grads[i], exp_avg=exp_avgs[i], exp_avg_sq=exp_avg_sqs[i],
            max_exp_avg_sq=max_exp_avg_sqs[i] if amsgrad else None,
            weight_out=weights_out[i] if weights_out is not None else None, step=steps[i],
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
            checksums=checksums, num_threads=num_threads,
            torch_tail=torch_tails[i] if torch_tails is not None else 0, **rounded))
    return out


def _refuse_in_pass(kernel: str, weights_out: list | None, checksums: Sequence[str],
                    rounding: str | None) -> None:
    """torch's kernels update only: asking them for more would silently drop it."""
    asked = [name for name, on in (("weights_out", weights_out is not None),
                                   ("checksums", bool(checksums)),
                                   ("rounding", rounding is not None)) if on]
    if asked:
        raise ValueError(f"kernel {kernel!r} cannot do {', '.join(asked)} in its pass; only "
                         "the native kernel can")


KERNELS: dict[str, Callable[..., None]] = {
    "fused": adam_fused,
    "single_tensor": adam_single_tensor,
    "multi_tensor": adam_multi_tensor,
    "native": adam_native,
}


def kernel_matching(group: dict, device: torch.device) -> str:
    """The kernel a plain torch Adam/AdamW with this group's flags would run on `device`."""
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:  # torch defaults to foreach on CUDA only
        foreach = device.type == "cuda"
    return "multi_tensor" if foreach else "single_tensor"


def adam_update(*, kernel: str, **kwargs) -> list[dict[str, int]] | None:
    """Run `kernel` ("fused", "single_tensor", "multi_tensor" or "native") on one partition;
    what the native kernel's in-pass options return (see adam_native), else None."""
    return KERNELS[kernel](**kwargs)
