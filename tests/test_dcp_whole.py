"""tiermem.dist.dcp for rules that step whole parameters: torch's Adafactor and Muon and the
generic path (a third-party optimizer: here a Lion written in the test, one with nested
state, per-parameter numbers, group counts and a count kept on itself, and schedule-free
with its group values). A checkpoint saved inside the block after two steps and loaded in
a fresh block (another partitioning) steps on bitwise as the plain optimizer that never
stopped; the saving run steps on too. Several ranks (2 -> 1 and 1 -> 2):
tests/dist_dcp_whole.py. A checkpoint of another optimizer, or a damaged one, is refused."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import tiermem
from tiermem.dist import dcp

from dist_harness import launch
from offload_helpers import Synthetic, compare_state_dicts, make_batches, train
from test_dcp import _cfg
from test_distributed import outcome
from test_optimizer_rules import params_equal


class LionLike(torch.optim.Optimizer):
    """Lion, written here: the sign of an interpolated momentum, one state tensor."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return None


class Nested(torch.optim.Optimizer):
    """State a checkpoint must carry whole: a list of two buffers (one a row statistic of
    another shape), a per-parameter count and number; a count kept in each group and one
    on the optimizer itself, both of which scale the step."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            lr = group["lr"] / (1 + 0.1 * group["k"]) * (1 + 0.01 * self.calls)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    rows = p.shape[:1] if p.dim() else ()
                    st["bufs"] = [torch.zeros_like(p), torch.zeros(rows)]
                    st["n"] = 0
                    st["scale"] = 1.0
                m, r = st["bufs"]
                st["n"] += 1
                st["scale"] = st["scale"] * 0.9 + 0.1
                m.mul_(0.9).add_(p.grad)
                sq = p.grad.square()
                r.mul_(0.5).add_(sq.reshape(sq.shape[0], -1).mean(1) if p.dim() else sq)
                p.add_(m, alpha=-lr * st["scale"] / st["n"])
        return None


def _schedulefree(params):
    sf = pytest.importorskip("schedulefree")
    return sf.AdamWScheduleFree(params, lr=1e-2, warmup_steps=2, weight_decay=0.01)


def _matrices(model):
    return [p for p in model.parameters() if p.dim() == 2]


OPTIMIZERS = {
    "adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),
    "muon": lambda m: torch.optim.Muon(_matrices(m), lr=0.01),
    "lion-like": lambda m: LionLike(m.parameters(), lr=1e-3, weight_decay=0.01),
    "nested": lambda m: Nested(m.parameters()),
    "schedulefree": lambda m: _schedulefree(m.parameters()),
}


def _modes(opt) -> None:
    if callable(getattr(type(opt), "train", None)):
        opt.train()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_round_trip_steps_on_as_the_plain_optimizer(tmp_path, name):
    make = OPTIMIZERS[name]
    model = Synthetic()
    start = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref)
    _modes(ref_opt)
    batches = make_batches(model, 5)
    ckpt = str(tmp_path / "ckpt")
    with tiermem.offload(opt, _cfg(tmp_path / "a", "threads", "64KiB"), model=model) as tm:
        _modes(opt)
        train(model, opt, batches[:2])
        dcp.save(tm, ckpt)
        train(model, opt, batches[2:], start=2)
    train(ref, ref_opt, batches[:2])
    model2 = copy.deepcopy(start)
    model2.load_state_dict(ref.state_dict())
    opt2 = make(model2)
    with tiermem.offload(opt2, _cfg(tmp_path / "b", "threads", "256KiB"), model=model2) as tm2:
        _modes(opt2)
        dcp.load(tm2, ckpt)
        train(model2, opt2, batches[2:], start=2)
    train(ref, ref_opt, batches[2:], start=2)
    params_equal(model, ref, "the saving run")
    params_equal(model2, ref, "the loading run")


def _saved(tmp_path, name, steps=2):
    model = Synthetic()
    opt = OPTIMIZERS[name](model)
    ckpt = str(tmp_path / f"ckpt-{name}")
    with tiermem.offload(opt, _cfg(tmp_path / f"s-{name}", "threads", "64KiB"),
                         model=model) as tm:
        _modes(opt)
        train(model, opt, make_batches(model, steps))
        dcp.save(tm, ckpt)
    return ckpt


@pytest.mark.parametrize("saved, loaded", [("lion-like", "nested"), ("adafactor", "lion-like"),
                                           ("lion-like", "adamw"), ("adamw", "lion-like")])
def test_checkpoint_of_another_optimizer_refused(tmp_path, saved, loaded):
    if saved == "adamw":
        model = Synthetic()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        ckpt = str(tmp_path / "ckpt-adamw")
        with tiermem.offload(opt, _cfg(tmp_path / "s", "threads", "64KiB"), model=model) as tm:
            train(model, opt, make_batches(model, 1))
            dcp.save(tm, ckpt)
    else:
        ckpt = _saved(tmp_path, saved)
    model = Synthetic()
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if loaded == "adamw"
           else OPTIMIZERS[loaded](model))
    with tiermem.offload(opt, _cfg(tmp_path / "l", "threads", "64KiB"), model=model) as tm:
        train(model, opt, make_batches(model, 1))
        before = copy.deepcopy(opt.state_dict())
        what = {"adamw": "whole-parameter optimizer's state",
                "lion-like": "elementwise optimizer's state" if saved == "adamw"
                else "holds the state of torch.optim.Adafactor",
                "nested": "holds the state of test_dcp_whole.LionLike"}[loaded]
        with pytest.raises(tiermem.TierMemError, match=what):
            dcp.load(tm, ckpt)
        compare_state_dicts(opt.state_dict(), before)  # refused before any record changed


def test_damaged_checkpoint_refused(tmp_path):
    """A flipped bit in a tensor's data (its CRC32) and a truncated file are refused, before
    any record changed: the run steps on as the plain optimizer does."""
    ckpt = _saved(tmp_path, "nested")
    (data,) = glob.glob(os.path.join(ckpt, "*.distcp"))
    raw = bytearray(open(data, "rb").read())
    md = FileSystemReader(ckpt).read_metadata()
    at = next(info for index, info in md.storage_data.items()
              if index.fqn == "tiermem.whole.1/bufs[0]")
    flipped = bytearray(raw)
    flipped[at.offset + at.length // 2] ^= 0x40
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS["nested"](model), OPTIMIZERS["nested"](ref)
    batches = make_batches(model, 3, seed=5)
    with tiermem.offload(opt, _cfg(tmp_path / "l", "threads", "64KiB"), model=model) as tm:
        train(model, opt, batches[:1])
        for damaged, why in ((flipped, "does not match its CRC32"),
                             (raw[: len(raw) * 3 // 4], f"checkpoint {ckpt}")):
            open(data, "wb").write(damaged)
            with pytest.raises(tiermem.TierMemError, match=why):
                dcp.load(tm, ckpt)
        train(model, opt, batches[1:], start=1)
    train(ref, ref_opt, batches)
    params_equal(model, ref, "after the refused loads")
