"""torch's own gradient clipping with parameters.offload (tiermem/optim/clipping.py).

The gradients live in the parameter tier, not in p.grad: torch.nn.utils.clip_grad_norm_
over the model's parameters (what Lightning, Accelerate and the Trainer call) must clip
them exactly as it would clip them in memory, and every call it cannot run exactly must
raise instead of clipping nothing.
"""

from __future__ import annotations

import pytest
import torch

import tiermem
from tiermem.errors import TierMemError

from offload_helpers import backend_params
from test_params_parity import (STEPS, assert_same_model, batches, cfg, loss_of, make_opt,
                                plain_run, twins)

ORIGINALS = {name: (getattr(torch.nn.utils, name),
                    getattr(torch.nn.utils.clip_grad, name))
             for name in ("clip_grad_norm_", "clip_grad_value_")}


def torch_clipped_run(model, data, config, *, micro, clip):
    """tiered_run, clipping the way a framework does: torch.nn.utils.clip_grad_norm_."""
    opt = make_opt(model)
    losses, norms = [], []
    with tiermem.offload(opt, config, model=model) as tm:
        for step in range(len(data) // micro):
            with tm.accumulating():
                for t, y in data[step * micro:(step + 1) * micro]:
                    loss = loss_of(model, t, y)
                    loss.backward()
                    losses.append(loss.item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            opt.zero_grad()
    return losses, norms


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_torch_clip_grad_norm_clips_the_tiers_gradients(tmp_path, offload, backend):
    ref, model = twins()
    data = batches(STEPS * 2, seed=3)
    want, want_norms = plain_run(ref, data, micro=2, clip=0.5)
    got, got_norms = torch_clipped_run(model, data, cfg(tmp_path, offload=offload,
                                                        backend=backend), micro=2, clip=0.5)
    assert got == want
    assert [n.item() for n in got_norms] == [n.item() for n in want_norms]
    assert want_norms[0] > 0.5  # the clip really scaled the first step
    assert_same_model(ref, model)
    for name, (a, b) in ORIGINALS.items():  # torch's own functions again after the block
        assert getattr(torch.nn.utils, name) is a
        assert getattr(torch.nn.utils.clip_grad, name) is b


def one_backward(tmp_path):
    """An open block with a parameter tier, one backward done: (model, opt, tm, stack)."""
    _, model = twins()
    opt = make_opt(model)
    block = tiermem.offload(opt, cfg(tmp_path, offload="host"), model=model)
    tm = block.__enter__()
    t, y = batches(1)[0]
    loss_of(model, t, y).backward()
    return model, opt, tm, block


@pytest.mark.parametrize("call, match", [
    (lambda m: torch.nn.utils.clip_grad_norm_(list(m.parameters())[:3], 1.0),
     "not among them"),
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type=1.0),
     "norm_type=1.0 is not supported"),
    (lambda m: torch.nn.utils.clip_grad.clip_grad_norm_(
        [*m.parameters(), torch.nn.Parameter(torch.ones(3)).requires_grad_()], 1.0),
     None),  # a parameter outside the tier without a gradient: fine
    (lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.1),
     "clip_grad_value_ over parameters whose gradients are in tiermem's parameter tier"),
], ids=["part-of-them", "another-norm", "outside-without-grad", "by-value"])
def test_what_torch_clipping_cannot_do_exactly_is_refused(tmp_path, call, match):
    model, opt, tm, block = one_backward(tmp_path)
    try:
        if match is None:
            assert call(model) > 0
        else:
            with pytest.raises(TierMemError, match=match):
                call(model)
    finally:
        block.__exit__(None, None, None)


def test_a_parameter_outside_the_tier_with_a_gradient_is_refused(tmp_path):
    model, opt, tm, block = one_backward(tmp_path)
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    try:
        with pytest.raises(TierMemError, match="1 it does not"):
            torch.nn.utils.clip_grad_norm_([*model.parameters(), other], 1.0)
    finally:
        block.__exit__(None, None, None)


def test_a_nonfinite_norm_raises_torchs_error_and_keeps_no_coefficient(tmp_path):
    model, opt, tm, block = one_backward(tmp_path)
    try:
        t, y = batches(1, seed=9)[0]  # inf in the stored gradients, as an overflow leaves
        (loss_of(model, t, y) * float("inf")).backward()
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        assert tm.offloaded.weights.clip_coef is None
    finally:
        block.__exit__(None, None, None)


def test_without_a_parameter_tier_torch_clipping_is_untouched(tmp_path):
    _, model = twins()
    opt = make_opt(model)
    c = cfg(tmp_path, offload="none")
    with tiermem.offload(opt, c, model=model):
        for name, (a, b) in ORIGINALS.items():
            assert getattr(torch.nn.utils, name) is a
            assert getattr(torch.nn.utils.clip_grad, name) is b
