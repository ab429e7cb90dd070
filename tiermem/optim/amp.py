"""GradScaler's hand-over (torch.amp): what a tiered step does with a scaled step.

An optimizer that sets `_step_supports_amp_scaling` (torch's fused Adam, AdamW, SGD and
Adagrad do) gets its gradients from GradScaler still scaled: GradScaler.step sets
`optimizer.grad_scale` (None when the user's unscale_() already divided them) and
`optimizer.found_inf`, calls step(), and deletes both. torch's fused kernels then leave
everything as it was when found_inf is set, and otherwise divide each gradient by
grad_scale, writing the quotient back into p.grad, before the update. Ignoring the two
attributes would update with gradients 2**16 times too large, and with inf/NaN on the
steps GradScaler meant to skip.

A local step honours them before any rule or kernel runs (`apply`), so the native, fused
and matched kernels all see the gradients the fused kernel would. Where a step cannot
honour them it refuses (`refuse`), and tiermem claims the flag for the optimizer
(hooks.Installed.claim_amp) so that GradScaler hands it every step, skipped ones too,
instead of unscaling p.grad itself and deciding alone whether step() runs:
- pipeline.overlap_backward: backward already updated with the scaled gradients, and a
  step GradScaler skips would leave those updates in place;
- parameters.offload: the gradients are in the parameter tier, where GradScaler cannot
  look for infs (its own path stops with "No inf checks were recorded");
- distributed with grads: reduce_scatter: each rank's GradScaler sees only its own
  gradients, so ranks would disagree on skipping and the others wait in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from tiermem.errors import TierMemError


@dataclass(frozen=True)
class Handover:
    """One step's hand-over from GradScaler."""

    grad_scale: torch.Tensor | None  # divide every gradient by it first; None: unscaled
    found_inf: bool  # GradScaler found inf/NaN gradients: the step changes nothing


def handover(opt: torch.optim.Optimizer) -> Handover | None:
    """This step's hand-over, or None when GradScaler is not stepping the optimizer."""
    d = opt.__dict__
    if "grad_scale" not in d and "found_inf" not in d:
        return None
    found = d.get("found_inf")
    # GradScaler sums its per-device flags (a plain 0 when it found no gradients at all)
    return Handover(d.get("grad_scale"), bool(found) if found is not None else False)


def refuse(opt: torch.optim.Optimizer, setting: str, why: str) -> None:
    """Refuse a step GradScaler hands over where `setting` keeps tiermem from honouring
    it (`why`)."""
    if handover(opt) is not None:
        raise TierMemError(
            f"{type(opt).__name__} is stepped through a torch.amp.GradScaler (fp16 mixed "
            f"precision), which tiermem cannot honour with {setting}: {why}. Train in bf16, "
            f"which needs no GradScaler, or without {setting}")


def refuse_own_step(opt: torch.optim.Optimizer) -> None:
    """Refuse a hand-over to an optimizer run by its own step() (the generic path): tiermem
    honours it before the step (apply), and the optimizer's own step, which reads the same
    attributes from its shadows, would honour it again; nor can tiermem leave it to that
    step, whose way of unscaling (a quotient, a product with the reciprocal, in a kernel
    without writing p.grad) and of skipping it cannot know."""
    if handover(opt) is None:
        return
    name = f"{type(opt).__module__}.{type(opt).__qualname__}"
    raise TierMemError(
        f"{name} is stepped through a torch.amp.GradScaler that hands it the scale and the "
        f"inf flag (it sets _step_supports_amp_scaling) for its own step() to unscale the "
        f"gradients and skip: tiermem runs that step a partition at a time and cannot tell "
        f"how it unscales, so the result would not be the plain optimizer's. Set "
        f"optimizer._step_supports_amp_scaling = False before the first scaler.step() "
        f"(GradScaler then unscales and skips for it, as for any optimizer), or train in "
        f"bf16, which needs no GradScaler")


def apply(opt: torch.optim.Optimizer, scaled: Handover) -> bool:
    """Honour a hand-over before the step: True when GradScaler found inf/NaN gradients
    (the step is skipped: torch's fused step leaves the weights and the state as they
    were); else each gradient is divided by the scale in place, the quotient (not a
    product with the reciprocal, which rounds differently for a scale that is no power of
    two) that torch's fused kernels compute and write back into p.grad."""
    if scaled.found_inf:
        return True
    if scaled.grad_scale is not None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(scaled.grad_scale.to(p.grad.device))
    return False
