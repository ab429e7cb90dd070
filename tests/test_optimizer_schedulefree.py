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


def cfg(tmp_path, backend, durability="scratch", params="none"):
    c = config(tmp_path, backend=backend, host="128KiB", kernel="match")
    c["swap"]["durability"] = durability
    c["parameters"] = {"offload": params}
    return c


@pytest.mark.parametrize("durability, params", [
    ("scratch", "none"), ("crash_consistent", "none"),
    # the weights train()/eval() move are in the parameter tier: materialised and written
    # back partition by partition (the methods failed on the empty parameters)
    ("scratch", "nvme"), ("crash_consistent", "host")])
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["AdamWScheduleFree", "SGDScheduleFree"])
def test_train_eval_switches_equal_plain(tmp_path, backend, name, durability, params):
    cls = getattr(schedulefree, name)
    kw = dict(lr=1e-2, weight_decay=0.01, warmup_steps=2)
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, 6)
    with tiermem.offload(opt, cfg(tmp_path, backend, durability, params),
                         model=model) as tm:
        opt.train()
        train(model, opt, batches[:3])
        opt.eval()  # the weights become the averaged x, from z in the records
        evaluated = [p.detach().clone() if params == "none"
                     else tm.offloaded.weights.current_weight(p) for p in model.parameters()]
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
        assert torch.equal(p.reshape(q.shape), q.detach())
    ref_opt.eval()
    ref_opt.train()
    train(ref, ref_opt, batches[3:], start=3)
    ref_opt.eval()
    params_equal(model, ref, "after the last eval()")
    state_equal(sd, ref_opt.state_dict(), "state_dict()")
    assert [g["train_mode"] for g in opt.param_groups] == [False]
    assert opt.train.__func__ is cls.train and opt.eval.__func__ is cls.eval  # unhooked


@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
def test_eval_reads_weights_edited_since_the_step(tmp_path, durability):
    """eval()/train() read the weights as they are, as the plain ones and a step do: an
    edit since the last step (a load into the model, a clamp) counts. crash_consistent
    keeps an fp32 master of an fp32 CPU model's weights only as the copy a commit keeps;
    the methods read that stale master and wrote it over the edit."""
    model = Synthetic()
    ref = copy.deepcopy(model)
    kw = dict(lr=1e-2, weight_decay=0.01, warmup_steps=2)
    opt = schedulefree.AdamWScheduleFree(model.parameters(), **kw)
    ref_opt = schedulefree.AdamWScheduleFree(ref.parameters(), **kw)
    batches = make_batches(model, 3)
    with tiermem.offload(opt, cfg(tmp_path, "threads", durability), model=model):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.train()
            train(m, o, batches[:2])
            with torch.no_grad():
                m.fc1.weight.mul_(0.5)
            o.eval()
        params_equal(model, ref, "eval() after an edit")
        for m, o in ((model, opt), (ref, ref_opt)):
            with torch.no_grad():
                m.fc2.weight.mul_(0.5)
            o.train()
            train(m, o, batches[2:], start=2)
        params_equal(model, ref, "a step after train() after an edit")
        state_equal(opt.state_dict(), ref_opt.state_dict(), "state_dict()")


def test_step_in_eval_mode_is_refused_as_plain(tmp_path):
    """schedule-free's own error for a step in eval mode still reaches the user."""
    model = Synthetic()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2)
    batches = make_batches(model, 1)
    with tiermem.offload(opt, cfg(tmp_path, "threads"), model=model):
        opt.eval()
        with pytest.raises(Exception, match="train mode"):
            train(model, opt, batches)


@pytest.mark.parametrize("mode_kept", [True, False])
def test_resume_keeps_the_train_mode(tmp_path, monkeypatch, mode_kept):
    """A crash-consistent run committed in train mode keeps the group's train_mode with the
    state (train() changes it, the probe sees it): the resumed run's own train() leaves the
    committed weights as they are, and it continues exactly. With train_mode left out of
    the values a step keeps, that train() moves the weights again: different, no error."""
    from tiermem.optim.rules.generic import ShadowRule

    if not mode_kept:
        changed = ShadowRule._changed
        monkeypatch.setattr(ShadowRule, "_changed", lambda self: [
            (where, key) for where, key in changed(self) if key != "train_mode"])
        monkeypatch.setattr(ShadowRule, "_kept", ShadowRule._changed)
    cls = schedulefree.AdamWScheduleFree
    kw = dict(lr=1e-2, warmup_steps=2)
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, 5)
    c = cfg(tmp_path, "threads", "crash_consistent")
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            opt.train()
            train(model, opt, batches[:3])
    model2 = copy.deepcopy(model)
    opt2 = cls(model2.parameters(), **kw)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt2, c, model=model2, resume=True):
            opt2.train()
            train(model2, opt2, batches[3:], start=3)
    ref_opt.train()
    train(ref, ref_opt, batches)
    same = all(torch.equal(p, q) for p, q in zip(model2.parameters(), ref.parameters()))
    assert same == mode_kept
