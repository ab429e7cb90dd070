"""The generic path's methods besides a plain step, drawn in random order: schedule-free's
train()/eval() at any point, step(closure), zero_grad(set_to_none=False), clipping, an lr
scheduler stepping per batch, a changed learning rate, add_param_group, state_dict()
loaded back into the same optimizer, and the run cut by a state_dict() handed to a plain
optimizer that steps on its own before it goes back under tiermem. Each method runs on
the tiered optimizer and on its plain twin; losses, the weights train()/eval() leave,
every state_dict() taken and the final state are bitwise the plain run's, or tiermem
refuses with its own error.

(tests/test_scenarios.py draws the tiers and the pipeline; this draws the calls.)
"""

from __future__ import annotations

import contextlib
import copy
import zlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.errors import TierMemError
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import (Synthetic, available_backends, compare_state_dicts, config,
                             loss_of, make_batches, side_used)
from adam_helpers import assert_bitwise
from test_scenarios import _thirdparty

O = torch.optim


OPTIMIZERS = {k: v for k, v in {
    "adamw": lambda ps: O.AdamW(ps, lr=0.01, weight_decay=0.01),
    "sgd-momentum": lambda ps: O.SGD(ps, lr=0.05, momentum=0.9),
    "lion": _thirdparty("lion_pytorch", "Lion", lr=1e-3, weight_decay=0.01),
    "madgrad": _thirdparty("pytorch_optimizer", "MADGRAD", lr=1e-3),
    "adamw-schedulefree": _thirdparty("schedulefree", "AdamWScheduleFree", lr=1e-2,
                                      warmup_steps=2, weight_decay=0.01),
}.items() if v is not None}
SCHEDULE_FREE = {"adamw-schedulefree"}


@st.composite
def runs(draw):
    opt = draw(st.sampled_from(sorted(OPTIMIZERS)))
    weights = draw(st.sampled_from(["none", "host", "nvme"]))
    sched = draw(st.booleans())
    add = weights == "none" and not sched and draw(st.booleans())
    clips = [None, "norm"] + (["value"] if weights == "none" else [])
    calls, added = [], False
    for _ in range(draw(st.integers(3, 6))):
        calls.append(("step", draw(st.booleans()), draw(st.booleans()),
                      draw(st.sampled_from(clips))))
        extra = draw(st.sampled_from(
            ["none", "reload", "cut", "lr", "add"] + (["eval", "eval-eval"] * 2
                                                       if opt in SCHEDULE_FREE else [])))
        if extra == "add" and (not add or added):
            continue
        added = added or extra == "add"
        if extra != "none":
            calls.append((extra,))
    return dict(opt=opt, weights=weights, sched=sched, add=add, calls=calls,
                backend=draw(st.sampled_from(available_backends())),
                host=draw(st.sampled_from([0, "64MiB"])))


def _groups(model, run, side_later: bool):
    side = [model.side.weight, model.side.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in side)]
    return [{"params": rest}] if side_later else list(model.parameters())


class Loop:
    """One side of the run: the plain optimizer, or the same under tiermem (`settings`)."""

    def __init__(self, model, run, batches, settings=None) -> None:
        self.model, self.run, self.batches, self.settings = model, run, batches, settings
        self.opt = OPTIMIZERS[run["opt"]](_groups(model, run, run["add"]))
        self.sched = O.lr_scheduler.LambdaLR(self.opt, lambda s: 1 / (1 + s)) \
            if run["sched"] else None
        self.block, self.tm, self.i = None, None, 0
        self.enter()
        if run["opt"] in SCHEDULE_FREE:
            self.opt.train()

    def enter(self) -> None:
        if self.settings is not None:
            self.block = tiermem.offload(self.opt, self.settings, model=self.model)
            self.tm = self.block.__enter__()

    def leave(self, exc: BaseException | None = None) -> None:
        block, self.block = self.block, None
        if block is not None:
            block.__exit__(type(exc) if exc else None, exc, None)

    def weights(self) -> list[torch.Tensor]:
        held = self.tm is not None and self.run["weights"] != "none" and self.block
        return [self.tm.offloaded.weights.current_weight(p).reshape(p.shape) if held
                else p.detach().clone() for p in self.model.parameters()]

    def step(self, closure: bool, to_none: bool, clip: str | None) -> float:
        model, i = self.model, self.i
        (tokens, target), = self.batches[i]

        def backward() -> torch.Tensor:
            loss = loss_of(model, tokens, target, side_used(i))
            loss.backward()
            if clip == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            elif clip == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            return loss.detach()

        if closure:
            loss = self.opt.step(backward)
        else:
            loss = backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=to_none)
        if self.sched is not None:
            self.sched.step()
        self.i += 1
        return float(loss)

    def call(self, what: str, *args):
        opt = self.opt
        if what == "step":
            return self.step(*args)
        if what in ("eval", "eval-eval"):  # the averaged weights, then back to training
            opt.eval()
            if what == "eval-eval":
                opt.eval()  # changes nothing, as in plain schedule-free
            seen = self.weights()
            opt.train()
            return seen
        if what == "reload":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            return copy.deepcopy(opt.state_dict())
        if what == "lr":
            for g in opt.param_groups:
                g["lr"] *= 0.5
            return None
        if what == "add":
            opt.add_param_group({"params": [self.model.side.weight, self.model.side.bias],
                                 "lr": 2e-3})
            return None
        assert what == "cut"  # a plain optimizer takes the state over, steps, hands it back
        sd = copy.deepcopy(opt.state_dict())
        sched = self.sched.state_dict() if self.sched is not None else None
        self.leave()
        self.opt = OPTIMIZERS[self.run["opt"]](
            [{"params": g["params"]} for g in opt.param_groups])
        self.opt.load_state_dict(sd)
        if self.sched is not None:
            self.sched = O.lr_scheduler.LambdaLR(self.opt, lambda s: 1 / (1 + s))
            self.sched.load_state_dict(sched)
        loss = self.step(False, True, None)
        self.enter()
        return loss


def _no_empty(sd: dict) -> dict:
    # A plain schedule-free train() leaves an empty state entry for a parameter no step
    # has reached yet (opt.state is a defaultdict); tiermem keeps none: the same state.
    return {"state": {k: v for k, v in sd["state"].items() if v != {}},
            "param_groups": sd["param_groups"]}


def _same(got, want, what: str) -> None:
    if isinstance(want, float):
        assert got == want, what
    elif isinstance(want, list):
        for a, b in zip(got, want):
            assert_bitwise(a, b, what)
    elif isinstance(want, dict):
        compare_state_dicts(_no_empty(got), _no_empty(want))


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(run=runs())
def test_drawn_calls_equal_the_plain_optimizer_or_are_refused(tmp_path_factory, run):
    seed = zlib.crc32(repr(sorted(run.items())).encode()) % 1000
    model = Synthetic(vocab=120, hidden=70, out=5, seed=seed)
    ref = copy.deepcopy(model)
    steps = sum(c[0] in ("step", "cut") for c in run["calls"])
    batches = make_batches(model, steps, seed=seed)
    plain = Loop(ref, run, batches)
    want = [plain.call(*c) for c in run["calls"]]
    c = config(tmp_path_factory.mktemp("generic") / "swap", backend=run["backend"],
               host=run["host"])
    c["parameters"] = {"offload": run["weights"], "window": "1MiB"}
    tiered = None
    try:
        tiered = Loop(model, run, batches, c)
        got = [tiered.call(*call) for call in run["calls"]]
        final = copy.deepcopy(tiered.opt.state_dict())
    except (TierMemError, UnsupportedOptimizer) as exc:
        if tiered is not None:
            with contextlib.suppress(TierMemError, UnsupportedOptimizer):
                tiered.leave(exc)
        return  # refused with tiermem's error: never wrong
    tiered.leave()
    for call, a, b in zip(run["calls"], got, want):
        _same(a, b, f"{run}: {call}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bitwise(p.detach(), q.detach(), f"{run}: {name}")
    compare_state_dicts(_no_empty(final), _no_empty(plain.opt.state_dict()))
    compare_state_dicts(_no_empty(tiered.opt.state_dict()), _no_empty(plain.opt.state_dict()))
