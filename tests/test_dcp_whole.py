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

from dist_dcp_whole import (OPTIMIZERS, fsdp2_one_process, fsdp2_one_save, missing, modes,
                            one_process_load, one_process_save)
from dist_harness import launch
from offload_helpers import Synthetic, compare_state_dicts, make_batches, train
from test_dcp import _cfg
from test_distributed import outcome
from test_optimizer_rules import params_equal

NAMES = list(OPTIMIZERS)


def _skip_missing(name: str) -> None:
    if missing(name):
        pytest.skip(f"{missing(name)} is not installed (the thirdparty test extra)")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_round_trip_steps_on_as_the_plain_optimizer(tmp_path, name):
    _skip_missing(name)
    make = OPTIMIZERS[name]
    model = Synthetic()
    start = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref)
    modes(ref_opt)
    batches = make_batches(model, 5)
    ckpt = str(tmp_path / "ckpt")
    with tiermem.offload(opt, _cfg(tmp_path / "a", "threads", "64KiB"), model=model) as tm:
        modes(opt)
        train(model, opt, batches[:2])
        dcp.save(tm, ckpt)
        train(model, opt, batches[2:], start=2)
    train(ref, ref_opt, batches[:2])
    model2 = copy.deepcopy(start)
    model2.load_state_dict(ref.state_dict())
    opt2 = make(model2)
    with tiermem.offload(opt2, _cfg(tmp_path / "b", "threads", "256KiB"), model=model2) as tm2:
        modes(opt2)
        dcp.load(tm2, ckpt)
        train(model2, opt2, batches[2:], start=2)
    train(ref, ref_opt, batches[2:], start=2)
    params_equal(model, ref, "the saving run")
    params_equal(model2, ref, "the loading run")


@pytest.mark.parametrize("saved, loaded", [("scratch", "crash_consistent"),
                                           ("crash_consistent", "scratch")])
def test_checkpoint_moves_between_durabilities(tmp_path, saved, loaded):
    """crash_consistent records keep an fp32 master of every parameter, scratch ones of an
    fp32 CPU model none: a master the checkpoint lacks is the model's weights, one the
    loading run does not keep is left out; the loaded run commits what it loaded."""
    model = Synthetic()
    start, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS["nested"](model), OPTIMIZERS["nested"](ref)
    batches = make_batches(model, 4)

    def cfg(name, durability):
        c = _cfg(tmp_path / name, "threads", "64KiB")
        c["swap"]["durability"] = durability
        return c
    with tiermem.offload(opt, cfg("a", saved), model=model) as tm:
        train(model, opt, batches[:2])
        dcp.save(tm, str(tmp_path / "ckpt"))
    train(ref, ref_opt, batches[:2])
    model2 = copy.deepcopy(start)
    model2.load_state_dict(ref.state_dict())
    opt2 = OPTIMIZERS["nested"](model2)
    with tiermem.offload(opt2, cfg("b", loaded), model=model2) as tm2:
        assert ("master" in tm2.offloaded.parts[0].kinds) == (loaded == "crash_consistent")
        dcp.load(tm2, str(tmp_path / "ckpt"))
        train(model2, opt2, batches[2:], start=2)
    train(ref, ref_opt, batches[2:], start=2)
    params_equal(model2, ref, f"saved {saved}, loaded {loaded}")


def _saved(tmp_path, name, steps=2):
    model = Synthetic()
    opt = OPTIMIZERS[name](model)
    ckpt = str(tmp_path / f"ckpt-{name}")
    with tiermem.offload(opt, _cfg(tmp_path / f"s-{name}", "threads", "64KiB"),
                         model=model) as tm:
        modes(opt)
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
                "nested": "holds the state of dist_dcp_whole.LionLike"}[loaded]
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
                             (raw[: len(raw) * 3 // 4], f"checkpoint {ckpt} cannot be read")):
            open(data, "wb").write(damaged)
            with pytest.raises(tiermem.TierMemError, match=why):
                dcp.load(tm, ckpt)
        open(data, "wb").write(raw)
        os.rename(os.path.join(ckpt, ".metadata"), os.path.join(ckpt, "gone"))
        with pytest.raises(tiermem.TierMemError, match=f"checkpoint {ckpt} cannot be read"):
            dcp.load(tm, ckpt)
        train(model, opt, batches[1:], start=1)
    train(ref, ref_opt, batches)
    params_equal(model, ref, "after the refused loads")


def test_parameters_offload_refused(tmp_path):
    """With the weights in their own tier (empty parameters between uses) the path is not
    built: refused by name, the block goes on."""
    model = Synthetic()
    opt = OPTIMIZERS["lion-like"](model)
    cfg = _cfg(tmp_path / "a", "threads", "64KiB")
    cfg["parameters"] = {"offload": "host"}
    with tiermem.offload(opt, cfg, model=model) as tm:
        train(model, opt, make_batches(model, 1))
        for call in (dcp.save, dcp.load):
            with pytest.raises(tiermem.TierMemError, match="with parameters.offload is not"):
                call(tm, str(tmp_path / "ckpt"))
        train(model, opt, make_batches(model, 1), start=1)
    assert not (tmp_path / "ckpt").exists()


# -- another world size ------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One-process checkpoints (one-<name>) for the 2 ranks to load; theirs land here too."""
    d = tmp_path_factory.mktemp("dcp-whole")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    for name in NAMES:
        if not missing(name):
            one_process_save(name, str(d / f"s-{name}"), str(d / f"one-{name}"))
    fsdp2_one_save(str(d / "s-fsdp2"), str(d))
    return d


@pytest.fixture(scope="module")
def two(shared):
    names = [f"two-ranks-{n}" for n in NAMES if not missing(n)] + ["other-refused",
                                                                     "fsdp2"]
    base = shared / "ranks"
    base.mkdir(mode=0o700)
    return launch(2, "dist_dcp_whole", "run_named", str(base), names, str(shared),
                  deadline=600)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_save_and_load_any_world_size(two, shared, tmp_path, name):
    """2 ranks save (each the parameters it owns) and step on; the checkpoint loads in one
    process (2 -> 1), and one process's on 2 ranks (1 -> 2): every run steps on as the
    plain optimizer on the mean gradient."""
    _skip_missing(name)
    outcome(two, f"two-ranks-{name}")
    one_process_load(name, str(tmp_path), str(shared / f"two-{name}"))


def test_another_optimizers_checkpoint_refused_on_two_ranks(two):
    outcome(two, "other-refused")


def test_fsdp2_owners_save_and_load_any_world_size(two, shared, tmp_path):
    """Adafactor over fully_shard parameters: each owner writes the whole state of the
    parameters it steps; the checkpoint loads on 2 ranks with other partitions and in one
    process (plain parameters), and one process's on the owners: every run steps on as
    the plain optimizer on the mean gradient."""
    outcome(two, "fsdp2")
    fsdp2_one_process(str(tmp_path), str(shared))
