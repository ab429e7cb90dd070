"""step(closure) on the generic path: tiermem evaluates the closure once, before any
partition, and each partition's shadow gets a closure handing back that loss, so an
optimizer whose step uses the loss (EmoNavi scales its update by the loss's trend) steps
as its plain run does. An optimizer whose step calls its closure other than once is
refused before the closure runs."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import assert_same_tensor, backend_params, make_batches, swap_dir, train
from test_optimizer_rules import (GlobalStep, Stepped, cfg, load, pair, params_equal,
                                  state_equal)


class LossScaled(Stepped):
    """Momentum whose step size follows the loss its closure returns (a loss-driven
    schedule, as EmoNavi's); without a closure, the plain step size."""

    def scale(self, loss) -> float:
        return 1.0 if loss is None else 1.0 / (1.0 + float(loss))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = self.scale(loss)
        for group, p, st in self.with_grads():
            if not st:
                st["m"] = torch.zeros_like(p)
            st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            p.sub_(st["m"], alpha=group["lr"] * scale)
        return loss


class TwiceEvaluated(LossScaled):
    """Evaluates its closure a second time within the step (as a sharpness-aware step does
    at moved weights)."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        return super().step(closure)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", [
    (LossScaled, {}),
    # loss averages in state['ema'] (kept in opt.state, carried across partitions) scale
    # its update once they drift apart
    (("pytorch_optimizer", "EmoNavi"), dict(lr=1e-2))],
    ids=lambda v: getattr(v, "__name__", None) or (v[1] if isinstance(v, tuple) else None))
def test_closure_loss_reaches_the_optimizers_step(tmp_path, backend, cls, kw):
    if isinstance(cls, tuple):
        cls = load(*cls)
    model, opt, ref, ref_opt = pair(cls, kw)
    batches = make_batches(model, 4)
    with tiermem.offload(opt, cfg(tmp_path, backend, "mixed"), model=model) as tm:
        losses = train(model, opt, batches, closure=True)
        assert len(tm.offloaded.parts) > 1
        sd = opt.state_dict()
    assert losses == train(ref, ref_opt, batches, closure=True)
    params_equal(model, ref, f"{cls.__name__} through a closure")
    state_equal(sd, ref_opt.state_dict(), cls.__name__)


def test_closure_loss_is_what_keeps_it_exact(tmp_path, monkeypatch):
    """With the loss kept from the partitions' steps (each shadow stepped without a closure,
    as before this was built), the run ends different from the plain one, with no error."""
    from tiermem.optim.rules.generic import ShadowRule

    plain = ShadowRule.begin_step
    monkeypatch.setattr(ShadowRule, "begin_step",
                        lambda self, groups, closure=None: plain(self, groups))
    model, opt, ref, ref_opt = pair(LossScaled, {})
    batches = make_batches(model, 3)
    with tiermem.offload(opt, cfg(tmp_path, "threads", "mixed"), model=model):
        train(model, opt, batches, closure=True)
    train(ref, ref_opt, batches, closure=True)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("cls, calls", [(TwiceEvaluated, 2), (GlobalStep, 0)],
                         ids=["twice", "never"])
def test_closure_called_other_than_once_refused(tmp_path, cls, calls):
    """Refused at the first step(closure), before the closure ran: the weights, the state
    and the steps before it are untouched, and stepping without a closure goes on."""
    model, opt, ref, ref_opt = pair(cls, {})
    batches = make_batches(model, 3)
    ran = []
    with tiermem.offload(opt, cfg(tmp_path, "threads", "mixed"), model=model):
        train(model, opt, batches[:1])
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(UnsupportedOptimizer,
                           match=rf"{cls.__name__}.step\(closure\): its step called the "
                                 rf"closure {calls} times"):
            opt.step(lambda: ran.append(1))
        assert not ran
        for p, b in zip(model.parameters(), before):
            assert_same_tensor(p.detach(), b, "a weight after the refusal")
        train(model, opt, batches[1:], start=1)
    train(ref, ref_opt, batches)
    params_equal(model, ref, f"{cls.__name__} stepped without a closure")


class LossAveraged(LossScaled):
    """Momentum whose step size follows an average of the losses its closure returns, kept
    in state["avg"] (as EmoNavi keeps its in state["ema"]). Without a closure the average
    stays where its first step set it: the coupling probe, stepping without one, sees a
    value set once."""

    def scale(self, loss) -> float:
        avg = self.state.setdefault("avg", 1.0)
        if loss is not None:
            self.state["avg"] = avg = 0.5 * avg + 0.5 * float(loss)
        return 1.0 / avg


@pytest.mark.parametrize("noted", [True, False])
def test_values_the_loss_changes_resume(tmp_path, monkeypatch, noted):
    """A value only the closure's loss changes is noted by the closure's probe and kept in
    the crash-consistent manifest: a resumed run continues exactly. With the noting patched
    out it is taken for a value its first step sets once, left out, and the resumed run
    ends different, with no error."""
    from tiermem.optim.rules.generic import ShadowRule

    if not noted:
        monkeypatch.setattr(ShadowRule, "_note_changes", lambda self, g, after: None)
    model, opt, ref, ref_opt = pair(LossAveraged, {})
    batches = make_batches(model, 5)
    c = cfg(tmp_path, "threads", "mixed")
    c["swap"]["durability"] = "crash_consistent"
    # no host memory to hand the state back to: it stays on disk, as after a crash
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            train(model, opt, batches[:3], closure=True)
    assert swap_dir(tmp_path).exists()
    model2 = copy.deepcopy(model)
    opt2 = LossAveraged(model2.parameters())
    with tiermem.offload(opt2, c, model=model2, resume=True):
        train(model2, opt2, batches[3:], start=3, closure=True)
    train(ref, ref_opt, batches, closure=True)
    same = all(torch.equal(p, q) for p, q in zip(model2.parameters(), ref.parameters()))
    assert same == noted
    if noted:
        assert opt2.state["avg"] == ref_opt.state["avg"]
