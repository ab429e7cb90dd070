"""Update rules, one per optimizer family; `rule_for(opt)` picks the one that runs it."""

from __future__ import annotations

import inspect

import torch

from tiermem.optim.rules.adam import AdamRule
from tiermem.optim.rules.base import Batch, PreparedUpdate, UnsupportedOptimizer, UpdateRule
from tiermem.optim.rules.generic import (AdafactorRule, MuonRule, ShadowRule, group_values,
                                         loose_state_keys, own_attributes, own_values,
                                         shadow_of_groups,
                                         shadow_optimizer)
from tiermem.optim.rules.torch_family import TORCH_RULES

# Rules for named classes; any other torch.optim.Optimizer gets the generic ShadowRule.
RULES: tuple[type[UpdateRule], ...] = (AdamRule, *TORCH_RULES, AdafactorRule, MuonRule)
# What a torch optimizer's update is made of: a subclass that redefines either has its own
# math, which a rule's kernels (torch's math) would skip.
MATH = ("step", "_init_group")


def _own_math(opt: torch.optim.Optimizer, base: type) -> str | None:
    """The first of MATH that `opt`'s class defines over `base`'s, if any. Unwrapped: torch
    wraps each class's step in a profiling hook of its own when the class is first
    instantiated (Optimizer._patch_step_function), so the attributes differ even when the
    function they wrap is the same."""
    def raw(cls: type, n: str) -> object:
        f = getattr(cls, n, None)
        return inspect.unwrap(f) if callable(f) else f
    return next((n for n in MATH if raw(type(opt), n) is not raw(base, n)), None)


def rule_class(opt: torch.optim.Optimizer) -> type[UpdateRule] | None:
    """The rule class that runs `opt` (ShadowRule for any other torch optimizer, including
    a subclass of a ruled class with math of its own: its own step() runs), or None."""
    for cls in RULES:
        base = next((b for b in cls.optimizers if isinstance(opt, b)), None)
        if base is not None and _own_math(opt, base) is None:
            return cls
    return ShadowRule if isinstance(opt, torch.optim.Optimizer) else None


def rule_for(opt: torch.optim.Optimizer, **options) -> UpdateRule:
    """The rule for `opt`'s class, checked against its groups; refuses what none runs."""
    cls = rule_class(opt)
    if cls is None:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for r in RULES
                          for c in r.optimizers)
        raise UnsupportedOptimizer(
            f"tiermem.offload supports {names} (and their subclasses), not "
            f"{type(opt).__module__}.{type(opt).__qualname__}")
    rule = cls(**options)
    rule.check(opt)
    return rule


__all__ = ["AdafactorRule", "AdamRule", "Batch", "MuonRule", "PreparedUpdate", "ShadowRule", "RULES", "UnsupportedOptimizer", "UpdateRule", "rule_class", "rule_for",
           "group_values", "loose_state_keys", "own_attributes", "own_values", "shadow_of_groups",
           "shadow_optimizer"]
