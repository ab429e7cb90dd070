"""Update rules, one per optimizer family; `rule_for(opt)` picks the one that runs it."""

from __future__ import annotations

import torch

from tiermem.optim.rules.adam import AdamRule
from tiermem.optim.rules.base import Batch, PreparedUpdate, UnsupportedOptimizer, UpdateRule
from tiermem.optim.rules.generic import (AdafactorRule, MuonRule, ShadowRule, own_values,
                                         shadow_optimizer)
from tiermem.optim.rules.torch_family import TORCH_RULES

# Rules for named classes; any other torch.optim.Optimizer gets the generic ShadowRule.
RULES: tuple[type[UpdateRule], ...] = (AdamRule, *TORCH_RULES, AdafactorRule, MuonRule)


def rule_for(opt: torch.optim.Optimizer, **options) -> UpdateRule:
    """The rule for `opt`'s class, checked against its groups; refuses what none runs."""
    for cls in RULES:
        if isinstance(opt, cls.optimizers):
            rule = cls(**options)
            rule.check(opt)
            return rule
    if isinstance(opt, torch.optim.Optimizer):
        rule = ShadowRule(**options)
        rule.check(opt)
        return rule
    names = ", ".join(f"{c.__module__}.{c.__qualname__}" for r in RULES for c in r.optimizers)
    raise UnsupportedOptimizer(
        f"tiermem.offload supports {names} (and their subclasses), not "
        f"{type(opt).__module__}.{type(opt).__qualname__}")


__all__ = ["AdafactorRule", "AdamRule", "Batch", "MuonRule", "PreparedUpdate", "ShadowRule", "RULES", "UnsupportedOptimizer", "UpdateRule", "rule_for",
           "own_values", "shadow_optimizer"]
