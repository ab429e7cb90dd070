"""The parameter tier against what user code does to the weights between steps, with a
window smaller than the model: each change kept exactly (bitwise the plain run) or
refused with an error that names it.

Between uses a released parameter's p.data is an empty tensor, and code outside the
model's forward sees that tensor: an in-place change of it changed nothing, and a new
dtype given to it was undone by the next read of the record, both without a word.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiermem
from tiermem.errors import TierMemError

from test_params_parity import Net, assert_same_model, batches, cfg, loss_of, make_opt, twins


def _step(model: nn.Module, opt: torch.optim.Optimizer, t: torch.Tensor,
          y: torch.Tensor) -> float:
    loss = loss_of(model, t, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _released(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.numel() == 0]


def _mul(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def _init(model: nn.Module) -> None:
    torch.manual_seed(5)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)


@pytest.mark.parametrize("edit", [_mul, _init], ids=["mul_", "nn.init"])
def test_an_in_place_change_of_a_released_weight_is_refused(tmp_path, edit):
    # It changed the empty placeholder: the forward after it ran on the old weights (the
    # plain run's differ), and the exit gave back the old weights too.
    model = Net()
    opt = make_opt(model)
    (t, y), (t2, y2) = batches(2)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
        _step(model, opt, t, y)
        assert _released(model)  # the window is smaller than the model
        edit(model)
        with pytest.raises(TierMemError, match="changed in place while their weights were out "
                                               "of memory"):
            loss_of(model, t2, y2)
        opt.zero_grad()
        _step(model, opt, t2, y2)  # said once: the records' weights stand, the loop goes on


def test_an_in_place_change_before_the_first_forward_is_refused(tmp_path):
    # Every weight is released when the block opens, even with a window for the whole
    # model: an init right after entering changed nothing.
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with pytest.raises(TierMemError, match="changed in place"):
        with tiermem.offload(opt, cfg(tmp_path, offload="host", window="4MiB"), model=model):
            _init(model)
            _step(model, opt, t, y)


def test_an_in_place_change_just_before_the_exit_is_refused(tmp_path):
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with pytest.raises(TierMemError, match="changed in place"):
        with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
            _step(model, opt, t, y)
            _mul(model)
    assert all(p.numel() > 0 for p in model.parameters())  # the others were given back
    assert not any(tmp_path.glob("tiermem-*"))


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_new_weights_assigned_to_p_data_are_kept(tmp_path, offload):
    # `p.data = new` moves no version counter: a released parameter's new weights were
    # dropped at its next use (the record's old ones read over them), a live one's at its
    # eviction.
    ref, model = twins()
    data = batches(4)
    shapes = {n: p.shape for n, p in Net().named_parameters()}

    def assign(m: nn.Module) -> None:
        g = torch.Generator().manual_seed(5)
        for n, p in m.named_parameters():
            p.data = torch.randn(shapes[n], generator=g) * 0.1

    def run(m: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        losses = []
        for k, (t, y) in enumerate(data):
            losses.append(_step(m, opt, t, y))
            if k == 1:
                assign(m)
        return losses

    want = run(ref, make_opt(ref))
    opt = make_opt(model)
    with tiermem.offload(opt, cfg(tmp_path, offload=offload), model=model) as tm:
        got = run(model, opt)
        assert tm.param_stats()["evictions"] > 0
    assert got == want
    assert_same_model(ref, model)


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float64), lambda m: m.half()],
                         ids=["to-float64", "half"])
def test_a_dtype_conversion_inside_the_block_is_refused(tmp_path, convert):
    # The released parameters took the new dtype as empty tensors and the next read of
    # their records gave them back the old one: a model half converted, without a word.
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
        _step(model, opt, t, y)
        convert(model)
        with pytest.raises(TierMemError, match="were given new data inside the block"):
            loss_of(model, t, y)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.numel() > 0 for p in model.parameters())

