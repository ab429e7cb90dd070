"""tiermem.integrations.lightning.TiermemCallback against the real Lightning Trainer.

Every tiered fit is compared with the same fit without the callback: weights and optimizer
state bitwise (kernel: match runs the torch kernel the plain AdamW runs), Lightning's own
checkpoints (ModelCheckpoint) bitwise, and a `ckpt_path=` resume against the plain resume.
The state streams through NVMe-sized partitions (host tier 0), so a wrong partition,
a state not loaded on resume, or a step taken twice shows up as a difference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed "
                        "(pip install -e '.[integrations]')")

import tiermem  # noqa: E402
from tiermem.errors import TierMemError  # noqa: E402
from tiermem.integrations.lightning import TiermemCallback  # noqa: E402
from tiermem.optim.hooks import installed  # noqa: E402

from offload_helpers import assert_same_tensor, compare_state_dicts, config, listdir  # noqa: E402

BATCHES = 8


class Tiny(L.LightningModule):
    """Linear -> tanh -> Linear; 1100 hidden units make a few 64 KiB partitions."""

    def __init__(self, fail_at: int | None = None, interrupt: bool = False,
                 batches: int = BATCHES) -> None:
        super().__init__()
        self.batches = batches
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 1100), nn.Tanh(), nn.Linear(1100, 8))
        self.fail_at = fail_at
        self.interrupt = interrupt

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise KeyboardInterrupt if self.interrupt else RuntimeError("boom in step")
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(4 * self.batches, 16, generator=g),
                                              torch.randn(4 * self.batches, 8, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False, num_workers=0)


class Backbone(Tiny):
    """Tiny whose first layer is the backbone BackboneFinetuning freezes and unfreezes; its
    optimizer holds the trainable parameters only (the callback adds the backbone's)."""

    def __init__(self) -> None:
        super().__init__(batches=2)
        self.backbone = self.net[0]

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad],
                                 lr=1e-2, weight_decay=0.05)


def fit(root: Path, module: Tiny, *, callbacks=(), ckpt_every: int | None = None,
        ckpt_path: str | None = None, max_steps: int = 4, **trainer_kw) -> L.Trainer:
    cbs = list(callbacks)
    if ckpt_every:
        cbs.append(L.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=ckpt_every,
                                               save_top_k=-1, filename="{step}"))
    trainer = L.Trainer(default_root_dir=root, accelerator="cpu", devices=1, max_steps=max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(ckpt_every), num_sanity_val_steps=0,
                        callbacks=cbs, **trainer_kw)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def compare(a: tuple[Tiny, L.Trainer], b: tuple[Tiny, L.Trainer]) -> None:
    """Weights and (handed back) optimizer state bitwise equal."""
    (ma, ta), (mb, tb) = a, b
    for (name, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    compare_state_dicts(ta.optimizers[0].state_dict(), tb.optimizers[0].state_dict())


def resumed_from_step_2(tmp_path: Path, make) -> tuple[tuple[Tiny, L.Trainer], ...]:
    """Plain and tiered fits of make() resumed from their step-2 checkpoints (of the fits
    under tmp_path/plain and tmp_path/tiered): (tiered, its trainer), (plain, its)."""
    r_plain = make()
    tr_plain = fit(tmp_path / "rp", r_plain, ckpt_path=str(tmp_path / "plain/ckpt/step=2.ckpt"))
    r_tiered = make()
    tr_tiered = fit(tmp_path / "rt", r_tiered, callbacks=[TiermemCallback(cfg(tmp_path))],
                    ckpt_path=str(tmp_path / "tiered/ckpt/step=2.ckpt"))
    return (r_tiered, tr_tiered), (r_plain, tr_plain)


def cfg(tmp_path: Path, **pipeline) -> dict:
    c = config(tmp_path / "swap", host=0, kernel="match")
    c["pipeline"].update(pipeline)
    return c


def test_fit_checkpoint_and_resume_equal_plain(tmp_path):
    # Epochs of 2 batches: the step-2 checkpoint ends an epoch, so a resume from it sees the
    # same batches as the full fit (Lightning cannot resume a plain DataLoader mid-epoch).
    plain = Tiny(batches=2)
    t_plain = fit(tmp_path / "plain", plain, ckpt_every=2)
    tiered, cb = Tiny(batches=2), TiermemCallback(cfg(tmp_path))
    probe = Stats(cb)
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[cb, probe], ckpt_every=2)
    compare((tiered, t_tiered), (plain, t_plain))
    # the state really lived in the tiers (NVMe) during the fit, not in the optimizer
    assert probe.plan["state_bytes"]["nvme"] > 0 and probe.live_state == 0
    assert len(probe.stats) == 4
    assert installed(t_tiered.optimizers[0]) is None and cb.handles == []
    assert listdir(tmp_path / "swap") == []  # state handed back, swap removed

    # Lightning's checkpoint of step 2 holds the same optimizer state and weights
    ck_plain = torch.load(tmp_path / "plain/ckpt/step=2.ckpt", weights_only=False)
    ck_tiered = torch.load(tmp_path / "tiered/ckpt/step=2.ckpt", weights_only=False)
    compare_state_dicts(ck_tiered["optimizer_states"][0], ck_plain["optimizer_states"][0])
    assert ck_tiered["optimizer_states"][0]["state"], "the checkpoint has no optimizer state"
    for k, v in ck_plain["state_dict"].items():
        assert_same_tensor(ck_tiered["state_dict"][k], v, k)

    # resume from step 2 to 4: the tiered resume equals the plain one, and both the full fit
    tiered_resumed, plain_resumed = resumed_from_step_2(tmp_path, lambda: Tiny(batches=2))
    compare(tiered_resumed, plain_resumed)
    compare(tiered_resumed, (plain, t_plain))


def test_clipping_and_accumulation_equal_plain(tmp_path):
    kw = dict(gradient_clip_val=0.05, accumulate_grad_batches=3, max_steps=3)
    plain = Tiny()
    t_plain = fit(tmp_path / "plain", plain, **kw)
    tiered = Tiny()
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[TiermemCallback(cfg(tmp_path))], **kw)
    compare((tiered, t_tiered), (plain, t_plain))


class Stats(L.Callback):
    """tm.stats() just before the fit ends (after it, the block is left)."""

    def __init__(self, cb: TiermemCallback) -> None:
        self.cb, self.stats, self.plan, self.live_state = cb, None, None, None

    def on_train_end(self, trainer, pl_module):
        self.stats, self.plan = self.cb.tm.stats(), self.cb.tm.plan()
        self.live_state = sum(1 for s in trainer.optimizers[0].state.values() if s)


def test_overlap_with_accumulation_equals_plain(tmp_path):
    # 8 batches, 3 per step: the last step has 2 (Lightning steps on the epoch's last batch)
    kw = dict(accumulate_grad_batches=3, max_steps=3)
    plain = Tiny()
    t_plain = fit(tmp_path / "plain", plain, **kw)
    tiered, cb = Tiny(), TiermemCallback(cfg(tmp_path, overlap_backward=True))
    stats = Stats(cb)
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[cb, stats], **kw)
    compare((tiered, t_tiered), (plain, t_plain))
    assert len(stats.stats) == 3
    # the updates really ran during the last backward of each step
    assert all(s["early_partitions"] > 0 for s in stats.stats), stats.stats


def test_overlap_refuses_clipping(tmp_path):
    with pytest.raises(TierMemError, match="gradient_clip_val"):
        fit(tmp_path, Tiny(), callbacks=[TiermemCallback(cfg(tmp_path, overlap_backward=True))],
            gradient_clip_val=1.0)


@pytest.mark.parametrize("interrupt", [False, True], ids=["exception", "ctrl-c"])
def test_failed_fit_leaves_through_the_exit(tmp_path, interrupt):
    plain = Tiny()
    t_plain = fit(tmp_path / "plain", plain, max_steps=2)
    tiered = Tiny(fail_at=2, interrupt=interrupt)
    # Lightning turns Ctrl-C into a graceful shutdown and sys.exit(1)
    with pytest.raises(SystemExit if interrupt else RuntimeError):
        fit(tmp_path / "tiered", tiered, callbacks=[TiermemCallback(cfg(tmp_path))])
    opt = tiered.trainer.optimizers[0]
    assert installed(opt) is None
    assert listdir(tmp_path / "swap") == []
    # the two steps taken before the failure were handed back into the optimizer
    compare((tiered, tiered.trainer), (plain, t_plain))


def test_offload_unwraps_lightning_optimizer(tmp_path):
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    wrapped = LightningOptimizer(opt)
    assert isinstance(wrapped, torch.optim.Adam)  # Lightning's class derives from Adam too
    with tiermem.offload(wrapped, cfg(tmp_path)) as tm:
        assert installed(opt) is not None and installed(wrapped) is None
        assert tm.optimizer is opt
        assert tm.plan()["unwrapped"] == "lightning.pytorch.core.optimizer.LightningOptimizer"


@pytest.mark.parametrize("mod, name, kw", [
    # the generic path: a count in opt.state["k"] (a tensor under a string key), carried
    # through Lightning's checkpoint and its resume
    ("pytorch_optimizer", "MADGRAD", dict(lr=1e-3)),
    # its step uses the loss of the closure Lightning's automatic optimisation passes
    ("pytorch_optimizer", "EmoNavi", dict(lr=1e-2))])
def test_thirdparty_optimizer_fit_and_resume_equal_plain(tmp_path, mod, name, kw):
    cls = getattr(pytest.importorskip(mod), name)

    class WithIt(Tiny):
        def configure_optimizers(self):
            return cls(self.parameters(), **kw)

    plain = WithIt(batches=2)
    t_plain = fit(tmp_path / "plain", plain, ckpt_every=2)
    tiered = WithIt(batches=2)
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[TiermemCallback(cfg(tmp_path))],
                   ckpt_every=2)
    compare((tiered, t_tiered), (plain, t_plain))
    compare(*resumed_from_step_2(tmp_path, lambda: WithIt(batches=2)))


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_clipping_with_the_weights_in_the_tiers_equals_plain(tmp_path, offload):
    # Lightning clips with torch.nn.utils.clip_grad_norm_, which finds no p.grad when the
    # gradients live in the parameter tier: tiermem routes it to the tier's clip
    # (tiermem/optim/clipping.py) rather than letting it clip nothing.
    kw = dict(gradient_clip_val=0.05, accumulate_grad_batches=2, max_steps=3)
    plain = Tiny()
    t_plain = fit(tmp_path / "plain", plain, **kw)
    c = cfg(tmp_path)
    c["parameters"] = {"offload": offload}
    tiered = Tiny()
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[TiermemCallback(c)], **kw)
    compare((tiered, t_tiered), (plain, t_plain))


@pytest.mark.parametrize("name", ["EmoNavi", "MADGRAD"])
def test_overlap_with_a_step_that_reads_the_closures_loss(tmp_path, name):
    # With overlap the callback runs Lightning's closure first and steps without it: an
    # optimizer whose step reads the loss (EmoNavi) then stepped without it, different
    # from the plain fit and no error. It is refused; one that ignores it runs as plain.
    cls = getattr(pytest.importorskip("pytorch_optimizer"), name)

    class WithIt(Tiny):
        def configure_optimizers(self):
            return cls(self.parameters(), lr=1e-2)

    kw = dict(accumulate_grad_batches=2, max_steps=3)
    cb = TiermemCallback(cfg(tmp_path, overlap_backward=True))
    if name == "EmoNavi":
        tiered = WithIt()
        with pytest.raises(TierMemError, match="uses the loss"):
            fit(tmp_path / "tiered", tiered, callbacks=[cb], **kw)
        assert installed(tiered.trainer.optimizers[0]) is None
        return
    plain = WithIt()
    t_plain = fit(tmp_path / "plain", plain, **kw)
    tiered = WithIt()
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[cb], **kw)
    compare((tiered, t_tiered), (plain, t_plain))


class TwoOptimizers(Tiny):
    """Manual optimization with one optimizer per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.net[0].parameters(), lr=1e-2),
                torch.optim.SGD(self.net[2].parameters(), lr=0.05, momentum=0.9)]


@pytest.mark.parametrize("offload", ["none", "host"])
def test_two_optimizers(tmp_path, offload):
    # parameters.offload: the second optimizer's block found the weights already taken
    # by the first one's tier and failed on an empty parameter: refused up front instead.
    c = cfg(tmp_path)
    c["parameters"] = {"offload": offload}
    cb = TiermemCallback(c)
    if offload != "none":
        tiered = TwoOptimizers()
        with pytest.raises(TierMemError, match="2 optimizers"):
            fit(tmp_path / "tiered", tiered, callbacks=[cb])
        assert all(p.numel() > 0 for p in tiered.parameters())
        return
    plain = TwoOptimizers()
    t_plain = fit(tmp_path / "plain", plain)
    tiered = TwoOptimizers()
    t_tiered = fit(tmp_path / "tiered", tiered, callbacks=[cb])
    compare((tiered, t_tiered), (plain, t_plain))
    compare_state_dicts(t_tiered.optimizers[1].state_dict(), t_plain.optimizers[1].state_dict())


class _FusedOrNot(Tiny):
    """Its loss is inf at step 1: the GradScaler skips that step and halves its scale."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step == 1 else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05,
                                 fused=self.fused)


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_mixed_precision_equals_plain(tmp_path, fused):
    """fp16 mixed precision steps through Lightning's GradScaler (its plugin given, since
    precision='16-mixed' falls back to bf16 on the CPU): a fused AdamW takes the scale and
    inf flag from it (tiermem/optim/amp.py), an unfused one gets unscaled gradients; either
    way the tiered fit equals the plain one, the skipped step too."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    fits = []
    for callbacks in ([], [TiermemCallback(cfg(tmp_path))]):
        module = _FusedOrNot(fused)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        fits.append((module, fit(tmp_path / str(len(fits)), module, callbacks=callbacks,
                                 plugins=[plugin]), plugin.scaler))
    (plain, t_plain, s_plain), (tiered, t_tiered, s_tiered) = fits
    assert s_plain.get_scale() == s_tiered.get_scale() < 2.0 ** 16  # one step skipped
    compare((tiered, t_tiered), (plain, t_plain))
