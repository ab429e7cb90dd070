"""Whole training runs drawn at random: an optimizer, a config and a training loop's events,
tiered against the same loop run plainly, bit for bit.

Each test elsewhere holds one feature to the plain optimizer; this one draws their
combinations, the way a user's run mixes them: torch's optimizers, third-party ones on
the generic path and the default native Adam kernel; state on the host, on NVMe or both,
one or two swap directories, both I/O backends, the pipeline's knobs, crash-consistent
commits, updates during backward, the weights in the tiers, a device model's lanes (their
CPU emulation) with either step_device; gradient accumulation,
clipping, an lr scheduler, a changed learning rate, a param group added mid-run, a
parameter frozen and unfrozen between steps (or frozen when the block opens),
zero_grad(set_to_none=False), a weight clamped between steps, a fused optimizer stepped
through a GradScaler that skips a step,
and the run cut in two by a state_dict() handed to a new optimizer or by a resume from
the state kept on disk. A scenario tiermem refuses with its error is fine; one it runs
must end with the plain run's weights and state_dict. (A search like this found five bugs
that each feature's own tests had missed, and a second one, drawing freezes, GradScaler
and edits, three more: their own tests now hold them, the second's in
test_scenarios2_found.py.)
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import warnings
import zlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.device.lanes import DeferredBackend
from tiermem.errors import TierMemError
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import (Synthetic, available_backends, compare_state_dicts, config,
                             loss_of, make_batches, side_used)
from adam_helpers import assert_bitwise

O = torch.optim


def _thirdparty(module: str, name: str, **kw):
    def make(params):
        return getattr(importlib.import_module(module), name)(params, **kw)
    return make if importlib.util.find_spec(module) else None


OPTIMIZERS = {k: v for k, v in {
    "sgd-nesterov": lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                     weight_decay=0.01),
    "adagrad": lambda ps: O.Adagrad(ps, lr=0.05, lr_decay=0.01,
                                    initial_accumulator_value=0.1),
    "adagrad-fused": lambda ps: O.Adagrad(ps, lr=0.05, weight_decay=0.01, fused=True),
    "rmsprop-centered": lambda ps: O.RMSprop(ps, lr=0.01, centered=True, momentum=0.5),
    "nadam": lambda ps: O.NAdam(ps, lr=0.01, decoupled_weight_decay=True,
                                weight_decay=0.01),
    "asgd": lambda ps: O.ASGD(ps, lr=0.01, t0=2),
    "rprop": lambda ps: O.Rprop(ps, lr=0.01),
    "adamw-amsgrad": lambda ps: O.AdamW(ps, lr=0.01, amsgrad=True),
    # the default kernel (native) against the fused optimizer: bit for bit
    "adamw-fused": lambda ps: O.AdamW(ps, lr=0.01, fused=True),
    "adafactor": lambda ps: O.Adafactor(ps, lr=0.01),
    "lion": _thirdparty("lion_pytorch", "Lion", lr=1e-3, weight_decay=0.01),
    "lamb": _thirdparty("pytorch_optimizer", "Lamb", lr=1e-3),
}.items() if v is not None}


@st.composite
def scenarios(draw):
    steps = draw(st.integers(3, 5))
    sc = dict(
        opt=draw(st.sampled_from(sorted(OPTIMIZERS))), two_groups=draw(st.booleans()),
        backend=draw(st.sampled_from(available_backends())),
        host=draw(st.sampled_from([0, "200KiB", "64MiB"])),
        partition_size=draw(st.sampled_from(["64KiB", "256KiB"])),
        buffers=draw(st.sampled_from([(2, 1), (3, 2), (5, 3)])), zigzag=draw(st.booleans()),
        write_back=draw(st.sampled_from(["deferred", "immediate"])),
        paths=draw(st.sampled_from([1, 2])), overlap=draw(st.booleans()),
        crash=draw(st.booleans()), weights=draw(st.sampled_from(["none", "host", "nvme"])),
        steps=steps, micro=draw(st.sampled_from([1, 2])), clip=draw(st.booleans()),
        sched=draw(st.booleans()), lr_change=draw(st.sampled_from([None, 1])),
        add_group=draw(st.sampled_from([None, 0, 1])),
        cut=draw(st.sampled_from([None, 1, 2])), resume=draw(st.booleans()),
        # the model counts as a device one, its lanes emulated on the CPU (step_device)
        lanes=draw(st.sampled_from([None, "cpu", "device"])),
        # fc1.bias frozen before step `freeze`'s forward, unfrozen two steps later (-1:
        # frozen when the block opens, so laid out no record, and unfrozen before step 1)
        zeros=draw(st.booleans()), freeze=draw(st.sampled_from([None, 0, 1, -1])),
        # fc2.weight clamped in place after the first step; a fused optimizer through a
        # GradScaler that skips step 2 (inf loss)
        edit=draw(st.booleans()), amp=draw(st.booleans()))
    if sc["edit"] and (sc["weights"] != "none" or sc["lanes"] == "cpu"
                       or (sc["resume"] and sc["cut"] is not None)):
        # documented: the tier keeps its own copy of the weights, an fp32 master is what
        # the next step starts from, a resume puts back the committed weights
        sc["edit"] = False
    if sc["amp"] and not sc["opt"].endswith("-fused"):
        sc["amp"] = False  # torch's own unscale_ path: test_amp_scaler.py's
    if sc["amp"]:  # refused with either (test_amp_scaler.py): the run is drawn, not that
        sc["weights"], sc["overlap"] = "none", False
    return sc


def _groups(model, sc, added: bool):
    side = [model.side.weight, model.side.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in side)]
    if sc["add_group"] is not None and not added:
        return [{"params": rest}]
    if sc["two_groups"] or sc["add_group"] is not None:
        return [{"params": rest}, {"params": side, "lr": 2e-3}]
    return list(model.parameters())


def _loop(model, opt, sched, batches, start, stop, sc, tm=None, scaler=None):
    overlap = tm is not None and sc["overlap"]
    if sc.get("amp") and scaler is None:
        scaler = torch.amp.GradScaler("cpu", init_scale=1000.0)
    for i in range(start, stop):
        if sc.get("freeze") is not None and i in (sc["freeze"], sc["freeze"] + 2):
            model.fc1.bias.requires_grad_(i != sc["freeze"])
        for j, (tokens, target) in enumerate(batches[i]):
            last = j == len(batches[i]) - 1
            with contextlib.nullcontext() if last or not overlap else tm.accumulating():
                loss = loss_of(model, tokens, target, side_used(i)) / len(batches[i])
                if scaler is not None:  # step 2 skipped: its grads are inf
                    loss = scaler.scale(loss * float("inf") if i == 2 else loss)
                loss.backward()
        if sc["clip"]:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=not sc.get("zeros"))
        if sc.get("edit") and i == 0:
            with torch.no_grad():
                model.fc2.weight.clamp_(-0.05, 0.05)
        if sched is not None:
            sched.step()
        if sc["lr_change"] == i:
            for g in opt.param_groups:
                g["lr"] *= 0.5
        if sc["add_group"] == i:
            side = [model.side.weight, model.side.bias]
            opt.add_param_group({"params": side, "lr": 2e-3})


def _fresh(model, sc, upto: int, optimizers, old=None, old_sched=None):
    """A new optimizer (and scheduler) as the loop had it before step `upto`."""
    opt = optimizers[sc["opt"]](_groups(model, sc, sc["add_group"] is not None
                                        and sc["add_group"] < upto))
    sched = O.lr_scheduler.StepLR(opt, 2, 0.5) if sc["sched"] else None
    if old_sched is not None:
        sched.load_state_dict(old_sched.state_dict())
    if old is not None:  # what torch's load_state_dict would set: the groups' rates now
        for g, was in zip(opt.param_groups, old.param_groups):
            g["lr"] = was["lr"]
    return opt, sched


def _config(tmp_path, sc) -> dict:
    c = config(tmp_path / "swap", backend=sc["backend"], host=sc["host"],
               partition_size=sc["partition_size"], buffer_count=sc["buffers"][0],
               prefetch_depth=sc["buffers"][1], zigzag=sc["zigzag"],
               write_back=sc["write_back"],
               # the default (auto: native) against a fused optimizer; match elsewhere (an
               # unfused Adam's own kernel: the default is within 1e-6 of it, not bitwise)
               kernel="auto" if sc["opt"].endswith("-fused") else "match")
    if sc["paths"] == 2:
        c["swap"]["paths"].append(str(tmp_path / "swap2"))
    c["swap"]["durability"] = "crash_consistent" if sc["crash"] else "scratch"
    c["pipeline"]["overlap_backward"] = sc["overlap"]
    c["parameters"] = {"offload": sc["weights"]}
    if sc["lanes"]:
        c["optimizer"]["step_device"] = sc["lanes"]
    return c


def _streams(sc) -> dict:
    return {"streams": DeferredBackend()} if sc["lanes"] else {}


def _tiered(monkeypatch, sc, model, batches, optimizers, c):
    """The drawn run under config `c`, cut as `sc` says; its final state_dict()."""
    cut = sc["cut"] if sc["cut"] is not None else sc["steps"]
    opt, sched = _fresh(model, sc, 0, optimizers)
    # one GradScaler for the whole run, as the plain run's
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0) if sc.get("amp") else None
    if cut < sc["steps"] and sc["resume"]:  # the state kept on disk, then resumed
        c["swap"]["durability"] = "crash_consistent"
        monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tiermem.offload(opt, c, model=model, **_streams(sc)) as tm:
                _loop(model, opt, sched, batches, 0, cut, sc, tm, scaler)
        assert any("stays on disk" in str(w.message) for w in caught)
        monkeypatch.undo()
        opt2, sched2 = _fresh(model, sc, cut, optimizers, opt, sched)
        with tiermem.offload(opt2, c, model=model, resume=True,
                             **_streams(sc)) as tm:
            _loop(model, opt2, sched2, batches, cut, sc["steps"], sc, tm, scaler)
            return opt2.state_dict()
    with tiermem.offload(opt, c, model=model, **_streams(sc)) as tm:
        _loop(model, opt, sched, batches, 0, cut, sc, tm, scaler)
        sd = opt.state_dict()
    if cut == sc["steps"]:
        return sd
    opt2, sched2 = _fresh(model, sc, cut, optimizers, None, sched)  # load_state_dict sets lr
    with tiermem.offload(opt2, c, model=model, **_streams(sc)) as tm:
        opt2.load_state_dict(sd)
        _loop(model, opt2, sched2, batches, cut, sc["steps"], sc, tm, scaler)
        return opt2.state_dict()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sc=scenarios())
def test_a_drawn_run_equals_the_plain_run_or_is_refused(tmp_path_factory, monkeypatch, sc):
    if sc["overlap"]:
        sc["clip"] = False  # refused before any step, with its own test
    tmp_path = tmp_path_factory.mktemp("scenario")
    seed = zlib.crc32(repr(sorted(sc.items())).encode()) % 1000  # the same in every process
    model = Synthetic(vocab=300, hidden=130, out=9, seed=seed)
    if sc["freeze"] == -1:
        model.fc1.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    batches = make_batches(model, sc["steps"], micro=sc["micro"], seed=seed)
    ref_opt, ref_sched = _fresh(ref, sc, 0, OPTIMIZERS)
    _loop(ref, ref_opt, ref_sched, batches, 0, sc["steps"], sc)
    try:
        sd = _tiered(monkeypatch, sc, model, batches, OPTIMIZERS, _config(tmp_path, sc))
    except (TierMemError, UnsupportedOptimizer):
        return  # refused with tiermem's error: never wrong
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_bitwise(p.detach(), q.detach(), f"{sc}: {name}")
    compare_state_dicts(sd, ref_opt.state_dict())


# -- fewer bytes per parameter: the same numbers whatever else the config says -------------

NUMERICS = [  # (state_dtype, master_weights, model dtype)
    ("bf16", "fp32", torch.float32), ("int8", "fp32", torch.float32),
    ("int8", "kahan", torch.bfloat16), ("int8", "none", torch.bfloat16),
    ("bf16", "kahan", torch.bfloat16), ("fp32", "none", torch.bfloat16),
    ("int8", "fp32", torch.bfloat16)]
LOWBIT_OPTIMIZERS = {"adamw": lambda ps: O.AdamW(ps, lr=0.01, weight_decay=0.01),
                     "adam-amsgrad": lambda ps: O.Adam(ps, lr=0.01, amsgrad=True)}


@st.composite
def lowbit_scenarios(draw):
    sc = draw(scenarios())
    sc.update(opt=draw(st.sampled_from(sorted(LOWBIT_OPTIMIZERS))),
              numerics=draw(st.sampled_from(range(len(NUMERICS)))),
              rounding=draw(st.sampled_from(["stochastic", "nearest"])),
              add_group=None, sched=False, amp=False,
              edit=False)  # (a bf16 model's master is what the next step starts from)
    return sc


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sc=lowbit_scenarios())
def test_lowbit_numbers_do_not_depend_on_the_rest_of_the_config(tmp_path_factory,
                                                                monkeypatch, sc):
    """int8 / bf16 moments and Kahan / master-less weights have no plain-torch twin to
    compare with here, but their numbers depend on the numerics settings alone: a drawn
    run (tiers, pipeline, durability, overlap, the weights in the tiers, cut by a
    state_dict or a resume) must end with the bits of the same numerics on the host tier,
    run straight through."""
    state_dtype, master, dtype = NUMERICS[sc["numerics"]]
    if sc["overlap"]:
        sc["clip"] = False
    seed = zlib.crc32(repr(sorted(sc.items())).encode()) % 1000

    def build():
        return Synthetic(vocab=300, hidden=130, out=9, seed=seed).to(dtype)

    def settings_of(run: dict, where) -> dict:
        c = _config(where, run)
        c["optimizer"].update(kernel="auto", state_dtype=state_dtype, master_weights=master,
                              state_rounding=sc["rounding"])
        return c

    batches = make_batches(build(), sc["steps"], micro=sc["micro"], seed=seed)
    # (another partition_size too: the streams are the parameter's, not the record's)
    straight = dict(sc, host="64MiB", partition_size="128KiB", buffers=(3, 2), zigzag=True,
                    write_back="deferred", paths=1, overlap=False, crash=False,
                    weights="none", cut=None)
    ref, model = build(), build()
    try:
        want = _tiered(monkeypatch, straight, ref, batches, LOWBIT_OPTIMIZERS,
                       settings_of(straight, tmp_path_factory.mktemp("straight")))
        got = _tiered(monkeypatch, sc, model, batches, LOWBIT_OPTIMIZERS,
                      settings_of(sc, tmp_path_factory.mktemp("drawn")))
    except (TierMemError, UnsupportedOptimizer):
        return  # refused with tiermem's error (amsgrad with int8, ...): never wrong
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_bitwise(p.detach(), q.detach(), f"{sc}: {name}")
    compare_state_dicts(got, want)
