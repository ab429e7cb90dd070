"""Progressive unfreezing with the weights in the tier (parameters.offload): Lightning's
BackboneFinetuning / BaseFinetuning.unfreeze_and_add_param_group (unfreeze a backbone at
epoch N, add its parameters as a param group with their own lr) and the same by hand.
Each run is compared bitwise with the same plain torch run: weights, optimizer state,
state_dict(), losses."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

import tiermem
from offload_helpers import (Synthetic, backend_params, compare_runs, compare_state_dicts,
                             config, loss_of, make_batches, side_used, swap_dir)

STEPS, UNFREEZE = 5, 2


def _model(seed: int = 0) -> Synthetic:
    return Synthetic(vocab=300, hidden=130, out=9, seed=seed)


def _backbone(m: Synthetic) -> list[torch.nn.Parameter]:
    return [m.emb.weight, m.fc1.weight, m.fc1.bias]


def _head(m: Synthetic) -> list[torch.nn.Parameter]:
    return [m.fc2.weight, m.fc2.bias, m.side.weight, m.side.bias]


def _cfg(tmp_path, backend: str, weights: str, *, overlap: bool = False,
         window: str = "384KiB", crash: bool = False) -> dict:
    c = config(tmp_path, backend=backend, host="64MiB")
    c["parameters"] = {"offload": weights, "window": window}
    c["pipeline"]["overlap_backward"] = overlap
    if crash:
        c["swap"]["durability"] = "crash_consistent"
    return c


def _unfreeze_and_add(m: Synthetic, opt: torch.optim.Optimizer) -> None:
    """BaseFinetuning.unfreeze_and_add_param_group: trainable first, then the group of the
    parameters the optimizer lacks, at a fraction of the lr."""
    for p in _backbone(m):
        p.requires_grad_(True)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    opt.add_param_group({"params": [p for p in _backbone(m) if id(p) not in held],
                         "lr": opt.param_groups[0]["lr"] / 10})


def _train(m, opt, batches, steps, *, at=None, clip=None, zero="opt", tm=None):
    """The loop both sides run; `at(step)` runs before that step's forward."""
    losses = []
    for i in steps:
        if at is not None:
            at(i)
        (tokens, target), = batches[i]
        loss = loss_of(m, tokens, target, side_used(i))
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        (opt if zero == "opt" else m).zero_grad()
    return losses


def _last_step(m, opt, batches) -> None:
    """A step with no zero_grad after it."""
    (tokens, target), = batches[0]
    loss_of(m, tokens, target, False).backward()
    opt.step()


def _frozen_backbone(seed: int = 0) -> tuple[Synthetic, Synthetic]:
    m = _model(seed)
    for p in _backbone(m):
        p.requires_grad_(False)
    return m, copy.deepcopy(m)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.01, foreach=False)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("weights", ["host", "nvme"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("unfreeze", [0, UNFREEZE], ids=["at-entry", "later"])
def test_unfreeze_a_backbone_and_add_its_group_equals_torch(tmp_path, backend, weights,
                                                            overlap, unfreeze):
    """`unfreeze` 0: the backbone's weights are all released when its group is added (laid
    out from their shapes, read in one at a time for their gradient hooks); later: the
    frozen backbone ran in the forwards before, and its weights are in the window."""
    model, ref = _frozen_backbone()
    batches = make_batches(model, STEPS)

    def at(m, opt):
        return lambda i: _unfreeze_and_add(m, opt) if i == unfreeze else None

    ref_opt = _adamw(_head(ref))
    want = _train(ref, ref_opt, batches, range(STEPS), at=at(ref, ref_opt))
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, backend, weights, overlap=overlap),
                         model=model) as tm:
        got = _train(model, opt, batches, range(STEPS), at=at(model, opt))
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict())
        parts = tm.offloaded.parts
        assert len(parts) > 2
        if overlap:
            # the new group's partitions are updated during backward too: the tier's hook
            # stores each gradient before the overlap's finds it
            for i, s in enumerate(tm.stats()[unfreeze:], start=unfreeze):
                unused = set() if side_used(i) else {id(p) for p in model.side.parameters()}
                assert s["early_partitions"] == sum(
                    all(id(x.param) not in unused for x in p.segments) for p in parts), i
    assert got == want
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("weights", ["host", "nvme"])
@pytest.mark.parametrize("clip, zero, overlap", [
    (None, "opt", False), (0.5, "opt", False), (None, "model", False), (None, "opt", True)],
    ids=["", "clip", "model-zero-grad", "overlap"])
def test_a_group_of_parameters_that_had_gradients_and_no_group_equals_torch(
        tmp_path, weights, clip, zero, overlap):
    """The backbone requires a gradient all along but is in no group until UNFREEZE: its
    p.grad in torch adds up over the steps before (opt.zero_grad() leaves it, a clip over
    model.parameters() scales it), and the first step after the add takes the sum. The
    tier used to drop those gradients at every step."""
    model = _model(1)
    ref = copy.deepcopy(model)
    batches = make_batches(model, STEPS, seed=3)

    def at(m, opt):
        return (lambda i: opt.add_param_group({"params": _backbone(m), "lr": 5e-3})
                if i == UNFREEZE else None)

    ref_opt = _adamw(_head(ref))
    want = _train(ref, ref_opt, batches, range(STEPS), at=at(ref, ref_opt), clip=clip,
                  zero=zero)
    _last_step(ref, ref_opt, batches)
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", weights, overlap=overlap),
                         model=model):
        got = _train(model, opt, batches, range(STEPS), at=at(model, opt), clip=clip,
                     zero=zero)
        _last_step(model, opt, batches)
    # every gradient the last step took was consumed, the added group's too (p.grad None
    # after the block, as documented)
    assert all(p.grad is None for p in model.parameters())
    assert got == want
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("weights", ["host", "nvme"])
def test_gradients_of_parameters_in_no_group_come_back_as_torchs(tmp_path, weights):
    """Never added: at the exit p.grad holds what torch's accumulation left (clipped)."""
    model = _model(1)
    ref = copy.deepcopy(model)
    batches = make_batches(model, 3, seed=3)
    ref_opt = _adamw(_head(ref))
    _train(ref, ref_opt, batches, range(3), clip=0.5)
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", weights), model=model):
        _train(model, opt, batches, range(3), clip=0.5)
    compare_runs(model, opt, ref, ref_opt)
    for p, q in zip(_backbone(model), _backbone(ref)):
        assert torch.equal(p.grad, q.grad)
    assert all(p.grad is None for p in _head(model))


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_a_parameter_frozen_at_entry_in_a_group_with_a_record_unfreezes(tmp_path, overlap):
    """In the optimizer, frozen when the block opened: torch passes it over (grad None)
    until it is unfrozen. Adagrad makes its state in __init__, so tiermem laid out a
    record for it; the tier now takes its gradients from its first forward unfrozen."""
    model, ref = _frozen_backbone(2)
    batches = make_batches(model, STEPS, seed=5)

    def at(m):
        return lambda i: [p.requires_grad_(True) for p in _backbone(m)] if i == UNFREEZE \
            else None

    def make(m):
        return torch.optim.Adagrad(m.parameters(), lr=0.05)

    ref_opt = make(ref)
    want = _train(ref, ref_opt, batches, range(STEPS), at=at(ref))
    opt = make(model)
    with tiermem.offload(opt, _cfg(tmp_path, "threads", "nvme", overlap=overlap,
                                   window="512KiB"), model=model):
        got = _train(model, opt, batches, range(STEPS), at=at(model))
    assert got == want
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("weights", ["none", "nvme"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_a_group_added_frozen_and_unfrozen_later_equals_torch(tmp_path, weights, overlap):
    """The backbone's group added while it is still frozen (torch passes it over until it
    is unfrozen, two steps later): a group added inside the block lays out a record for
    every parameter, frozen or not (it was refused at its first step as frozen at entry)."""
    model, ref = _frozen_backbone(6)
    batches = make_batches(model, STEPS + 1, seed=11)

    def at(m, opt):
        def now(i):
            if i == 1:
                opt.add_param_group({"params": _backbone(m), "lr": 5e-3})
            if i == 3:
                for p in _backbone(m):
                    p.requires_grad_(True)
        return now

    ref_opt = _adamw(_head(ref))
    want = _train(ref, ref_opt, batches, range(STEPS + 1), at=at(ref, ref_opt))
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", weights, overlap=overlap),
                         model=model):
        got = _train(model, opt, batches, range(STEPS + 1), at=at(model, opt))
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict())
    assert got == want
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("unfreeze", [0, UNFREEZE], ids=["released", "live"])
def test_an_unfrozen_weight_used_only_outside_the_forward_takes_its_gradient(tmp_path,
                                                                            unfreeze):
    """Unfrozen, then used by a loss term outside the model's forward, in steps whose
    forward does not use it (the side branch runs on steps 1 and 4 only): that call
    makes its gradient node, which must carry the tier's hooks, or its gradient stays in
    p.grad. `unfreeze` 0: its weights are released then (read in for the call); 2: the
    forward of step 1 left them in the window."""
    model = _model(2)
    model.side.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    batches = make_batches(model, STEPS, seed=5)

    def run(m, opt, steps):
        for i in steps:
            if i == unfreeze:
                m.side.weight.requires_grad_(True)
            (tokens, target), = batches[i]
            loss = loss_of(m, tokens, target, side_used(i))
            if m.side.weight.requires_grad:
                loss = loss + m.side.weight.square().sum() * 1e-3
            loss.backward()
            opt.step()
            opt.zero_grad()

    def make(m):  # (Adagrad lays out a record for a parameter frozen at entry)
        return torch.optim.Adagrad(m.parameters(), lr=0.05)

    ref_opt = make(ref)
    run(ref, ref_opt, range(STEPS))
    opt = make(model)
    with tiermem.offload(opt, _cfg(tmp_path, "threads", "host", window="512KiB"),
                         model=model):
        run(model, opt, range(STEPS))
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("crash", [False, True], ids=["", "crash"])
@pytest.mark.parametrize("weights", ["host", "nvme"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_a_parameter_frozen_at_entry_in_the_group_is_laid_out_when_unfrozen(
        tmp_path, overlap, weights, crash):
    """Adam keeps no state for a parameter frozen when the block opened, and tiermem laid
    out no record for it (refused once unfrozen, before): unfrozen in its group, it gets
    its records at its first step (with overlap_backward at the forward before it), its
    weights read from the tier for the lay-out, and trains as torch's."""
    model, ref = _frozen_backbone(2)
    batches = make_batches(model, 4, seed=5)
    ref_opt, opt = _adamw(ref.parameters()), _adamw(model.parameters())

    def unfreeze(m):
        return lambda i: m.fc1.weight.requires_grad_(True) if i == 2 else None
    _train(ref, ref_opt, batches, range(4), at=unfreeze(ref))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", weights, overlap=overlap,
                                   crash=crash), model=model) as tm:
        _train(model, opt, batches, range(4), at=unfreeze(model))
        assert len(tm.offloaded.late) == 1
    compare_runs(model, opt, ref, ref_opt)


def test_a_group_of_parameters_not_the_models_is_refused(tmp_path):
    model = _model()
    opt = _adamw(model.parameters())
    with tiermem.offload(opt, _cfg(tmp_path, "threads", "host"), model=model):
        with pytest.raises(tiermem.TierMemError,
                           match=r"add_param_group\(\) inside the block: .*not the model's"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        assert len(opt.param_groups) == 1  # refused means not added
        _train(model, opt, make_batches(model, 1), range(1))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("weights", ["host", "nvme"])
def test_state_dict_after_the_add_loads_into_a_fresh_tiered_optimizer(tmp_path, backend,
                                                                       weights):
    model, ref = _frozen_backbone(3)
    batches = make_batches(model, STEPS + 2, seed=7)

    def at(m, opt):
        return lambda i: _unfreeze_and_add(m, opt) if i == UNFREEZE else None

    ref_opt = _adamw(_head(ref))
    _train(ref, ref_opt, batches, range(STEPS), at=at(ref, ref_opt))
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path / "a", backend, weights), model=model):
        _train(model, opt, batches, range(STEPS), at=at(model, opt))
        sd = opt.state_dict()
    compare_state_dicts(sd, ref_opt.state_dict())
    compare_runs(model, opt, ref, ref_opt)
    want = _train(ref, ref_opt, batches, range(STEPS, STEPS + 2))
    # a fresh run: the backbone frozen again, its group added inside the block, then loaded
    again = copy.deepcopy(model)
    for p in _backbone(again):
        p.requires_grad_(False)
    opt = _adamw(_head(again))
    with tiermem.offload(opt, _cfg(tmp_path / "b", backend, weights), model=again):
        _unfreeze_and_add(again, opt)
        opt.load_state_dict(sd)
        got = _train(again, opt, batches, range(STEPS, STEPS + 2))
    assert got == want
    compare_runs(again, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("weights", ["host", "nvme"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_crash_consistent_resume_after_the_add(tmp_path, backend, weights, overlap):
    """The commit after the add holds the new group's records and weights: a copy of the
    run directory taken after a later step resumes, with the optimizer made again with
    both groups before the block, bitwise to the plain run."""
    model, ref = _frozen_backbone(4)
    batches = make_batches(model, STEPS + 1, seed=9)
    kept_at = UNFREEZE + 1  # steps done when the copy is taken

    def at(m, opt):
        return lambda i: _unfreeze_and_add(m, opt) if i == UNFREEZE else None

    ref_opt = _adamw(_head(ref))
    want = _train(ref, ref_opt, batches, range(STEPS + 1), at=at(ref, ref_opt))
    c = _cfg(tmp_path, backend, weights, overlap=overlap, crash=True)
    run, kept = swap_dir(tmp_path), tmp_path.parent / f"{tmp_path.name}-kept"
    opt = _adamw(_head(model))
    with tiermem.offload(opt, c, model=model) as tm:
        got = _train(model, opt, batches, range(kept_at), at=at(model, opt))
        assert tm.committed_step == kept_at
        shutil.copytree(run, kept)
        got += _train(model, opt, batches, range(kept_at, STEPS + 1))
    assert got == want
    compare_runs(model, opt, ref, ref_opt)
    # the crashed run's model: the backbone unfrozen, every weight zero (the resume puts
    # back the committed ones), its optimizer made again with both groups
    again = _model(4)
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    opt = _adamw(_head(again))
    opt.add_param_group({"params": _backbone(again), "lr": opt.param_groups[0]["lr"] / 10})
    kept.rename(run)
    with tiermem.offload(opt, c, model=again, resume=True) as tm:
        assert tm.resumed_step == kept_at
        resumed = _train(again, opt, batches, range(kept_at, STEPS + 1))
    assert resumed == want[kept_at:]
    compare_runs(again, opt, ref, ref_opt)


def test_a_group_added_to_a_model_on_a_gpu_is_refused(tmp_path, monkeypatch):
    """The records' layout depends on the device a parameter trains on (a device model's
    keep an fp32 master), which the released parameters no longer show: not built."""
    model = _model()
    for p in _backbone(model):
        p.requires_grad_(False)
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", "host"), model=model) as tm:
        monkeypatch.setattr(tm.offloaded.weights, "device", torch.device("cuda", 0))
        with pytest.raises(tiermem.TierMemError,
                           match="records inside the block for parameters of a model on "
                                 "cuda:0 .* not built yet: add the param group before"):
            _unfreeze_and_add(model, opt)
        monkeypatch.undo()
        assert len(opt.param_groups) == 1  # refused means not added
        _train(model, opt, make_batches(model, 1), range(1))


@pytest.mark.parametrize("weights", ["nvme"])
def test_lightning_backbone_finetuning_equals_plain(tmp_path, weights):
    """Lightning's BackboneFinetuning freezes the backbone before the fit, unfreezes it at
    epoch 1 and adds its group with add_param_group (at an lr of its own)."""
    pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    from lightning.pytorch.callbacks import BackboneFinetuning
    from test_integration_lightning import Backbone, fit
    from tiermem.integrations.lightning import TiermemCallback

    c = config(tmp_path / "swap", host=0, kernel="match")
    c["parameters"] = {"offload": weights}
    fits = []
    for tiered in (False, True):
        unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5)
        module = Backbone()
        fits.append((module, fit(tmp_path / str(tiered), module, max_epochs=3, max_steps=-1,
                                 callbacks=[TiermemCallback(c), unfreeze] if tiered
                                 else [unfreeze])))
    (plain, t_plain), (tiered, t_tiered) = fits
    assert len(t_tiered.optimizers[0].param_groups) == 2
    for (name, p), (_, q) in zip(tiered.named_parameters(), plain.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    compare_state_dicts(t_tiered.optimizers[0].state_dict(), t_plain.optimizers[0].state_dict())


def test_new_weights_assigned_to_a_released_parameter_before_the_add_are_kept(tmp_path):
    """p.data = tensor on a released parameter of the group (new weights, kept by the
    tier), then the add: laid out from the new weights, which train on."""
    model, ref = _frozen_backbone(8)
    batches = make_batches(model, 3, seed=13)
    new = torch.randn(ref.fc1.weight.shape, generator=torch.Generator().manual_seed(2))

    def run(m, opt):
        m.fc1.weight.data = new.clone()
        _unfreeze_and_add(m, opt)
        return _train(m, opt, batches, range(3))

    ref_opt = _adamw(_head(ref))
    want = run(ref, ref_opt)
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", "nvme"), model=model):
        got = run(model, opt)
    assert got == want
    compare_runs(model, opt, ref, ref_opt)


def test_a_group_with_a_parameter_changed_behind_the_tier_is_refused_and_not_added(tmp_path):
    """A released parameter changed in place where the tier cannot see it (its empty
    placeholder): refused by the add, before anything is laid out (laid out from the
    placeholder's size it took no record, and its updates were lost), the group not added."""
    model, _ = _frozen_backbone(8)
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", "nvme"), model=model):
        with torch._C.DisableTorchFunction():
            model.fc1.weight.add_(1.0)  # the empty placeholder: no weights reached
        with pytest.raises(tiermem.TierMemError, match=r"fc1\.weight was changed in place "
                                                       r"while the weights were out of memory"):
            _unfreeze_and_add(model, opt)
        assert len(opt.param_groups) == 1
        _unfreeze_and_add(model, opt)  # the weights from before are kept: it goes on
        _train(model, opt, make_batches(model, 1), range(1))


@pytest.mark.parametrize("master, crash", [("fp32", True), ("kahan", False)])
def test_a_bf16_backbone_added_equals_the_run_without_the_parameter_tier(tmp_path, master,
                                                                         crash):
    """A bf16 model's group added before any forward (its weights released) is laid out
    from the stand-ins' dtype (an fp32 master, or a Kahan term): bitwise tiermem without
    the parameter tier (plain torch keeps no fp32 master to compare with)."""
    model, ref = _frozen_backbone(10)
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    batches = make_batches(model, STEPS, seed=15)
    runs = []
    for m, weights in ((ref, "none"), (model, "nvme")):
        opt = _adamw(_head(m))
        c = _cfg(tmp_path / weights, "threads", weights, crash=crash)
        c["optimizer"].update(kernel="fused", master_weights=master)
        with tiermem.offload(opt, c, model=m):
            losses = _train(m, opt, batches, range(STEPS),
                            at=lambda i, m=m, opt=opt: (_unfreeze_and_add(m, opt)
                                                        if i == 0 else None))
            runs.append((losses, opt, opt.state_dict()))
    (want, ref_opt, ref_sd), (got, opt, sd) = runs
    assert got == want
    compare_state_dicts(sd, ref_sd)
    compare_runs(model, opt, ref, ref_opt)


def test_a_group_whose_partition_the_window_cannot_hold_is_refused_and_not_added(tmp_path):
    """The window holds the largest module (the block opens), not the weights and
    gradients of the added group's partition holding emb.weight: refused naming it, the
    group not added, the block going on."""
    from tiermem.config import ConfigError

    model, _ = _frozen_backbone()
    opt = _adamw(_head(model))
    with tiermem.offload(opt, _cfg(tmp_path, "threads", "nvme", window="100KiB"),
                         model=model):
        with pytest.raises(ConfigError, match=r"parameters.window.*one optimizer partition.*"
                                              r"\(emb\.weight, \.\.\.\)"):
            _unfreeze_and_add(model, opt)
        assert len(opt.param_groups) == 1
        _train(model, opt, make_batches(model, 1), range(1))
