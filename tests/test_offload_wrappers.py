"""`tiermem.offload` given a wrapper it does not know: refused, naming `.optimizer`.

No framework is needed: the wrappers are stand-ins. (Accelerate's and Lightning's own
wrappers are tested against the real packages in tests/test_integration_*.py.)
"""

from __future__ import annotations

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
