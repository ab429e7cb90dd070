"""`tiermem.offload` given a wrapper it does not know: refused, naming the attribute that
holds the inner optimizer (`.optimizer`, or any other).

No framework is needed: the wrappers are stand-ins. (Accelerate's and Lightning's own
wrappers are tested against the real packages in tests/test_integration_*.py.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import tiermem
from tiermem.optim.hooks import installed
from tiermem.optim.rules import UnsupportedOptimizer
from tiermem.optim.wrappers import unwrap

from offload_helpers import config


class Holder:
    """A wrapper that is no optimizer itself."""

    def __init__(self, opt):
        self.optimizer = opt

    def step(self):
        self.optimizer.step()


class OptimizerWrapper(torch.optim.Optimizer):
    """A wrapper that derives from torch's Optimizer, as AcceleratedOptimizer does."""

    def __init__(self, opt):
        self.optimizer = opt

    @property
    def param_groups(self):
        return self.optimizer.param_groups


@pytest.mark.parametrize("wrapper", [Holder, OptimizerWrapper])
def test_unknown_wrapper_is_refused_naming_optimizer(tmp_path, wrapper):
    opt = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    with pytest.raises(UnsupportedOptimizer, match=r"wrapper\.optimizer") as err:
        with tiermem.offload(wrapper(opt), config(tmp_path)):
            pass
    assert wrapper.__qualname__ in str(err.value) and "AdamW" in str(err.value)
    assert installed(opt) is None


def test_plain_optimizer_is_not_unwrapped(tmp_path):
    opt = torch.optim.Adam(nn.Linear(4, 4).parameters())
    assert unwrap(opt) == (opt, None)
    with tiermem.offload(opt, config(tmp_path)) as tm:
        assert "unwrapped" not in tm.plan()


def test_non_adam_without_wrapper_keeps_its_message(tmp_path):
    opt = torch.optim.LBFGS(nn.Linear(4, 4).parameters(), lr=0.1)
    with pytest.raises(UnsupportedOptimizer, match="LBFGS"):
        with tiermem.offload(opt, config(tmp_path)):
            pass


class TimmStyleLookahead(torch.optim.Optimizer):
    """A wrapper in timm's Lookahead shape (timm's keeps its base in `.base_optimizer`,
    this one in `._base_optimizer`: any name): the base's param_groups as its own, its own
    slow weights in its own state, no closure."""

    def __init__(self, base, alpha=0.5, k=2):
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = dict(base.defaults, lookahead_alpha=alpha, lookahead_k=k)
        self.state = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        self._steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                slow = self.state.setdefault(p, {}).setdefault("slow", p.detach().clone())
                if self._steps % self.defaults["lookahead_k"] == 0:
                    slow.add_(p - slow, alpha=self.defaults["lookahead_alpha"])
                    p.copy_(slow)
        return loss


class ListHolder(torch.optim.Optimizer):
    """Optimizers kept in a list attribute (one per parameter group, say)."""

    def __init__(self, opts):
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]
        self.defaults, self.state = {}, {}

    def step(self, closure=None):
        for o in self.opts:
            o.step()


@pytest.mark.parametrize("make, attr", [
    (lambda opt: TimmStyleLookahead(opt), "_base_optimizer"),
    (lambda opt: ListHolder([opt]), "opts")])
def test_inner_optimizer_under_another_name_is_refused(tmp_path, make, attr):
    opt = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    with pytest.raises(UnsupportedOptimizer, match=rf"in its \.{attr}: pass that "
                       rf"\(tiermem\.offload\(wrapper\.{attr}, "):
        with tiermem.offload(make(opt), config(tmp_path)):
            pass
    assert installed(opt) is None


def _lookahead_run(model, batches, tier=None):
    """Train `model` with a TimmStyleLookahead around AdamW, inside the offload block
    `tier(wrapper)` opens (none when None)."""
    opt = TimmStyleLookahead(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with tier(opt) if tier else contextlib.nullcontext():
        for x in batches:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()


def test_the_refusal_is_what_keeps_a_wrapper_from_running_wrong(tmp_path, monkeypatch):
    """With the scan of other attributes patched out, the timm-style wrapper runs through
    the generic path and ends different from its plain run (each partition's shadow steps
    the base optimizer on every parameter); with it, the tiered inner optimizer stepped
    through the wrapper ends equal."""
    import copy

    import tiermem.optim.wrappers as wrappers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    ref, other = copy.deepcopy(model), copy.deepcopy(model)
    batches = [torch.randn(8, 64) for _ in range(4)]
    _lookahead_run(ref, batches)
    monkeypatch.setattr(wrappers, "_inner_optimizer", lambda obj: None)
    _lookahead_run(model, batches, lambda opt: tiermem.offload(
        opt, config(tmp_path / "a", host=0, kernel="match")))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    monkeypatch.undo()
    # what the message says to do: tier the inner optimizer, step through the wrapper
    _lookahead_run(other, batches, lambda opt: tiermem.offload(
        opt._base_optimizer, config(tmp_path / "b", host=0, kernel="match")))
    for p, q in zip(other.parameters(), ref.parameters()):
        assert torch.equal(p, q)
