"""tiermem.dist.dcp in one process, for every rule it checkpoints: a checkpoint saved after
two steps and loaded into another partitioning (a resharded load) gives back exactly the
saved state, per-parameter scalars included (ASGD's eta and mu, NAdam's mu_product), in
the loading run's own state dtype; both runs then step on as the plain optimizer does.
(Several ranks: test_distributed.py; whole-parameter rules: test_dcp_whole.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from tiermem.dist import dcp

from offload_helpers import (Synthetic, backend_params, compare_state_dicts, config,
                             make_batches, train)
from test_optimizer_rules import params_equal


def _cfg(path, backend, partition_size, **optimizer):
    c = config(path, backend=backend, host="64KiB", partition_size=partition_size)
    c["optimizer"].update(optimizer)
    return c


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", [
    (torch.optim.ASGD, dict(lr=0.01, t0=1)),
    (torch.optim.NAdam, dict(lr=0.01, momentum_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (torch.optim.Adagrad, dict(lr=0.05, initial_accumulator_value=0.1)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    (torch.optim.Rprop, dict(lr=0.01)),
    (torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
], ids=lambda v: getattr(v, "__name__", None))
def test_checkpoint_round_trip_steps_on_as_the_plain_optimizer(tmp_path, backend, cls, kw):
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, 5)
    ckpt = str(tmp_path / "ckpt")
    with tiermem.offload(opt, _cfg(tmp_path / "a", backend, "64KiB"), model=model) as tm:
        train(model, opt, batches[:2])
        dcp.save(tm, ckpt)
        saved = copy.deepcopy(opt.state_dict())
        train(model, opt, batches[2:], start=2)
    model2 = copy.deepcopy(ref)
    opt2 = cls(model2.parameters(), **kw)
    train(ref, ref_opt, batches[:2])
    model2.load_state_dict(ref.state_dict())
    with tiermem.offload(opt2, _cfg(tmp_path / "b", backend, "128KiB"), model=model2) as tm2:
        dcp.load(tm2, ckpt)
        compare_state_dicts(opt2.state_dict(), saved, exact=True)
        train(model2, opt2, batches[2:], start=2)
    train(ref, ref_opt, batches[2:], start=2)
    params_equal(model, ref, "the saving run")
    params_equal(model2, ref, "the loading run")
    compare_state_dicts(opt2.state_dict(), ref_opt.state_dict(), exact=True)


@pytest.mark.parametrize("saved, loaded", [("int8", "int8"), ("bf16", "fp32"),
                                           ("int8", "fp32"), ("fp32", "int8")])
def test_checkpoint_moves_state_between_dtypes(tmp_path, saved, loaded):
    """bf16 and int8 moments are saved as their fp32 values and stored in the loading run's
    dtype: state_dict() after the load is what it was (exactly, where the loading dtype
    holds it: int8 codes re-quantise to themselves), or what loading that state_dict
    would give."""
    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    batches = make_batches(model, 2)
    ckpt = str(tmp_path / "ckpt")
    native = dict(kernel="native", state_dtype=saved)
    with tiermem.offload(opt, _cfg(tmp_path / "a", "threads", "64KiB", **native),
                         model=model) as tm:
        train(model, opt, batches)
        dcp.save(tm, ckpt)
        sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    for cut in ("128KiB", "64KiB"):
        want = torch.optim.AdamW(copy.deepcopy(model2).parameters(), lr=0.01)
        cfg = _cfg(tmp_path / f"w{cut}", "threads", cut, kernel="native", state_dtype=loaded)
        with tiermem.offload(want, cfg):
            want.load_state_dict(sd)
            expected = want.state_dict()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
        cfg = _cfg(tmp_path / f"b{cut}", "threads", cut, kernel="native", state_dtype=loaded)
        with tiermem.offload(opt2, cfg, model=model2) as tm2:
            dcp.load(tm2, ckpt)
            got = opt2.state_dict()
        compare_state_dicts(got, expected, exact=True)
        if saved == loaded or loaded == "fp32":
            compare_state_dicts(got, sd, exact=True)


@pytest.mark.parametrize("saved, loaded", [
    (("none", "scratch"), ("none", "crash_consistent")),  # + the record's copy of the weights
    (("kahan", "scratch"), ("kahan", "crash_consistent")),
    (("fp32", "scratch"), ("kahan", "scratch")),  # the term, from the master
    (("kahan", "scratch"), ("fp32", "scratch")),  # the master: the weight plus its term
    (("none", "crash_consistent"), ("kahan", "scratch"))])  # a term of 0
def test_checkpoint_of_a_bf16_model_moves_between_master_weights(tmp_path, saved, loaded):
    """A bf16 model's checkpoint lacks the kinds of another master_weights or durability:
    a load makes them as load_state_dict does from the state_dict (the master from the
    weight and its Kahan term, a term from the master, the record's weights from the
    model), so state_dict() after it is what loading the saving run's state_dict gives."""
    model = Synthetic(vocab=300, hidden=130, out=9).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def cfg(where, master_durability):
        c = _cfg(tmp_path / where, "threads", "64KiB", kernel="native",
                 master_weights=master_durability[0])
        c["swap"]["durability"] = master_durability[1]
        return c

    ckpt = str(tmp_path / "ckpt")
    with tiermem.offload(opt, cfg("a", saved), model=model) as tm:
        train(model, opt, make_batches(model, 2))
        dcp.save(tm, ckpt)
        sd = copy.deepcopy(opt.state_dict())
    want = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=0.01)
    with tiermem.offload(want, cfg("w", loaded)):
        want.load_state_dict(sd)
        expected = want.state_dict()
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.01)
    with tiermem.offload(opt2, cfg("b", loaded), model=model) as tm2:
        dcp.load(tm2, ckpt)
        compare_state_dicts(opt2.state_dict(), expected, exact=True)


def test_checkpoint_without_the_scalars_refused(tmp_path, monkeypatch):
    """A checkpoint that lacks the optimizer's per-parameter scalars (as an earlier
    tiermem's) is refused rather than loaded with them started over."""
    model = Synthetic()
    opt = torch.optim.ASGD(model.parameters(), lr=0.01, t0=1)
    with tiermem.offload(opt, _cfg(tmp_path / "a", "threads", "64KiB"), model=model) as tm:
        train(model, opt, make_batches(model, 2))
        monkeypatch.setattr(dcp._Source, "scalar_keys", lambda self: [])
        dcp.save(tm, str(tmp_path / "ckpt"))
        monkeypatch.undo()
        with pytest.raises(tiermem.TierMemError, match=r"no per-parameter scalars \['eta', "
                                                       r"'mu'\].*start them over"):
            dcp.load(tm, str(tmp_path / "ckpt"))
