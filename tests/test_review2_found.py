"""Bugs found by the second review of the late lay-out (a parameter frozen when the block
opened, unfrozen inside it), the device weights' write-back and the distributed adds."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
import tiermem.swap.store
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


def test_a_late_lay_out_refused_for_a_full_disk_then_retried_resumes(tmp_path, monkeypatch):
    """The first lay-out of an unfrozen parameter's records fails (the swap path is full);
    the step is retried once there is room. The store had placed the failed records all
    the same (the file grew, their slots were kept): the retry placed them again further
    on, where a resume, which places each record after the one before, did not look."""
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
            m.setattr(tiermem.swap.store, "free_bytes", lambda path: 0)
            with pytest.raises(tiermem.TierMemError, match="free"):
                opt.step()
        opt.step()  # room again: the same gradients
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
