"""Framework scenarios the per-framework tests leave out, each against the same run
without tiermem: weights and optimizer state bitwise (kernel: match), or a clear refusal.

Lightning hands a LightningModule its optimizers in LightningOptimizer wrappers
(`self.optimizers()`), whose class derives from the optimizer's: the methods it does not
define itself run the optimizer class's code on the wrapper, past the methods tiermem puts
on the optimizer instance, unless tiermem routes them (tiermem/optim/wrappers.py).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch

from offload_helpers import assert_same_tensor, compare_state_dicts, config, listdir


def cfg(tmp_path: Path, offload: str = "none") -> dict:
    c = config(tmp_path / "swap", host=0, kernel="match")
    c["parameters"] = {"offload": offload}
    return c


# -- Lightning --------------------------------------------------------------------------


def _lightning():
    return pytest.importorskip("lightning.pytorch", reason="lightning is not installed "
                               "(pip install -e '.[integrations]')")


def lightning_both(tmp_path: Path, make, offload: str = "none", **kw):
    """(plain module, its trainer), (tiered module, its trainer) of the same fit, compared:
    weights and every optimizer's state bitwise, the swap directory emptied."""
    from test_integration_lightning import fit
    from tiermem.integrations.lightning import TiermemCallback

    plain = make()
    t_plain = fit(tmp_path / "plain", plain, **kw)
    tiered = make()
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[TiermemCallback(cfg(tmp_path, offload))],
                   **kw)
    for (name, p), (_, q) in zip(tiered.named_parameters(), plain.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    assert len(t_tiered.optimizers) == len(t_plain.optimizers)
    for a, b in zip(t_tiered.optimizers, t_plain.optimizers):
        compare_state_dicts(a.state_dict(), b.state_dict())
    assert listdir(tmp_path / "swap") == []
    return (plain, t_plain), (tiered, t_tiered)


def _manual_module():
    _lightning()
    from test_integration_lightning import Tiny

    class Manual(Tiny):
        """Manual optimization through self.optimizers(): 2 micro-batches a step, clipped,
        a scheduler, and the optimizer's state_dict read after every step."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.saved: list[dict] = []

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            self.manual_backward((self.net(x) - y).square().mean() / 2)
            if batch_idx % 2 == 1:
                self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
                self.lr_schedulers().step()
                # torch's state_dict holds the live tensors: a copy of this step's
                self.saved.append(copy.deepcopy(opt.state_dict()))

    return Manual


@pytest.mark.parametrize("offload", ["none", "host"])
def test_lightning_manual_optimization_through_self_optimizers(tmp_path, offload):
    # Without the routing, `self.optimizers().state_dict()` was empty (torch's state_dict
    # on the wrapper reads the optimizer's opt.state, which the tiers hold), and with
    # parameters.offload `self.optimizers().zero_grad()` left the tier's gradients, so the
    # next backward raised "no zero_grad() since the last optimizer.step()".
    make = _manual_module()
    (plain, _), (tiered, _) = lightning_both(tmp_path, make, offload, max_steps=3)
    assert len(tiered.saved) == len(plain.saved) == 3
    for a, b in zip(tiered.saved, plain.saved):
        assert b["state"]
        compare_state_dicts(a, b)


def test_lightning_schedulefree_train_eval_through_self_optimizers(tmp_path):
    # schedule-free's docs have a LightningModule call self.optimizers().train() / .eval()
    # around training and validation. On the wrapper they ran schedulefree's own method over
    # an empty opt.state: nothing swapped, the weights 3.6e-3 away from the plain fit's.
    _lightning()
    schedulefree = pytest.importorskip("schedulefree")
    from test_integration_lightning import Tiny

    class ScheduleFree(Tiny):
        def configure_optimizers(self):
            return schedulefree.AdamWScheduleFree(self.parameters(), lr=1e-2, warmup_steps=2)

        def on_train_epoch_start(self):
            self.optimizers().train()

        def on_validation_epoch_start(self):
            self.optimizers().eval()

        def on_validation_epoch_end(self):
            self.optimizers().train()

        def on_train_end(self):
            self.optimizers().eval()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", (self.net(x) - y).square().mean())

        def val_dataloader(self):
            return self.train_dataloader()

    lightning_both(tmp_path, lambda: ScheduleFree(batches=2), max_steps=6, limit_val_batches=1)


def test_offload_of_a_lightning_optimizer_routes_its_methods(tmp_path):
    # tiermem.offload(self.optimizers(), ...) directly, as manual optimization might
    _lightning()
    from lightning.pytorch.core.optimizer import LightningOptimizer
    import tiermem

    from test_integration_lightning import Tiny

    models = [Tiny(), Tiny()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    wrapped = LightningOptimizer(opts[1])
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    with tiermem.offload(wrapped, cfg(tmp_path)):
        for m, opt in zip(models, opts):
            (m.net(x) - y).square().mean().backward()
            opt.step()
        compare_state_dicts(wrapped.state_dict(), opts[0].state_dict())
    assert "state_dict" not in vars(wrapped)  # the routing ends with the block


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_lightning_stochastic_weight_averaging_with_the_weights_in_the_tiers(tmp_path, offload):
    # SWA copies the averaged weights into the module at the end with
    # p.detach().copy_(): the parameter tier released them unwritten (it wrote back only
    # what its own updates changed) and the exit gave back the last step's weights, 1.8e-2
    # from the plain fit's averaged ones, silently.
    _lightning()
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from test_integration_lightning import Tiny

    def swa():
        return StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2)

    from test_integration_lightning import fit
    from tiermem.integrations.lightning import TiermemCallback

    plain = Tiny(batches=2)
    fit(tmp_path / "plain", plain, max_epochs=4, max_steps=-1, callbacks=[swa()])
    tiered = Tiny(batches=2)
    fit(tmp_path / "tiered", tiered, max_epochs=4, max_steps=-1,
        callbacks=[TiermemCallback(cfg(tmp_path, offload)), swa()])
    for (name, p), (_, q) in zip(tiered.named_parameters(), plain.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    assert listdir(tmp_path / "swap") == []


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_lightning_ema_weight_averaging_with_the_weights_in_the_tiers(tmp_path, offload):
    # EMAWeightAveraging swaps the averaged weights in for validation and copies them in at
    # the end through p.data, which moves no version counter: the exit gave back the
    # records, 2.4e-3 from the plain fit's averaged weights. The window's copy of a weight
    # is its current value; the exit takes that (a window too small for the model still
    # loses such a change at a release: docs/guide/parameters.md).
    _lightning()
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from test_integration_lightning import Tiny

    class Validated(Tiny):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", (self.net(x) - y).square().mean())

        def val_dataloader(self):
            return self.train_dataloader()

    def make():
        return Validated(batches=2)

    from test_integration_lightning import fit
    from tiermem.integrations.lightning import TiermemCallback

    plain = make()
    fit(tmp_path / "plain", plain, max_steps=6, limit_val_batches=1,
        callbacks=[EMAWeightAveraging(decay=0.5)])
    tiered = make()
    fit(tmp_path / "tiered", tiered, max_steps=6, limit_val_batches=1,
        callbacks=[TiermemCallback(cfg(tmp_path, offload)), EMAWeightAveraging(decay=0.5)])
    for (name, p), (_, q) in zip(tiered.named_parameters(), plain.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")


class _Renormed(torch.nn.Module):
    """Embeddings with max_norm, which torch renormalises in place in the forward (the
    rows it looks up), then linears."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(64, 128, max_norm=1.0)
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])

    def forward(self, tokens):
        return self.layers(self.emb(tokens).mean(1))


def test_weights_changed_in_place_in_the_forward_reach_the_tier(tmp_path):
    # The same without a framework: nn.Embedding(max_norm=...) renormalises the rows it
    # looks up in place. The tier released those weights unwritten when the window needed
    # the room (and at the exit), so the step and the model lost the renormalisation.
    import tiermem

    models = [_Renormed(), _Renormed()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    c = cfg(tmp_path, "nvme")
    c["parameters"]["window"] = "320KiB"  # of 840 KiB of weights and gradients
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (8, 5), generator=g), torch.randn(8, 128, generator=g))
            for _ in range(3)]

    def run(m, opt):
        for tokens, y in data:
            (m(tokens) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        m(data[0][0])  # renormalises again after the last step

    run(models[0], opts[0])
    with tiermem.offload(opts[1], c, model=models[1]) as tm:
        run(models[1], opts[1])
        assert tm.param_stats()["evictions"] > 0
    for (name, p), (_, q) in zip(models[1].named_parameters(), models[0].named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    compare_state_dicts(opts[1].state_dict(), opts[0].state_dict())


def test_param_groups_replaced_inside_the_block_are_refused(tmp_path):
    # opt.param_groups assigned (or appended to) inside the block: the parameters of the
    # new group had no record and the step passed over them, silently never updated.
    import tiermem
    from tiermem.errors import TierMemError

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg(tmp_path)):
        opt.param_groups = [opt.param_groups[0],
                            {**opt.param_groups[0], "params": list(b.parameters())}]
        (a(torch.ones(2, 4)).sum() + b(torch.ones(2, 4)).sum()).backward()
        for call in (opt.step, opt.state_dict):
            with pytest.raises(TierMemError, match="param_groups changed .* 2 parameters"):
                call()
        opt.param_groups.pop()  # as it was: the block goes on
        opt.step()


def test_lightning_backbone_finetuning_fit_and_a_refused_resume(tmp_path):
    # BackboneFinetuning adds the backbone's group with add_param_group when it unfreezes
    # it (tiered like plain); on a resume it assigns the saved groups to
    # optimizer.param_groups after tiermem laid out the state, and Lightning's load of
    # the checkpoint failed with KeyError: 2. Refused, naming what changed.
    _lightning()
    from lightning.pytorch.callbacks import BackboneFinetuning
    from test_integration_lightning import Backbone, fit
    from tiermem.errors import TierMemError
    from tiermem.integrations.lightning import TiermemCallback

    def callbacks(tiered: bool) -> list:
        unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5)
        return [TiermemCallback(cfg(tmp_path)), unfreeze] if tiered else [unfreeze]

    fits = []
    for root in ("plain", "tiered"):
        module = Backbone()
        fits.append((module, fit(tmp_path / root, module, callbacks=callbacks(root == "tiered"),
                                 max_epochs=3, max_steps=-1, ckpt_every=4)))
    (plain, t_plain), (tiered, t_tiered) = fits
    for (name, p), (_, q) in zip(tiered.named_parameters(), plain.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    assert len(t_tiered.optimizers[0].param_groups) == 2
    compare_state_dicts(t_tiered.optimizers[0].state_dict(), t_plain.optimizers[0].state_dict())

    with pytest.raises(TierMemError, match="param_groups changed"):
        fit(tmp_path / "resumed", Backbone(), callbacks=callbacks(True), max_epochs=4,
            max_steps=-1, ckpt_path=str(tmp_path / "tiered/ckpt/step=4.ckpt"))
    assert listdir(tmp_path / "swap") == []


@pytest.mark.parametrize("sf, offload", [(True, "none"), (False, "host")],
                         ids=["schedulefree", "parameters-host"])
def test_fabric_optimizer_is_unwrapped_and_routed(tmp_path, sf, offload):
    # Fabric.setup's optimizer wrapper derives from the optimizer's class, as Lightning's:
    # tiermem refused it as a wrapper it does not know and said to pass its .optimizer,
    # after which the wrapper's train()/eval() (schedule-free: 2.1e-3 off plain) and
    # zero_grad() (parameters.offload: "no zero_grad() since the last step") ran past
    # tiermem's hooks. It is a known wrapper now: unwrapped and routed.
    pytest.importorskip("lightning.fabric", reason="lightning is not installed")
    from lightning.fabric import Fabric
    import tiermem

    def run(tiered: bool):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 1100), torch.nn.Tanh(),
                                        torch.nn.Linear(1100, 8))
        if sf:
            schedulefree = pytest.importorskip("schedulefree")
            opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, warmup_steps=2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fabric = Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, opt)
        g = torch.Generator().manual_seed(1)
        with tiermem.offload(opt, cfg(tmp_path, offload), model=model) if tiered \
                else contextlib.nullcontext():
            if sf:
                opt.train()
            for _ in range(4):
                x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
                fabric.backward((model(x) - y).square().mean())
                opt.step()
                opt.zero_grad()
            if sf:
                opt.eval()
        return model, opt

    (tm, to), (pm, po) = run(True), run(False)
    for (name, p), (_, q) in zip(tm.named_parameters(), pm.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    compare_state_dicts(to.state_dict(), po.state_dict())
    assert listdir(tmp_path / "swap") == []
