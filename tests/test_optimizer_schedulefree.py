"""Schedule-free optimizers under tiermem: their train() / eval() move the weights with
the per-parameter state (z), which lives in the tiers; tiermem runs them partition by
partition, as a step, and every switch, step and state_dict equals the plain run."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem

from offload_helpers import Synthetic, backend_params, config, make_batches, train
from test_optimizer_rules import params_equal, state_equal

schedulefree = pytest.importorskip("schedulefree")


def cfg(tmp_path, backend, durability="scratch"):
    c = config(tmp_path, backend=backend, host="128KiB", kernel="match")
    c["swap"]["durability"] = durability
    return c


@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["AdamWScheduleFree", "SGDScheduleFree"])
def test_train_eval_switches_equal_plain(tmp_path, backend, name, durability):
    cls = getattr(schedulefree, name)
    kw = dict(lr=1e-2, weight_decay=0.01, warmup_steps=2)
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, 6)
    with tiermem.offload(opt, cfg(tmp_path, backend, durability), model=model) as tm:
        opt.train()
        train(model, opt, batches[:3])
        opt.eval()  # the weights become the averaged x, from z in the records
        evaluated = [p.detach().clone() for p in model.parameters()]
        opt.eval()  # a second eval() changes nothing, as in plain schedule-free
        opt.train()
        train(model, opt, batches[3:], start=3)
        opt.eval()
        assert tm.plan()["state_bytes"]["nvme"] > 0
        sd = opt.state_dict()
    ref_opt.train()
    train(ref, ref_opt, batches[:3])
    ref_opt.eval()
    for p, q in zip(evaluated, ref.parameters()):
        assert torch.equal(p, q.detach())
    ref_opt.eval()
    ref_opt.train()
    train(ref, ref_opt, batches[3:], start=3)
    ref_opt.eval()
    params_equal(model, ref, "after the last eval()")
    state_equal(sd, ref_opt.state_dict(), "state_dict()")
    assert [g["train_mode"] for g in opt.param_groups] == [False]
    assert opt.train.__func__ is cls.train and opt.eval.__func__ is cls.eval  # unhooked


def test_step_in_eval_mode_is_refused_as_plain(tmp_path):
    """schedule-free's own error for a step in eval mode still reaches the user."""
    model = Synthetic()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2)
    batches = make_batches(model, 1)
    with tiermem.offload(opt, cfg(tmp_path, "threads"), model=model):
        opt.eval()
        with pytest.raises(Exception, match="train mode"):
            train(model, opt, batches)
