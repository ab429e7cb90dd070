"""`tiermem recover` for torch's elementwise optimizers: the committed state of a
crash-consistent run, read from the swap files alone, is the plain optimizer's
state_dict (step counts, per-parameter scalars, state tensors, weights), and a plain
optimizer loaded from it keeps stepping as an uninterrupted run. Whole-parameter rules
are refused with a clear error."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from tiermem.errors import TierMemError
from tiermem.optim.rules import AdamRule
from tiermem.optim.rules.torch_family import TORCH_RULES
from tiermem.swap import recover as rec

from offload_helpers import Synthetic, config, make_batches, swap_dir, train
from test_optimizer_rules import params_equal, state_equal


def test_recover_knows_every_elementwise_rule():
    rules = (AdamRule, *TORCH_RULES)
    assert rec.ELEMENTWISE_RULES == {r.__name__ for r in rules}
    assert rec.NO_STEP_RULES == {r.__name__ for r in rules if not r.has_step}
    assert set(rec.EAGER_RULES) == {r.__name__ for r in rules if r.eager_state}


def _kept_run(tmp_path, monkeypatch, cls, kw, steps, dtype=torch.float32):
    model = Synthetic().to(dtype)
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, steps + 2)
    c = config(tmp_path, host="64KiB")
    c["swap"]["durability"] = "crash_consistent"
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            train(model, opt, batches[:steps])
    monkeypatch.undo()
    return model, ref, ref_opt, batches


@pytest.mark.parametrize("cls, kw", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.05)),
    (torch.optim.Adagrad, dict(lr=0.05, initial_accumulator_value=0.1)),
    (torch.optim.ASGD, dict(lr=0.01, t0=1)),
    (torch.optim.NAdam, dict(lr=0.01)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
])
def test_recover_equals_the_plain_optimizer(tmp_path, monkeypatch, cls, kw):
    steps = 3
    model, ref, ref_opt, batches = _kept_run(tmp_path, monkeypatch, cls, kw, steps)
    ckpt = torch.load(rec.recover(str(swap_dir(tmp_path)), str(tmp_path / "r.pt"))["path"])
    assert ckpt["step"] == steps
    train(ref, ref_opt, batches[:steps])
    # weights: committed with the state (crash-consistent records hold every weight)
    fresh = Synthetic()
    fresh.load_state_dict(ckpt["model"])
    params_equal(fresh, ref, "recovered weights")
    plain = cls(fresh.parameters(), **kw)
    plain.load_state_dict(ckpt["optimizer"])
    state_equal(plain.state_dict(), ref_opt.state_dict(), "recovered state")
    train(fresh, plain, batches[steps:], start=steps)
    train(ref, ref_opt, batches[steps:], start=steps)
    params_equal(fresh, ref, "stepping on from the recovered checkpoint")


def test_recover_adagrad_never_stepped_parameters(tmp_path, monkeypatch):
    """Adagrad builds every parameter's state when made: one never stepped (the side
    branch without gradients in the first step) recovers at its starting accumulator."""
    kw = dict(lr=0.05, initial_accumulator_value=0.25)
    model, ref, ref_opt, batches = _kept_run(tmp_path, monkeypatch, torch.optim.Adagrad, kw, 1)
    ckpt = rec.gather(str(swap_dir(tmp_path)))
    train(ref, ref_opt, batches[:1])
    state_equal(ckpt["optimizer"], ref_opt.state_dict(), "recovered after one step")


def test_recover_refuses_whole_parameter_rules(tmp_path, monkeypatch):
    _kept_run(tmp_path, monkeypatch, torch.optim.Adafactor, dict(lr=0.01), 2)
    with pytest.raises(TierMemError, match="cannot recover .* Adafactor|AdafactorRule"):
        rec.gather(str(swap_dir(tmp_path)))
