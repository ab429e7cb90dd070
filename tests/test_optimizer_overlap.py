"""Optimizers other than Adam under pipeline.overlap_backward (partitions updated during
backward, as their gradients become final) equal their plain runs; under
torch.distributed they are refused with a clear error instead of being run as Adam."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import Synthetic, backend_params, config, listdir, make_batches, twin
from test_optimizer_rules import params_equal, state_equal
from test_overlap import PLACEMENTS, overlap_config, run, expected_early

STEPS = 5


def _thirdparty(mod, name):
    return getattr(pytest.importorskip(mod), name)


OPTIMIZERS = {
    "sgd-nesterov": lambda: (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "adagrad-foreach": lambda: (torch.optim.Adagrad, dict(lr=0.05, foreach=True)),
    "asgd": lambda: (torch.optim.ASGD, dict(lr=0.01, t0=2)),
    "rmsprop-centered": lambda: (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5,
                                                           centered=True)),
    "adafactor": lambda: (torch.optim.Adafactor, dict(lr=0.01)),
    "lion": lambda: (_thirdparty("lion_pytorch", "Lion"), dict(lr=1e-3, weight_decay=0.1)),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("placement", ["nvme", "mixed"])
@pytest.mark.parametrize("backend", backend_params())
def test_overlap_parity(tmp_path, backend, placement, optimizer):
    cls, kw = OPTIMIZERS[optimizer]()
    model, ref_model = twin(Synthetic)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref_model.parameters(), **kw)
    batches = make_batches(model, STEPS, micro=2)
    cfg = overlap_config(tmp_path, backend=backend, kernel="match", **PLACEMENTS[placement])
    with tiermem.offload(opt, cfg) as tm:
        run(model, opt, batches, tm)
        stats, parts = tm.stats(), tm.offloaded.parts
        sd = opt.state_dict()
    run(ref_model, ref_opt, batches)
    params_equal(model, ref_model, optimizer)
    state_equal(sd, ref_opt.state_dict(), optimizer)
    for i, s in enumerate(stats):  # the updates really ran during backward
        assert s["early_partitions"] == expected_early(model, parts, i) > 0
    assert listdir(tmp_path) == []


class OwnStepAdafactor(torch.optim.Adafactor):
    """A step of its own: the generic path, whose shadow tiermem cannot build for a share."""

    @torch.no_grad()
    def step(self, closure=None):
        return super().step(closure)


def test_distributed_refuses_other_optimizers(tmp_path):
    """The sharded path steps each rank's pieces of its parameters, or whole parameters for
    torch's Adafactor and Muon: an optimizer on the generic path is refused before anything
    is set up, naming it."""
    os.chmod(tmp_path, 0o700)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        model = Synthetic()
        opt = OwnStepAdafactor(model.parameters(), lr=0.1)
        with pytest.raises(UnsupportedOptimizer, match="torch.distributed.*OwnStepAdafactor"):
            with tiermem.offload(opt, config(tmp_path / "swap"),
                                 process_group=dist.group.WORLD):
                pass
        assert not opt.state
    finally:
        dist.destroy_process_group()


class NormalisesGrads(torch.optim.Optimizer):
    """SGD that divides each gradient in place before using it, as schedule-free's step
    reuses the gradient's memory."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.div_(p.grad.abs().max() + 1)
                    p.sub_(g, alpha=group["lr"])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_that_writes_its_gradients_is_refused_during_backward(tmp_path, overlap):
    """During backward the updates would rewrite the gradients the user then sees (and
    clips, or logs): refused at entry, naming the optimizer. Without the overlap it runs as
    the plain one."""
    model, ref_model = twin(Synthetic)
    opt, ref_opt = NormalisesGrads(model.parameters()), NormalisesGrads(ref_model.parameters())
    batches = make_batches(model, 3)
    cfg = overlap_config(tmp_path, backend="threads", kernel="match", **PLACEMENTS["mixed"])
    cfg["pipeline"]["overlap_backward"] = overlap
    if overlap:
        with pytest.raises(UnsupportedOptimizer, match="NormalisesGrads.*writes into the gr"):
            with tiermem.offload(opt, cfg):
                pass
        assert listdir(tmp_path) == []
        return
    with tiermem.offload(opt, cfg) as tm:
        run(model, opt, batches, tm)
    run(ref_model, ref_opt, batches)
    params_equal(model, ref_model, "without the overlap")
