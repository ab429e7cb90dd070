"""torch's gradient clipping over gradients it cannot see in p.grad: the parameter tier's,
and the averaged ones of distributed.grads: reduce_scatter (tiermem/dist/clip.py).

With parameters.offload a parameter's gradient lives in the tier, not in p.grad, so
`torch.nn.utils.clip_grad_norm_` (what Lightning, Accelerate and the Hugging Face
Trainer call for the user) would find no gradient there and clip nothing: the run
would go on unclipped with nothing said (Accelerate's `Accelerator.clip_grad_norm_`,
which the Trainer calls, reads p.grad itself). While a block with a parameter tier is
open, torch.nn.utils' clip_grad_norm_ and clip_grad_value_ are wrapped, and
Accelerator.clip_grad_norm_ where Accelerate is loaded:

- a call that names a parameter an open block holds goes to that block (the Clipper),
  which clips what it holds or raises a TierMemError that says what to do. The
  parameter tier: clip_grad_norm_ over every parameter of the tier that has a gradient
  (and no other parameter with one) is the tier's own clip (`tm.clip_grad_norm_`: the
  global 2-norm of the stored gradients, the coefficient applied as the step reads
  each one), the same bits as torch's over those gradients in memory; any other call
  (part of them, beside parameters with gradients of their own, clip_grad_value_) is
  refused;
- a call that names none of them is torch's own, unchanged.

The wrappers replace the module (and class) attributes, so code that calls
`torch.nn.utils.<name>` (or `torch.nn.utils.clip_grad.<name>`, or the accelerator's
method) at call time is covered; a reference taken before the block (`from
torch.nn.utils import clip_grad_norm_`) is not, nor is a norm computed from p.grad by
hand.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.nn.utils.clip_grad as _clip_grad_module


MODULES = (torch.nn.utils, _clip_grad_module)  # torch.nn.utils re-exports clip_grad's


class Clipper(Protocol):
    """An open block that holds gradients torch's clipping cannot see (a parameter tier's,
    or the averaged ones of distributed.grads: reduce_scatter), as the wrappers see it."""

    def held(self, p: torch.Tensor) -> bool: ...
    def clip_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                  error_if_nonfinite: bool, what: str) -> torch.Tensor: ...
    def clip_value(self, params: list[torch.Tensor], clip_value: float, what: str) -> None: ...


# The open blocks' tiers, innermost last.
_OPEN: list[Clipper] = []


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _owner(params: list[torch.Tensor]) -> Clipper | None:
    for clipper in reversed(_OPEN):
        if any(clipper.held(p) for p in params):
            return clipper
    return None


def _tier_clip(params: list[torch.Tensor], max_norm: float, norm_type: float,
               error_if_nonfinite: bool, what: str) -> torch.Tensor | None:
    """The clip of the block holding `params`' gradients, or None where no block holds any."""
    clipper = _owner(params)
    if clipper is None:
        return None
    return clipper.clip_norm(params, max_norm, float(norm_type), error_if_nonfinite, what)


def _clip_grad_norm_(original: Callable[..., Any], parameters: Any, max_norm: float,
                     norm_type: float = 2.0, error_if_nonfinite: bool = False,
                     foreach: bool | None = None) -> torch.Tensor:
    params = _as_list(parameters)
    total = _tier_clip(params, max_norm, norm_type, error_if_nonfinite,
                       "torch.nn.utils.clip_grad_norm_")
    if total is None:
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return total


def _accelerator_clip_grad_norm_(original: Callable[..., Any], accelerator: Any,
                                 parameters: Any, max_norm: float,
                                 norm_type: float = 2) -> torch.Tensor:
    # Accelerate (1.x) computes the norm from p.grad itself, not through torch's
    # clip_grad_norm_; the Hugging Face Trainer clips through it.
    params = _as_list(parameters)
    total = _tier_clip(params, max_norm, norm_type, False, "Accelerator.clip_grad_norm_")
    if total is None:
        return original(accelerator, params, max_norm, norm_type)
    return total


def _clip_grad_value_(original: Callable[..., Any], parameters: Any, clip_value: float,
                      foreach: bool | None = None) -> None:
    params = _as_list(parameters)
    clipper = _owner(params)
    if clipper is not None:
        return clipper.clip_value(params, clip_value, "torch.nn.utils.clip_grad_value_")
    return original(params, clip_value, foreach)


def _targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    """(owner, attribute, router) of every clipping function wrapped: torch.nn.utils' (also
    under torch.nn.utils.clip_grad), and Accelerate's method where Accelerate is loaded."""
    out = [(module, "clip_grad_norm_", _clip_grad_norm_) for module in MODULES]
    out += [(module, "clip_grad_value_", _clip_grad_value_) for module in MODULES]
    accelerator = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    if accelerator is not None and callable(getattr(accelerator, "clip_grad_norm_", None)):
        out.append((accelerator, "clip_grad_norm_", _accelerator_clip_grad_norm_))
    return out


def _wrapped(route: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return route(original, *args, **kwargs)
    return wrapper


_INHERITED = object()  # the owner had no attribute of its own (a method of a base class)
# What open_tier replaced, to put back: (owner, attribute, original).
_REPLACED: list[tuple[Any, str, Any]] = []


def open_tier(clipper: Clipper) -> None:
    """`clipper`'s block opened: the clipping functions route to it (wrapped at the first
    open block)."""
    if not _OPEN:
        for owner, name, route in _targets():
            _REPLACED.append((owner, name, vars(owner).get(name, _INHERITED)))
            setattr(owner, name, _wrapped(route, getattr(owner, name)))
    _OPEN.append(clipper)


def close_tier(clipper: Clipper) -> None:
    """`clipper`'s block is over (idempotent): the functions are their own again once no
    block is open."""
    if clipper in _OPEN:
        _OPEN.remove(clipper)
    if not _OPEN:
        while _REPLACED:
            owner, name, original = _REPLACED.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
