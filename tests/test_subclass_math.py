"""Subclasses of the optimizers tiermem has rules for.

A rule runs torch's math for its classes (tiermem's kernels, or torch's own functions on
the records); a subclass that redefines `step` or `_init_group` has math of its own,
which those kernels would skip: such a subclass must run its own step (the generic path)
and end bitwise equal to its plain run. A subclass that only changes `__init__` (as
torch's own AdamW over Adam) keeps its rule. Table-driven over the classes, state on NVMe,
on both I/O backends.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from tiermem.errors import TierMemError
from tiermem.optim.rules import AdamRule, ShadowRule, rule_for
from tiermem.optim.rules.torch_family import AdagradRule, SGDRule

from offload_helpers import (Synthetic, available_backends, compare_runs, config,
                             make_batches, train)


def _doubled(opt: torch.optim.Optimizer) -> None:
    for g in opt.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                p.grad.mul_(2)


class NoisySGD(torch.optim.SGD):
    """A step of its own: the gradients doubled before torch's step."""

    @torch.no_grad()
    def step(self, closure=None):
        _doubled(self)
        return super().step(closure)


class CappedAdamW(torch.optim.AdamW):
    """An _init_group of its own: the gradients clamped as torch's step gathers them."""

    def _init_group(self, group, params, grads, *args):
        out = super()._init_group(group, params, grads, *args)
        for g in grads:
            g.clamp_(-1e-3, 1e-3)
        return out


class DoubledAdagrad(torch.optim.Adagrad):
    @torch.no_grad()
    def step(self, closure=None):
        _doubled(self)
        return super().step(closure)


class DefaultsAdamW(torch.optim.AdamW):
    """Only __init__ changes: torch's math, the Adam rule."""

    def __init__(self, params, **kw):
        super().__init__(params, **{"weight_decay": 0.05, **kw})


CASES = {
    "sgd-own-step": (NoisySGD, dict(lr=0.05, momentum=0.9), ShadowRule),
    "adamw-own-init-group": (CappedAdamW, dict(lr=0.01), ShadowRule),
    "adagrad-own-step": (DoubledAdagrad, dict(lr=0.05), ShadowRule),
    "adamw-own-init": (DefaultsAdamW, dict(lr=0.01), AdamRule),
    "sgd-plain": (torch.optim.SGD, dict(lr=0.05, momentum=0.9), SGDRule),
    "adagrad-plain": (torch.optim.Adagrad, dict(lr=0.05), AdagradRule),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_rule_of_a_subclass(name):
    cls, kw, rule = CASES[name]
    opt = cls(Synthetic().parameters(), **kw)
    assert type(rule_for(opt)) is rule


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_subclass_equals_its_plain_run(tmp_path, backend, name):
    cls, kw, _ = CASES[name]
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref_model.parameters(), **kw)
    batches = make_batches(model, 4, seed=3)
    with tiermem.offload(opt, config(tmp_path, backend=backend)):
        train(model, opt, batches)
        sd = opt.state_dict()
    train(ref_model, ref_opt, batches)
    compare_runs(model, opt, ref_model, ref_opt)
    # the state_dict taken inside the block is torch's, and a plain twin steps on from it
    twin = cls(copy.deepcopy(model).parameters(), **kw)
    twin.load_state_dict(sd)
    assert set(sd["state"]) == set(ref_opt.state_dict()["state"])


def test_master_weights_refuse_an_adam_subclass_with_its_own_math(tmp_path):
    model = Synthetic().to(torch.bfloat16)
    opt = CappedAdamW(model.parameters(), lr=0.01)
    cfg = config(tmp_path)
    cfg["optimizer"]["master_weights"] = "kahan"
    cfg["optimizer"]["kernel"] = "auto"
    with pytest.raises(TierMemError, match="master_weights kahan runs Adam/AdamW only"):
        with tiermem.offload(opt, cfg):
            pass
