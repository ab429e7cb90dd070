"""Scenarios found by a 2-rank search over what a single-process search had found buggy
(frozen parameters, set_to_none=False, grads None on some ranks, weight edits, Adagrad
groups added or never stepped, crash-consistent resumes after them): one gloo group of 2
runs them all (tests/dist_scenarios.py), each test reports one, as test_distributed.py
does; one bug, in the crash-consistent commit, is checked in one process too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import tiermem
from dist_harness import launch
from test_distributed import outcome
from offload_helpers import (Synthetic, assert_same_tensor, config, loss_of, make_batches,
                             side_used)

FOUND = ["adagrad-added-group", "fsdp2-adagrad-added-group", "dcp-adagrad-stateless",
         "crash-edit-unstepped"]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    d = tmp_path_factory.mktemp("found")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return launch(2, "dist_scenarios", "run_named", str(d), FOUND, {}, deadline=300)


@pytest.mark.parametrize("name", FOUND)
def test_found(found, name):
    outcome(found, name)



def test_one_process_commit_keeps_weights_edited_before_a_step_they_take_no_part_in(tmp_path):
    """crash-edit-unstepped in one process, killed (SIGKILL) after the commit of the step
    the side branch took no part in: the resume gives the weights the model held then,
    the loaded ones for side.*, bitwise."""
    swap = tmp_path / "swap"
    swap.mkdir(mode=0o700)
    code = f"""
import sys, torch, os, signal
sys.path.insert(0, {os.path.dirname(__file__)!r})
import tiermem
from offload_helpers import Synthetic, config, loss_of, make_batches, side_used
m = Synthetic(); o = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
cfg = config({str(swap)!r}); cfg["swap"]["durability"] = "crash_consistent"
batches = make_batches(m, 4)
with tiermem.offload(o, cfg, model=m, name="c"):
    for i, micro in enumerate(batches):
        if i == 3:
            with torch.no_grad():
                m.load_state_dict(Synthetic(seed=3).state_dict())
        loss_of(m, *micro[0], side_used(i)).backward()
        o.step(); o.zero_grad()
    os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ref = Synthetic()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for i, micro in enumerate(make_batches(ref, 4)):
        if i == 3:
            assert not side_used(i)
            with torch.no_grad():
                ref.load_state_dict(Synthetic(seed=3).state_dict())
        loss_of(ref, *micro[0], side_used(i)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = Synthetic(seed=5)  # other weights: the resume must put the committed ones back
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    cfg = config(swap)
    cfg["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, cfg, model=model, name="c", resume=True) as tm:
        assert tm.resumed_step == 4
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_same_tensor(p.detach(), q.detach(), f"resumed {n}")
