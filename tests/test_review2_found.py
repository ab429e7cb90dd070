"""Bugs found by the second review of the late lay-out (a parameter frozen when the block
opened, unfrozen inside it), the device weights' write-back and the distributed adds."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

import tiermem
import tiermem.optim.offloaded
import tiermem.swap.store
import tiermem.tiers.manager
from tiermem.device.lanes import DeferredBackend
from offload_helpers import compare_runs, config


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    m[0].weight.requires_grad_(False)  # frozen when the block opens: no record
    return m


X = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))


def _trained(model, opt, steps=1):
    for _ in range(steps):
        model(X).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _retried_then_resumed(tmp_path, monkeypatch, where, name, fake, error, match):
    """The first lay-out of an unfrozen parameter's records fails (`where.name` replaced by
    `fake` for that step, raising `error`); the step is retried with the fault gone, the
    state kept as a crash leaves it, and resumed: it goes on as the plain run."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _trained(ref, ref_opt)
    ref[0].weight.requires_grad_(True)
    _trained(ref, ref_opt, 2)
    cfg = config(tmp_path, host=0, kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, cfg, model=model) as tm:
        _trained(model, opt)
        model[0].weight.requires_grad_(True)
        model(X).square().mean().backward()
        with monkeypatch.context() as m:
            m.setattr(where, name, fake)
            with pytest.raises(error, match=match):
                opt.step()
        opt.step()  # the fault gone: the same gradients
        opt.zero_grad()
        tm.offloaded.keep_on_disk()  # what a crash leaves: the committed records
        tm.discard()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 2
        model[0].weight.requires_grad_(True)
        _trained(model, opt)
    compare_runs(model, opt, ref, ref_opt)


def test_a_late_lay_out_refused_for_a_full_disk_then_retried_resumes(tmp_path, monkeypatch):
    """The swap path is full at the lay-out. The store had placed the failed records all
    the same (the file grew, their slots were kept): the retry placed them again further
    on, where a resume, which places each record after the one before, did not look."""
    _retried_then_resumed(tmp_path, monkeypatch, tiermem.swap.store, "free_bytes",
                          lambda path: 0, tiermem.TierMemError, "free")


def test_a_late_lay_out_failing_for_its_buffers_then_retried_resumes(tmp_path, monkeypatch):
    """As the full disk above, a step later: the lay-out's records were placed in the swap
    file, then the larger pipeline buffers they need could not be had (pinned memory): the
    retry placed the records again further on, where a resume did not look."""
    def no_memory(*args, **kwargs):
        raise MemoryError("no pinned memory for the buffers")

    _retried_then_resumed(tmp_path, monkeypatch, tiermem.tiers.manager, "BufferPool",
                          no_memory, MemoryError, "pinned")


def test_a_load_failing_after_a_late_lay_out_leaves_the_last_commit(tmp_path, monkeypatch):
    """A state_dict loaded inside the block giving state to a parameter frozen when it
    opened lays its records out. The lay-out committed at once, in the middle of the load:
    every step count already reset and no loaded state in the records yet. A load that
    then failed (or a crash before its own commit) resumed to that: the last committed
    step's moments with the step counts at 0, where it must resume the last commit."""
    model = _model()
    ref = copy.deepcopy(model)
    src = copy.deepcopy(model)
    src[0].weight.requires_grad_(True)
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    _trained(src, src_opt)  # state for every parameter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _trained(ref, ref_opt, 2)
    cfg = config(tmp_path / "swap", host=0, kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"
    image = tmp_path / "image"
    with tiermem.offload(opt, cfg, model=model) as tm:
        _trained(model, opt)
        with monkeypatch.context() as m:
            m.setattr(tiermem.optim.offloaded, "scatter",
                      lambda *a, **k: (_ for _ in ()).throw(OSError("the load failed")))
            with pytest.raises(OSError, match="the load failed"):
                opt.load_state_dict(src_opt.state_dict())
        run = tm.offloaded.tiers.run_dir()
        shutil.copytree(run, image)  # what a crash now leaves on disk
        tm.discard()
    shutil.rmtree(run, ignore_errors=True)  # (discard removed it)
    shutil.copytree(image, run)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 1
        _trained(model, opt)
    compare_runs(model, opt, ref, ref_opt)


def test_an_evaluation_under_inference_mode_lays_out_normal_records(tmp_path):
    """With overlap_backward a parameter unfrozen inside the block is laid out at the next
    forward of the model, which may be an evaluation under torch.inference_mode(): the
    records (pinned host memory, the swap pipeline's buffers) were made there as inference
    tensors, and the next step's update failed writing them ("Inplace update to inference
    tensor outside InferenceMode")."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    cfg = config(tmp_path, host="20KiB", kernel="match")
    cfg["pipeline"]["overlap_backward"] = True

    def run(m, o):
        _trained(m, o)
        m[0].weight.requires_grad_(True)
        with torch.inference_mode():
            m(X)
        _trained(m, o, 2)

    run(ref, ref_opt)
    with tiermem.offload(opt, cfg, model=model):
        run(model, opt)
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("device", [False, True], ids=["", "device"])
def test_an_edit_of_a_weight_that_takes_no_step_is_committed(tmp_path, device):
    """With parameters.offload, a weight the optimizer holds changed in place between steps
    (p.mul_() under no_grad; on a device model, copied back since the last change) and
    then taking no step (frozen again): the crash-consistent commit kept its record's
    master of before the change, and a resume put those weights back (torch's model has
    the changed ones). The commit copies such weights into their masters, as it does on
    an fp32 CPU model without the tier."""
    def made():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.Tanh(),
                                   torch.nn.Linear(200, 8))

    model = made()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    cfg = config(tmp_path / "swap", host="20KiB", kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"
    cfg["parameters"] = {"offload": "nvme"}

    def run(m, o):
        _trained(m, o)
        with torch.no_grad():
            m[0].weight.mul_(0.5)
        m[0].weight.requires_grad_(False)
        _trained(m, o)

    run(ref, ref_opt)
    _trained(ref, ref_opt)
    image = tmp_path / "image"
    with tiermem.offload(opt, cfg, model=model,
                         streams=DeferredBackend() if device else None) as tm:
        run(model, opt)
        run_dir = tm.offloaded.tiers.run_dir()
        shutil.copytree(run_dir, image)  # what a crash now leaves on disk
        tm.discard()
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(image, run_dir)
    model = made()  # (the script started over; the resume writes the committed weights)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg, model=model, resume=True,
                         streams=DeferredBackend() if device else None) as tm:
        assert tm.resumed_step == 2
        model[0].weight.requires_grad_(False)
        _trained(model, opt)
    compare_runs(model, opt, ref, ref_opt)


