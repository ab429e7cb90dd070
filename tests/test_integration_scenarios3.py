"""Framework scenarios as users write them, each against the same run without tiermem:
weights and optimizer state bitwise (kernel: match), or a clear refusal.

Lightning's `LightningOptimizer` and Fabric's `_FabricOptimizer` make a class per wrapper
that derives from the optimizer's class: the methods they do not define themselves
(zero_grad, state_dict, load_state_dict, schedule-free's train()/eval()) run the optimizer
class's code on the wrapper, past the methods tiermem puts on the optimizer instance,
unless tiermem routes them (tiermem/optim/wrappers.py) - whichever of the two the user
passed to tiermem.offload, and whenever the wrapper was made.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch

import tiermem
from offload_helpers import assert_same_tensor, compare_state_dicts, listdir
from test_integration_scenarios2 import _lightning, cfg


def _fabric():
    return pytest.importorskip("lightning.fabric", reason="lightning is not installed "
                               "(pip install -e '.[integrations]')")


def _net() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 1100), torch.nn.Tanh(),
                                   torch.nn.Linear(1100, 8))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")


# -- 1. the inner optimizer of a Lightning / Fabric wrapper passed to tiermem.offload ----


@pytest.mark.parametrize("sf, offload, late", [
    (False, "host", False), (True, "none", False), (False, "host", True)],
    ids=["parameters-host", "schedulefree", "setup-inside-the-block"])
def test_fabric_inner_optimizer_passed_routes_the_wrapper(tmp_path, sf, offload, late):
    # tiermem.offload(fabric_opt.optimizer, ...): the wrapper's zero_grad() (parameters
    # offload: "a backward with no zero_grad() since the last optimizer.step()") and
    # schedule-free's train()/eval() ran the optimizer class's code on the wrapper, past
    # tiermem. Also with fabric.setup called inside the block (the wrapper made later).
    _fabric()
    from lightning.fabric import Fabric

    def run(tiered: bool):
        model = _net()
        if sf:
            schedulefree = pytest.importorskip("schedulefree")
            opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, warmup_steps=2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fabric = Fabric(accelerator="cpu", devices=1)
        if not late:
            model, opt = fabric.setup(model, opt)
        g = torch.Generator().manual_seed(1)
        saved = []
        inner = opt if late else opt.optimizer
        with tiermem.offload(inner, cfg(tmp_path, offload), model=model) if tiered \
                else contextlib.nullcontext():
            if late:
                model, opt = fabric.setup(model, opt)
            if sf:
                opt.train()
            for _ in range(3):
                x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
                fabric.backward((model(x) - y).square().mean())
                opt.step()
                opt.zero_grad()
            if sf:
                opt.eval()
            saved.append(copy.deepcopy(opt.state_dict()))
        return model, opt, saved

    (tm, to, ts), (pm, po, ps) = run(True), run(False)
    _same_weights(tm, pm)
    compare_state_dicts(to.state_dict(), po.state_dict())
    compare_state_dicts(ts[0], ps[0])
    assert listdir(tmp_path / "swap") == []


def test_lightning_inner_optimizer_passed_routes_the_wrapper(tmp_path):
    # tiermem.offload(self.optimizers().optimizer, ...) in the module: the state_dict() of
    # self.optimizers() was empty and its load_state_dict() loaded into the wrapper (not
    # the tiers), as torch's methods ran on the wrapper.
    _lightning()
    from lightning.pytorch.core.optimizer import LightningOptimizer

    models = [_net(), _net()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    wrappers = [LightningOptimizer(o) for o in opts]
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    with tiermem.offload(opts[1], cfg(tmp_path)):
        for _ in range(2):
            for m, w in zip(models, wrappers):
                (m(x) - y).square().mean().backward()
                w.optimizer.step()
                w.zero_grad()
        saved = copy.deepcopy(wrappers[1].state_dict())
        compare_state_dicts(saved, wrappers[0].state_dict())
        (models[1](x) - y).square().mean().backward()
        wrappers[1].optimizer.step()
        wrappers[1].load_state_dict(saved)  # back to step 2, into the tiers
        compare_state_dicts(opts[1].state_dict(), saved)
    assert "state" not in vars(wrappers[1]) and "param_groups" not in vars(wrappers[1])
    compare_state_dicts(opts[1].state_dict(), opts[0].state_dict())
    assert listdir(tmp_path / "swap") == []


def test_lightning_wrapper_of_another_optimizer_is_left_alone(tmp_path):
    # The routing is for the wrappers of the tiered optimizer only: another optimizer's
    # wrapper runs exactly what it ran before (no train() appears on it either).
    _lightning()
    from lightning.pytorch.core.optimizer import LightningOptimizer

    a, b = _net(), _net()
    tiered = torch.optim.AdamW(a.parameters(), lr=1e-2)
    other = LightningOptimizer(torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9))
    with tiermem.offload(tiered, cfg(tmp_path)):
        assert not hasattr(other, "train")
        assert type(other).zero_grad is torch.optim.Optimizer.zero_grad
        (b(torch.ones(2, 16))).sum().backward()
        other.optimizer.step()
        assert other.state_dict()["state"]  # torch's own, on the plain SGD


def test_lightning_fit_inside_a_block_on_the_optimizer_it_returns(tmp_path):
    # with tiermem.offload(opt, ...): trainer.fit(module), where configure_optimizers
    # returns that opt: Lightning wraps it during the fit, inside the block, and zeroes the
    # gradients through its wrapper (optimizer_zero_grad), which ran torch's zero_grad
    # on the wrapper: with parameters.offload the next backward raised "no zero_grad()".
    _lightning()
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from test_integration_lightning import Tiny, fit

    class Given(Tiny):
        def __init__(self) -> None:
            super().__init__(batches=3)
            self.opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)

        def configure_optimizers(self):
            return self.opt

    plain, tiered = Given(), Given()
    fit(tmp_path / "plain", plain, max_steps=3)
    with tiermem.offload(tiered.opt, cfg(tmp_path, "host"), model=tiered):
        fit(tmp_path / "tiered", tiered, max_steps=3)
    _same_weights(tiered, plain)
    compare_state_dicts(tiered.opt.state_dict(), plain.opt.state_dict())
    assert not {"zero_grad", "state_dict"} & set(vars(LightningOptimizer))  # routing ended
    assert listdir(tmp_path / "swap") == []


def test_inner_optimizer_of_an_accelerate_grad_scaler_wrapper_is_refused(tmp_path):
    # mixed_precision="fp16" (a GradScaler): tiermem.offload(opt) refuses the
    # AcceleratedOptimizer, whose step puts the optimizer's original step method back on
    # it. Given its .optimizer instead, the block opened and every step ran torch's
    # step past tiermem (nothing tiered; after a load_state_dict into the tiers, a step
    # on an empty state), silently. Refused the same way.
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate.optimizer import AcceleratedOptimizer
    from tiermem.optim.hooks import installed
    from tiermem.optim.rules import UnsupportedOptimizer

    from test_integration_accelerate import fresh_accelerator

    fresh_accelerator()
    opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    wrapped = AcceleratedOptimizer(opt, device_placement=False,
                                   scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(UnsupportedOptimizer, match="GradScaler"):
        with tiermem.offload(wrapped.optimizer, cfg(tmp_path)):
            pass
    assert installed(opt) is None
    # without a scaler, Accelerate's step calls the inner optimizer's: tiered
    plain = AcceleratedOptimizer(torch.optim.AdamW(torch.nn.Linear(4, 4).parameters()),
                                 device_placement=False)
    with tiermem.offload(plain.optimizer, cfg(tmp_path)):
        assert installed(plain.optimizer) is not None


def test_the_refusal_finds_a_wrapper_whose_dict_was_asked_for(tmp_path):
    # vars(wrapper) makes its attributes a dict of their own, which the garbage collector
    # then names as what refers to the optimizer (always so on Python 3.10)
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate.optimizer import AcceleratedOptimizer
    from tiermem.optim.rules import UnsupportedOptimizer

    from test_integration_accelerate import fresh_accelerator

    fresh_accelerator()
    opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    wrapped = AcceleratedOptimizer(opt, device_placement=False,
                                   scaler=torch.amp.GradScaler("cpu"))
    assert vars(wrapped)["optimizer"] is opt
    with pytest.raises(UnsupportedOptimizer, match="GradScaler"):
        with tiermem.offload(opt, cfg(tmp_path)):
            pass


def test_accelerate_grad_scaler_wrapper_made_inside_the_block_steps_on_after_it(tmp_path):
    # accelerator.prepare inside the block with mixed_precision="fp16": the wrapper keeps
    # the step method the optimizer has then (tiermem's) and puts it back after each of
    # its steps, also after the block. That method then failed with KeyError: '_tiermem';
    # the block is over and the state handed back, so it steps as the plain optimizer.
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate.optimizer import AcceleratedOptimizer

    from test_integration_accelerate import fresh_accelerator

    def run(tiered: bool):
        fresh_accelerator()
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)

        def steps(wrapper, n):
            for _ in range(n):
                x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
                wrapper.scaler.scale((model(x) - y).square().mean()).backward()
                wrapper.step()
                wrapper.zero_grad()

        with tiermem.offload(opt, cfg(tmp_path)) if tiered else contextlib.nullcontext():
            wrapper = AcceleratedOptimizer(opt, device_placement=False,
                                           scaler=torch.amp.GradScaler("cpu"))
            steps(wrapper, 2)
        steps(wrapper, 2)
        return model, opt

    (tm, to), (pm, po) = run(True), run(False)
    _same_weights(tm, pm)
    compare_state_dicts(to.state_dict(), po.state_dict())


def test_a_step_method_kept_past_a_block_that_kept_the_state_on_disk_refuses(tmp_path):
    # The same kept method after a block that left the state on disk (it did not fit in
    # host memory): the optimizer's state is not in it, so the step raises what the
    # block's guard says, as opt.step() does, instead of a plain step on an empty state.
    from unittest import mock

    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with mock.patch("tiermem.optim.handle.available_memory", return_value=0):
        with pytest.warns(tiermem.TierMemWarning, match="stays on disk"):
            with tiermem.offload(opt, cfg(tmp_path)):
                kept_step = opt.step  # as Accelerate's GradScaler path keeps it
                model(torch.ones(2, 16)).sum().backward()
                opt.step()
    for call in (kept_step, opt.step):
        with pytest.raises(tiermem.TierMemError, match="resume"):
            call()
    assert not opt.state


# -- 2. resumes ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adafactor(ps, lr=1e-2)], ids=["AdamW", "SGD", "Adafactor"])
@pytest.mark.parametrize("when", ["inside", "before"])
def test_a_checkpoint_of_a_resized_model_is_refused(tmp_path, make, when):
    # A resume from an optimizer checkpoint taken before the model was resized
    # (resize_token_embeddings, a changed head): each state tensor went into the records
    # as a flat run of elements, a larger one cut to fit, and training went on from a
    # state that was never this parameter's, silently. The plain optimizer's next step
    # raises on the mismatch. Loaded inside the block (Lightning's ckpt_path=,
    # accelerator.load_state) or into the plain optimizer before it (the Trainer's
    # resume_from_checkpoint, which loads before on_train_begin): refused either way.
    from tiermem.errors import TierMemError

    old, new = torch.nn.Linear(40, 40), torch.nn.Linear(40, 30)
    opt_old = make(old.parameters())
    old(torch.ones(2, 40)).sum().backward()
    opt_old.step()
    saved = opt_old.state_dict()

    plain = make(new.parameters())
    plain.load_state_dict(saved)
    new(torch.ones(2, 40)).sum().backward()
    with pytest.raises(RuntimeError):
        plain.step()

    opt = make(new.parameters())
    if when == "before":
        opt.load_state_dict(saved)
    with pytest.raises(TierMemError, match=r"\(shape \(30, 40\)\) has .* of shape \(40, "):
        with tiermem.offload(opt, cfg(tmp_path)):
            if when == "inside":
                opt.load_state_dict(saved)
    assert listdir(tmp_path / "swap") == []


def test_a_refused_load_inside_the_block_changes_nothing(tmp_path):
    # The refusal comes before the load replaces anything: the block goes on from the
    # state it had, as the plain optimizer, whose load succeeded, would not
    from tiermem.errors import TierMemError

    models = [_net(), _net()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    other = torch.nn.Sequential(torch.nn.Linear(16, 1000), torch.nn.Tanh(),
                                torch.nn.Linear(1000, 8))
    opt_other = torch.optim.AdamW(other.parameters(), lr=0.5)
    other(torch.ones(2, 16)).sum().backward()
    opt_other.step()
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    with tiermem.offload(opts[1], cfg(tmp_path)):
        for step in range(3):
            for m, opt in zip(models, opts):
                (m(x) - y).square().mean().backward()
                opt.step()
                opt.zero_grad()
            if step == 0:
                with pytest.raises(TierMemError, match="resized"):
                    opts[1].load_state_dict(opt_other.state_dict())
    _same_weights(models[1], models[0])
    compare_state_dicts(opts[1].state_dict(), opts[0].state_dict())


def test_fabric_save_and_load_mid_run_equal_plain(tmp_path):
    # Fabric as its docs write a resumable loop: fabric.save / fabric.load of a state dict
    # holding the wrapped model and optimizer, a scheduler, accumulation under
    # no_backward_sync, fabric.clip_gradients, zero_grad(set_to_none=False); the inner
    # optimizer passed to tiermem.offload, the weights in the parameter tier.
    _fabric()
    from lightning.fabric import Fabric

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g))
            for _ in range(8)]

    def run(tiered: bool, save: Path | None = None, load: Path | None = None):
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        fabric = Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, 1, 0.8)
        state = {"model": model, "optimizer": opt, "sched": sched, "it": 0}
        with tiermem.offload(opt.optimizer, cfg(tmp_path, "host"), model=model) if tiered \
                else contextlib.nullcontext():
            if load is not None:
                fabric.load(load, state)
            for i in range(state["it"], len(data)):
                x, y = data[i]
                with fabric.no_backward_sync(model, enabled=i % 2 == 0):
                    fabric.backward((model(x) - y).square().mean())
                if i % 2:
                    fabric.clip_gradients(model, opt, max_norm=0.05)
                    opt.step()
                    opt.zero_grad(set_to_none=False)
                    sched.step()
                state["it"] = i + 1
                if save is not None and i == 3:
                    fabric.save(save, state)
        return model, opt

    plain = run(False, save=tmp_path / "plain.ckpt")
    tiered = run(True, save=tmp_path / "tiered.ckpt")
    resumed = run(True, load=tmp_path / "tiered.ckpt")
    for model, opt in (tiered, resumed):
        _same_weights(model, plain[0])
        compare_state_dicts(opt.state_dict(), plain[1].state_dict())
    assert listdir(tmp_path / "swap") == []


def test_a_checkpoint_of_a_resized_model_is_refused_on_the_sharded_path(tmp_path):
    # torch.distributed (each rank tiers its share, as under Lightning's or Accelerate's
    # DDP): the pieces were cut from the loaded tensors as from the parameter, silently.
    # Every parameter's entry is checked, not only this rank's pieces', so all ranks
    # refuse alike; one rank's group stands in for them. The block goes on after a
    # refused load.
    import torch.distributed as dist

    from tiermem.errors import TierMemError

    old, new = torch.nn.Linear(40, 40), torch.nn.Linear(40, 30)
    opt_old = torch.optim.AdamW(old.parameters(), lr=1e-2)
    old(torch.ones(2, 40)).sum().backward()
    opt_old.step()
    saved = opt_old.state_dict()
    tmp_path.chmod(0o700)  # tiermem refuses swap paths others can write
    c = cfg(tmp_path)
    c["distributed"] = {"grads": "allreduced"}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        opt = torch.optim.AdamW(new.parameters(), lr=1e-2)
        with tiermem.offload(opt, c, name="inside", process_group=dist.group.WORLD):
            with pytest.raises(TierMemError, match=r"parameter 0 \(shape \(30, 40\)\) has"):
                opt.load_state_dict(saved)
            new(torch.ones(2, 40)).sum().backward()
            opt.step()
        opt = torch.optim.AdamW(new.parameters(), lr=1e-2)
        opt.load_state_dict(saved)
        with pytest.raises(TierMemError, match=r"parameter 0 \(shape \(30, 40\)\) has"):
            with tiermem.offload(opt, c, name="before", process_group=dist.group.WORLD):
                pass
    finally:
        dist.destroy_process_group()


def test_lightning_module_tiering_its_own_inner_optimizer(tmp_path):
    # A LightningModule that tiers its optimizer itself, in on_train_start, passing
    # self.optimizers().optimizer (manual optimization, weights in the parameter tier):
    # self.optimizers().zero_grad() left the tier's gradients ("no zero_grad() since the
    # last optimizer.step()") and its state_dict() was empty.
    _lightning()
    from test_integration_scenarios2 import _manual_module
    from test_integration_lightning import fit

    manual = _manual_module()

    class TiersItself(manual):
        def on_train_start(self):
            self.block = contextlib.ExitStack()
            self.block.enter_context(tiermem.offload(
                self.optimizers().optimizer, cfg(tmp_path, "host"), model=self))

        def on_train_end(self):
            self.block.close()

    plain, tiered = manual(), TiersItself()
    fit(tmp_path / "plain", plain, max_steps=3)
    fit(tmp_path / "tiered", tiered, max_steps=3)
    _same_weights(tiered, plain)
    assert len(tiered.saved) == len(plain.saved) == 3
    for a, b in zip(tiered.saved, plain.saved):
        assert b["state"]
        compare_state_dicts(a, b)
    compare_state_dicts(tiered.trainer.optimizers[0].state_dict(),
                        plain.trainer.optimizers[0].state_dict())
    assert listdir(tmp_path / "swap") == []


def test_an_accelerate_grad_scaler_wrapper_no_longer_used_is_no_refusal(tmp_path):
    # The wrapper's patched step refers to the wrapper: one dropped (the optimizer
    # prepared again, by another Accelerator without fp16) lives on until a collection,
    # and was found among the optimizer's referrers: a refusal of an optimizer that no
    # GradScaler steps any more.
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    import gc

    from accelerate.optimizer import AcceleratedOptimizer
    from tiermem.optim.hooks import installed

    from test_integration_accelerate import fresh_accelerator

    fresh_accelerator()
    opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    gc.disable()  # no collection of its own between the drop and the block
    try:
        AcceleratedOptimizer(opt, device_placement=False, scaler=torch.amp.GradScaler("cpu"))
        with tiermem.offload(opt, cfg(tmp_path)):
            assert installed(opt) is not None
    finally:
        gc.enable()
