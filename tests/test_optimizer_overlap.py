"""Optimizers other than Adam under pipeline.overlap_backward (partitions updated during
backward, as their gradients become final) equal their plain runs; under
torch.distributed a subclass with a step of its own runs that step, not its base's rule."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import (Synthetic, backend_params, config, listdir, loss_of, make_batches,
                             twin)
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
    """A step of its own: the generic path, not Adafactor's rule."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] *= 0.5  # what Adafactor's rule would never do
        return super().step(closure)


def test_distributed_runs_a_subclass_with_its_own_step(tmp_path):
    """Under torch.distributed (one rank here; two: tests/test_distributed_generic.py) a
    subclass with a step of its own runs that step on its share, as in one process: the
    weights and the group values its step changes equal the plain run's."""
    os.chmod(tmp_path, 0o700)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        model, ref = twin(Synthetic)
        opt = OwnStepAdafactor(model.parameters(), lr=0.1)
        ref_opt = OwnStepAdafactor(ref.parameters(), lr=0.1)
        batches = make_batches(model, 3)
        with tiermem.offload(opt, config(tmp_path / "swap"), process_group=dist.group.WORLD):
            for micro in batches:
                for m, o in ((model, opt), (ref, ref_opt)):
                    for tokens, target in micro:
                        loss_of(m, tokens, target, True).backward()
                    o.step()
                    o.zero_grad()
        params_equal(model, ref, "own step under a process group")
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 / 8
        state_equal(opt.state_dict(), ref_opt.state_dict(), "own step under a process group")
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
