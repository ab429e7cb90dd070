"""Bugs found in review of the unstepped_state / skipped-step work: each test is red
without its fix."""

from __future__ import annotations

import copy

import torch

import tiermem
from tiermem.dist import dcp
from tiermem.swap import recover as rec
from offload_helpers import compare_runs, config, loss_of, make_batches, swap_dir
from test_optimizer_rules import state_equal
from test_recover_gaps import crash_cfg, kept, main_params, side_group, small


def _skip(model, opt, batch, scaler, use_side=True):
    scaler.scale(loss_of(model, *batch, use_side) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _step(model, opt, batch, scaler, use_side=True):
    scaler.scale(loss_of(model, *batch, use_side)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _adagrad(model):
    """A fused Adagrad whose starting accumulator is not zero."""
    return torch.optim.Adagrad(main_params(model), lr=0.05, initial_accumulator_value=0.25,
                               fused=True)


def _add_skip_step(model, ref, opt, ref_opt, batches, scaler, ref_scaler):
    """Inside the block: the side group added on both sides, a step GradScaler skips (the
    state_dicts then equal), and the tiered side's next step (the plain one's is taken
    after the block)."""
    opt.add_param_group(side_group(model, lr=2e-3))
    _skip(model, opt, batches[0][0], scaler)
    sd = opt.state_dict()
    ref_opt.add_param_group(side_group(ref, lr=2e-3))
    _skip(ref, ref_opt, batches[0][0], ref_scaler)
    state_equal(sd, ref_opt.state_dict(), "after the skipped step")
    _step(model, opt, batches[1][0], scaler)


def _adagrad_runs():
    """Two models alike, their Adagrads, the batches and a GradScaler for each."""
    model = small()
    ref = copy.deepcopy(model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1000.0) for _ in range(2)]
    return model, ref, _adagrad(model), _adagrad(ref), make_batches(model, 2), *scalers


def test_a_skipped_step_fills_an_added_adagrad_groups_accumulator(tmp_path):
    """torch's fused Adagrad makes an added group's accumulator (the defaults'
    initial_accumulator_value) when a skipped step first sees its gradients: the
    state_dict after the skip and the next step start from it."""
    model, ref, opt, ref_opt, batches, scaler, ref_scaler = _adagrad_runs()
    with tiermem.offload(opt, config(tmp_path)):
        _add_skip_step(model, ref, opt, ref_opt, batches, scaler, ref_scaler)
    _step(ref, ref_opt, batches[1][0], ref_scaler)
    compare_runs(model, opt, ref, ref_opt)


def test_a_skipped_step_fills_an_added_adagrad_groups_accumulator_across_a_crash(
        tmp_path, monkeypatch):
    """The same, the state kept on disk at the skipped step (crash_consistent): recover and
    a resume read the starting accumulator torch made, and the resumed step starts from it."""
    model, ref, opt, ref_opt, batches, scaler, ref_scaler = _adagrad_runs()

    def body():
        opt.add_param_group(side_group(model, lr=2e-3))
        _skip(model, opt, batches[0][0], scaler)

    kept(tmp_path, monkeypatch, opt, model, body)
    ref_opt.add_param_group(side_group(ref, lr=2e-3))
    _skip(ref, ref_opt, batches[0][0], ref_scaler)
    want = ref_opt.state_dict()
    state_equal(rec.gather(str(swap_dir(tmp_path)))["optimizer"], want, "recovered")
    opt2 = _adagrad(model)
    opt2.add_param_group(side_group(model, lr=2e-3))
    with tiermem.offload(opt2, crash_cfg(tmp_path), model=model, resume=True):
        state_equal(opt2.state_dict(), want, "resumed")
        _step(model, opt2, batches[1][0], scaler)
    _step(ref, ref_opt, batches[1][0], ref_scaler)
    compare_runs(model, opt2, ref, ref_opt)


def test_recover_reads_a_loaded_never_stepped_adagrad_accumulator(tmp_path, monkeypatch):
    """A state_dict loaded inside the block whose entry for a never-stepped parameter
    holds an accumulator other than this optimizer's initial_accumulator_value (saved by
    an Adagrad made with another): torch holds the loaded one, and so do tiermem's
    state_dict and a resume; recover gave the defaults' fill instead."""
    model = small()
    ref = copy.deepcopy(model)
    saved = torch.optim.Adagrad(ref.parameters(), lr=0.05, initial_accumulator_value=0.5)
    sd = saved.state_dict()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)

    def body():
        opt.load_state_dict(sd)

    kept(tmp_path, monkeypatch, opt, model, body)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05)
    ref_opt.load_state_dict(sd)
    want = ref_opt.state_dict()
    recovered = rec.gather(str(swap_dir(tmp_path)))["optimizer"]
    opt2 = torch.optim.Adagrad(model.parameters(), lr=0.05)
    with tiermem.offload(opt2, crash_cfg(tmp_path), model=model, resume=True):
        state_equal(opt2.state_dict(), want, "resumed")
    state_equal(recovered, want, "recovered")


def test_a_loaded_asgd_entry_of_step_0_is_started_from_with_its_scalars(tmp_path):
    """torch's ASGD starts a parameter holding an entry (len(state) != 0) from it, step 0
    included, eta and mu too: its first step moves the weights by the entry's eta, not by
    lr (an entry saved by an ASGD with another lr). tiermem started the first step from the
    rule's initial scalars whatever the entry said."""
    model = small()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.ASGD(m.parameters(), lr=0.01, t0=0.0)  # noqa: E731
    opt, ref_opt = make(model), make(ref)
    sd = ref_opt.state_dict()
    sd["state"] = {i: {"step": torch.tensor(0.0), "eta": torch.tensor(0.5),
                       "mu": torch.tensor(1.0), "ax": torch.zeros_like(p)}
                   for i, p in enumerate(ref.parameters())}
    ref_opt.load_state_dict(copy.deepcopy(sd))
    batches = make_batches(model, 1)
    with tiermem.offload(opt, config(tmp_path)):
        opt.load_state_dict(copy.deepcopy(sd))
        loss_of(model, *batches[0][0], True).backward()
        opt.step()
    loss_of(ref, *batches[0][0], True).backward()
    ref_opt.step()
    compare_runs(model, opt, ref, ref_opt)


def test_a_whole_rule_checkpoint_of_no_step_loaded_under_a_process_group_holds_no_state(
        tmp_path):
    """tiermem.dist.dcp.load of a whole-parameter rule's checkpoint (torch's Adafactor)
    saved before any step: no parameter holds state, so opt.state is empty (false), as the
    plain optimizer's is. Under a process group counts_loaded took the whole path's
    `stateless=[]` for 'every parameter holds state'."""
    import torch.distributed as dist

    tmp_path.chmod(0o700)  # tiermem refuses swap paths others can write
    model = small()
    c = config(tmp_path / "a")
    c["distributed"] = {"grads": "allreduced"}
    c2 = config(tmp_path / "b")
    c2["distributed"] = {"grads": "allreduced"}
    ckpt = str(tmp_path / "ckpt")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
        with tiermem.offload(opt, c, model=model, process_group=dist.group.WORLD) as tm:
            dcp.save(tm, ckpt)
        opt2 = torch.optim.Adafactor(model.parameters(), lr=1e-2)
        with tiermem.offload(opt2, c2, model=model, process_group=dist.group.WORLD) as tm:
            dcp.load(tm, ckpt)
            assert opt2.state_dict()["state"] == {}
            assert not opt2.state
    finally:
        dist.destroy_process_group()


def test_an_empty_adagrad_state_loaded_under_a_process_group_holds_no_state(tmp_path):
    """torch's load_state_dict replaces the state: an Adagrad given a state_dict with no
    entries holds none (opt.state is false), eager state or not; one process says so, a
    process group said true."""
    import torch.distributed as dist

    tmp_path.chmod(0o700)
    model = small()
    ref = torch.optim.Adagrad(copy.deepcopy(model).parameters(), lr=0.05)
    sd = ref.state_dict()
    sd["state"] = {}
    ref.load_state_dict(copy.deepcopy(sd))
    assert not ref.state
    c = config(tmp_path / "a")
    c["distributed"] = {"grads": "allreduced"}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        with tiermem.offload(opt, c, model=model, process_group=dist.group.WORLD):
            opt.load_state_dict(copy.deepcopy(sd))
            assert opt.state_dict()["state"] == {}
            assert not opt.state
    finally:
        dist.destroy_process_group()


def test_a_skipped_step_fills_an_added_adagrad_group_under_a_process_group(tmp_path):
    """The skipped step's Adagrad fill of an added group, through the distributed skip path
    (DDP's all-reduced gradients, world size 1): state_dict and the next step as torch's."""
    import torch.distributed as dist

    tmp_path.chmod(0o700)
    model, ref, opt, ref_opt, batches, scaler, ref_scaler = _adagrad_runs()
    c = config(tmp_path / "a")
    c["distributed"] = {"grads": "allreduced"}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        with tiermem.offload(opt, c, model=model, process_group=dist.group.WORLD):
            _add_skip_step(model, ref, opt, ref_opt, batches, scaler, ref_scaler)
    finally:
        dist.destroy_process_group()
    _step(ref, ref_opt, batches[1][0], ref_scaler)
    compare_runs(model, opt, ref, ref_opt)
