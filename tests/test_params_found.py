"""The parameter tier against what user code does to the weights between steps, with a
window smaller than the model: each change kept exactly (bitwise the plain run) or
refused with an error that names it.

Between uses a released parameter's p.data is an empty tensor, and code outside the
model's forward sees that tensor: an in-place change of it changed nothing, and a new
dtype given to it was undone by the next read of the record, both without a word.
"""

from __future__ import annotations

import threading

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
    with torch._C.DisableTorchFunction():  # as the tier left them (p.shape says the record's)
        return [n for n, p in model.named_parameters() if p.numel() == 0]


def _elsewhere(edit, model: nn.Module) -> None:
    """`edit(model)` on another thread than the block's: the tier's torch function mode
    (which materialises a released weight handed to a torch call, and keeps the change) is
    that thread's only, so there the edit reaches the empty placeholder."""
    failed = []

    def run() -> None:
        try:
            edit(model)
        except BaseException as exc:  # pragma: no cover - shown by the assert below
            failed.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not failed, failed


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
    # plain run's differ), and the exit gave back the old weights too. (On the block's
    # thread the change is kept: tests/test_params_reads.py.)
    model = Net()
    opt = make_opt(model)
    (t, y), (t2, y2) = batches(2)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
        _step(model, opt, t, y)
        assert _released(model)  # the window is smaller than the model
        _elsewhere(edit, model)
        with pytest.raises(TierMemError, match="changed in place while the weights were out "
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
            _elsewhere(_init, model)
            _step(model, opt, t, y)


def test_an_in_place_change_just_before_the_exit_is_refused(tmp_path):
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with pytest.raises(TierMemError, match="changed in place"):
        with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
            _step(model, opt, t, y)
            _elsewhere(_mul, model)
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
        # (at the conversion itself: each parameter is read for it, and the first one the
        # window lets go is found converted)
        with pytest.raises(TierMemError, match="given new data inside the block"):
            convert(model)
            loss_of(model, t, y)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.numel() > 0 for p in model.parameters())


# -- torch.optim.swa_utils.AveragedModel ------------------------------------------------


class Normed(Net):
    """Net with a BatchNorm, whose running statistics are buffers AveragedModel averages
    (use_buffers=True) or copies."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(Net().emb.embedding_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.emb(t).transpose(1, 2)).transpose(1, 2)
        return self.head(self.ln(self.b2(self.b1(x))))


def _averaging(kind: str) -> dict:
    from torch.optim import swa_utils

    return {"swa": {}, "ema": {"avg_fn": swa_utils.get_ema_avg_fn(0.9)},
            "ema-multi": {"multi_avg_fn": swa_utils.get_ema_multi_avg_fn(0.9)},
            "swa-buffers": {"use_buffers": True},
            "own-multi": {"multi_avg_fn": _own_multi}}[kind]


def _own_multi(averaged: list[torch.Tensor], current: list[torch.Tensor], n) -> None:
    # a multi_avg_fn of the user's own: it may combine the tensors of the list
    with torch.no_grad():
        total = sum(c.sum() for c in current)
        for a, c in zip(averaged, current):
            a.lerp_(c, 0.5).add_(total * 1e-6)


def _averaged_runs(tmp_path, kind: str, window: str):
    """(plain averaged model, tiered averaged model, the tiered block's param stats)."""
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    ref = Normed()
    model = Normed()
    model.load_state_dict(ref.state_dict())
    data = batches(4)
    averaged = []
    for m in (ref, model):
        averaged.append(AveragedModel(m, **_averaging(kind)))

    def run(m, avg, opt):
        for t, y in data:
            _step(m, opt, t, y)
            avg.update_parameters(m)

    run(ref, averaged[0], make_opt(ref))
    opt = make_opt(model)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme", window=window), model=model) as tm:
        run(model, averaged[1], opt)
        assert _released(model) or window == "4MiB"
        stats = tm.param_stats()
    assert_same_model(ref, model)
    return averaged[0], averaged[1], stats


@pytest.mark.parametrize("kind", ["swa", "ema", "ema-multi", "swa-buffers"])
def test_averaged_model_with_a_window_smaller_than_the_model(tmp_path, kind):
    # update_parameters read the released weights' empty placeholders: "The size of
    # tensor a (64) must match the size of tensor b (0)", naming nothing.
    want, got, stats = _averaged_runs(tmp_path, kind, "176KiB")
    assert stats["evictions"] > 0
    assert int(got.n_averaged) == int(want.n_averaged) == 4
    for (n, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), n


def test_averaged_model_with_its_own_multi_avg_fn(tmp_path):
    # it sees the whole model's lists: exact with a window for the whole model, refused
    # (naming the window it needs) below that
    want, got, _ = _averaged_runs(tmp_path / "a", "own-multi", "4MiB")
    for (n, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), n
    with pytest.raises(TierMemError, match="multi_avg_fn of its own.*parameters.window"):
        _averaged_runs(tmp_path / "b", "own-multi", "176KiB")


def test_a_deep_copy_inside_the_block_is_refused(tmp_path):
    # AveragedModel(model) made inside the block failed in deepcopy on the tier's own
    # objects ("cannot pickle '_cffi_backend._CDataBase' object"), and a copy of a
    # submodule had empty weights, with hooks that fetched the original's.
    import copy

    from torch.optim.swa_utils import AveragedModel

    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
        _step(model, opt, t, y)
        with pytest.raises(TierMemError, match="deepcopy reached the model inside the tiermem"):
            AveragedModel(model)
        with pytest.raises(TierMemError, match="deepcopy reached b1.ln inside"):
            copy.deepcopy(model.b1)
    twin = copy.deepcopy(model)  # after the block, the model is an ordinary one again
    assert_same_model(model, twin)


def test_lightning_ema_weight_averaging_with_a_window_smaller_than_the_model(tmp_path):
    # EMAWeightAveraging averages after every step (AveragedModel.update_parameters),
    # swaps the averaged weights in for validation and copies them in at the end of
    # training, both through p.data of every parameter: the released ones were empty
    # there ("The size of tensor a (0) must match the size of tensor b (128)").
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from offload_helpers import listdir
    from test_integration_lightning import Tiny, fit
    from test_integration_scenarios2 import cfg as lightning_cfg
    from tiermem.integrations.lightning import TiermemCallback

    class Deep(Tiny):
        def __init__(self) -> None:
            super().__init__(batches=2)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(16, 128),
                                         *[nn.Linear(128, 128) for _ in range(9)],
                                         nn.Linear(128, 8))

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", (self.net(x) - y).square().mean())

        def val_dataloader(self):
            return self.train_dataloader()

    c = lightning_cfg(tmp_path, "nvme")
    c["parameters"]["window"] = "320KiB"  # of 660 KiB of weights
    kw = dict(max_steps=2, limit_val_batches=1)
    plain = Deep()
    fit(tmp_path / "plain", plain, callbacks=[EMAWeightAveraging(decay=0.5)], **kw)
    tiered = Deep()
    callback = TiermemCallback(c)
    seen = {}

    class Released(EMAWeightAveraging):
        def on_validation_epoch_start(self, trainer, pl_module):
            seen["released"] = len(_released(pl_module))
            super().on_validation_epoch_start(trainer, pl_module)

    fit(tmp_path / "tiered", tiered, callbacks=[callback, Released(decay=0.5)], **kw)
    assert seen["released"] > 0
    assert_same_model(plain, tiered)
    assert listdir(tmp_path / "swap") == []


def test_new_weights_not_contiguous_are_refused(tmp_path):
    # A transposed tensor assigned to p.data was taken as the window copy: a view of it
    # autograd saved was rebuilt, after an eviction, with the transposed strides on the
    # record's contiguous copy (a wrong gradient, silently).
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    w = model.b1.fc1.weight.detach().clone()  # (128, 64)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
        _step(model, opt, t, y)
        model.b1.fc1.weight.data = w.clone()  # kept
        model.b2.fc1.weight.data = torch.zeros(64, 128).t()  # same shape, transposed
        with pytest.raises(TierMemError, match="not contiguous"):
            loss_of(model, t, y)
        assert torch.equal(model.state_dict()["b1.fc1.weight"], w)


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_an_evaluation_under_inference_mode_between_steps(tmp_path, offload):
    # The weights the evaluation brought in were inference tensors (their buffers made in
    # inference mode): the next training forward failed with "Inference tensors cannot be
    # saved for backward".
    ref, model = twins()
    data = batches(3)

    def run(m, opt):
        out = []
        for t, y in data:
            out.append(_step(m, opt, t, y))
            with torch.inference_mode():
                out.append(loss_of(m, t, y).item())
        return out

    want = run(ref, make_opt(ref))
    opt = make_opt(model)
    # no reads ahead (started outside inference mode): the evaluation reads its own
    with tiermem.offload(opt, cfg(tmp_path, offload=offload, prefetch=0), model=model) as tm:
        got = run(model, opt)
        assert tm.param_stats()["evictions"] > 0
    assert got == want
    assert_same_model(ref, model)


class Reentrant(Net):
    """Blocks under torch.utils.checkpoint with use_reentrant=True: the recomputation in
    backward calls the blocks outside the model's forward."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.emb(t)
        x = checkpoint(self.b1, x, use_reentrant=True)
        x = checkpoint(self.b2, x, use_reentrant=True)
        x = self.b1(x)
        return self.head(self.ln(x))


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_reentrant_activation_checkpointing(tmp_path, overlap):
    # The recomputed forward saved the LayerNorm's weight as the parameter itself, not
    # through the tier's saved-tensor hooks (pushed by the model's forward only): evicted
    # before the inner backward read it, "Expected weight to be of same shape as
    # normalized_shape, but got weight of shape [0]".
    import copy

    from test_params_parity import plain_run, tiered_run

    torch.manual_seed(0)
    ref = Reentrant()
    model = copy.deepcopy(ref)
    data = batches(3)
    want, _ = plain_run(ref, data)
    c = cfg(tmp_path, offload="nvme", window="256KiB" if overlap else "176KiB")
    c["pipeline"]["overlap_backward"] = overlap
    got, _, stats = tiered_run(model, data, c)
    assert got == want
    assert_same_model(ref, model)
    assert stats["evictions"] > 0


def test_a_submodule_called_outside_the_models_forward(tmp_path):
    # An auxiliary loss through one block, called on its own: its saved weights bypassed
    # the tier's hooks, and the model's forward after it evicted them before backward.
    ref, model = twins()
    data = batches(3)

    def run(m, opt):
        losses = []
        for t, y in data:
            aux = m.b2(m.emb(t)).square().mean()  # outside m's forward
            loss = loss_of(m, t, y) + aux
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    want = run(ref, make_opt(ref))
    opt = make_opt(model)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model) as tm:
        got = run(model, opt)
        assert tm.param_stats()["evictions"] > 0
    assert got == want
    assert_same_model(ref, model)


def test_an_inference_mode_forward_keeps_its_grad_mode_inside_the_tier(tmp_path):
    # Leaving inference mode for the tier's own work turned grad mode on with it: a
    # parameter unfrozen inside the block was refused during an evaluation that computes
    # no gradient, which runs as in torch. (The tier takes an unfrozen parameter's
    # gradients now, and the optimizer lays out its records at its first step.)
    ref, model = twins()
    (t, y), = batches(1)
    for m in (ref, model):
        m.b2.ln.weight.requires_grad_(False)
    ref_opt, opt = make_opt(ref), make_opt(model)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
        for m, o in ((ref, ref_opt), (model, opt)):
            _step(m, o, t, y)
            m.b2.ln.weight.requires_grad_(True)
            with torch.inference_mode():
                loss_of(m, t, y)
            _step(m, o, t, y)
    assert_same_model(ref, model)
