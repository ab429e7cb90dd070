"""Hyperparameters changed between steps, tiered against the same run done plainly, bit for
bit: lr schedulers that edit more than the lr (OneCycleLR's and CyclicLR's momentum and
betas), an lr or betas given as a tensor, group values set by hand (weight decay, eps,
momentum, maximize, nesterov, ...), groups that differ, gradients missing on some steps or
zeroed rather than dropped, and the run cut by a state_dict() (into a plain optimizer and
back) or by a crash-consistent resume. A configuration tiermem refuses with its error is
fine; one it runs must end with the plain run's weights and state.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import random
import warnings

import pytest
import torch

import tiermem
from tiermem.errors import TierMemError
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import (Synthetic, backend_params, compare_state_dicts, config,
                             loss_of, make_batches, side_used)
from adam_helpers import assert_bitwise

O = torch.optim
L = O.lr_scheduler
T = torch.tensor


def _thirdparty(module: str, name: str, **kw):
    if importlib.util.find_spec(module) is None:
        return None
    return lambda ps: getattr(importlib.import_module(module), name)(ps, **kw)


_lion = _thirdparty("lion_pytorch", "Lion", lr=1e-3, weight_decay=0.01)


def _side_apart(model, **side) -> list[dict]:
    """Two groups: the side branch (grad None on most steps) with `side`'s values."""
    apart = [model.side.weight, model.side.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in apart)]
    return [{"params": rest}, {"params": apart, **side}]


def _loop(model, opt, sched, batches, start, stop, edit=None, zero_none=True, drop=None):
    for i in range(start, stop):
        for tokens, target in batches[i]:
            loss_of(model, tokens, target, side_used(i)).backward()
        if drop is not None:
            drop(model, i)
        opt.step()
        opt.zero_grad(set_to_none=zero_none)
        if isinstance(sched, L.ReduceLROnPlateau):
            sched.step((3.0, 2.0, 2.0, 2.0)[i % 4])
        elif sched is not None:
            sched.step()
        if edit is not None:
            edit(opt, model, i)


def _fresh(make_opt, make_sched, model, old_sched=None):
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    if old_sched is not None:
        sched.load_state_dict(old_sched.state_dict())
    return opt, sched


def run_pair(tmp_path, monkeypatch, backend, make_opt, make_sched=None, *, steps=8,
             host: int | str = 0, cut=None, how=None, kernel="match", **loop):
    """The plain run and the tiered one, cut at step `cut` (how: "state_dict", the
    tiered state loaded into a new tiered optimizer; "plain", through a plain optimizer
    and back; "resume", a crash-consistent run left on disk and resumed) and the plain one
    cut by a state_dict the same way; asserts that they end equal."""
    model = Synthetic(vocab=300, hidden=130, out=9, seed=3)
    ref = copy.deepcopy(model)
    batches = make_batches(model, steps, seed=5)
    c = config(tmp_path / "swap", backend=backend, host=host, kernel=kernel)
    if how == "resume":
        c["swap"]["durability"] = "crash_consistent"

    ref_opt, ref_sched = _fresh(make_opt, make_sched, ref)
    if how in ("state_dict", "plain"):
        _loop(ref, ref_opt, ref_sched, batches, 0, cut, **loop)
        sd = copy.deepcopy(ref_opt.state_dict())
        ref_opt, ref_sched = _fresh(make_opt, make_sched, ref, ref_sched)
        ref_opt.load_state_dict(sd)
        _loop(ref, ref_opt, ref_sched, batches, cut, steps, **loop)
    else:
        _loop(ref, ref_opt, ref_sched, batches, 0, steps, **loop)

    opt, sched = _fresh(make_opt, make_sched, model)
    if how is None:
        with tiermem.offload(opt, c, model=model):
            _loop(model, opt, sched, batches, 0, steps, **loop)
            got = opt.state_dict()
    elif how == "resume":
        with monkeypatch.context() as m:  # no memory to hand the state back: kept on disk
            m.setattr("tiermem.optim.handle.available_memory", lambda: 0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with tiermem.offload(opt, c, model=model):
                    _loop(model, opt, sched, batches, 0, cut, **loop)
        opt2, sched2 = _fresh(make_opt, make_sched, model, sched)
        for g, was in zip(opt2.param_groups, opt.param_groups):  # the user's values now
            g.update({k: v for k, v in was.items() if k != "params"})
        with tiermem.offload(opt2, c, model=model, resume=True):
            _loop(model, opt2, sched2, batches, cut, steps, **loop)
            got = opt2.state_dict()
    else:
        with tiermem.offload(opt, c, model=model):
            _loop(model, opt, sched, batches, 0, cut, **loop)
            sd = copy.deepcopy(opt.state_dict())
        opt2, sched2 = _fresh(make_opt, make_sched, model, sched)
        if how == "plain":
            opt2.load_state_dict(sd)
            sd = copy.deepcopy(opt2.state_dict())
            opt2, sched2 = _fresh(make_opt, make_sched, model, sched2)
        with tiermem.offload(opt2, c, model=model):
            opt2.load_state_dict(sd)
            _loop(model, opt2, sched2, batches, cut, steps, **loop)
            got = opt2.state_dict()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_bitwise(p.detach(), q.detach(), name)
    compare_state_dicts(got, ref_opt.state_dict())


# -- bugs this search found -----------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params())
def test_adam_with_tensor_betas_steps_as_torch_does(tmp_path, monkeypatch, backend):
    """torch's for-loop Adam takes tensor betas as they are (its bias corrections are fp32
    tensor arithmetic); tiermem handed it the betas as Python floats, and the run ended
    ~1e-5 away (kernel: match, which promises bitwise)."""
    run_pair(tmp_path, monkeypatch, backend,
             lambda m: O.AdamW(_side_apart(m, betas=(T(0.8), T(0.95))), lr=T(1e-2),
                               betas=(T(0.9), T(0.99)), amsgrad=True),
             lambda o: L.LambdaLR(o, lambda s: 1 / (1 + s)), steps=6)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("fused", [False, True])
def test_the_default_kernel_with_tensor_betas_equals_the_plain_optimizer(
        tmp_path, monkeypatch, backend, fused):
    """With tensor betas torch's for-loop and its fused kernel part ~7e-7 after 20 steps
    (fp32 bias corrections against double ones), beyond the default kernel's 1e-6 promise.
    kernel auto ran the native kernel (the fused arithmetic) on an unfused optimizer's
    groups; it now runs torch's loop for them, bit for bit, and the native pass where the
    plain optimizer is fused."""
    run_pair(tmp_path, monkeypatch, backend,
             lambda m: O.Adam(m.parameters(), lr=1e-2, betas=(T(0.9), T(0.999)),
                              fused=fused, foreach=False if not fused else None),
             steps=8, kernel="auto")


def _added_later(model):
    """An optimizer without the side branch, which edit_add gives it after step 2."""
    return O.Adagrad([p for n, p in model.named_parameters() if not n.startswith("side")],
                     lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1)


def _edit_add(opt, model, i):
    if i == 2:
        opt.add_param_group({"params": [model.side.weight, model.side.bias],
                             "initial_accumulator_value": 0.7})


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", ["group", "added"])
def test_adagrad_accumulator_starts_from_the_optimizers_default(tmp_path, monkeypatch,
                                                                backend, case):
    """torch's Adagrad starts every accumulator from its constructor's (its defaults')
    initial_accumulator_value, whatever a param group says: __init__ fills them all with
    it, and a group added later starts from defaults at its first step. tiermem filled a
    parameter's accumulator at its first step from its group's value: a group with its own
    value, or one added with it, ended different (kernel match and torch's fused)."""
    if case == "group":
        run_pair(tmp_path, monkeypatch, backend,
                 lambda m: O.Adagrad(_side_apart(m, initial_accumulator_value=0.5), lr=1e-2,
                                     initial_accumulator_value=0.1, fused=True), steps=5)
    else:
        run_pair(tmp_path, monkeypatch, backend, _added_later, steps=6, edit=_edit_add)


def _edit_add_fresh(opt, model, i):
    if i == 2:  # the side branch's grads of step 1 were never the optimizer's: dropped
        model.side.weight.grad = model.side.bias.grad = None
        opt.add_param_group({"params": [model.side.weight, model.side.bias]})


@pytest.mark.parametrize("backend", backend_params())
def test_adagrad_state_dict_of_a_group_never_stepped_loads_into_a_plain_adagrad(
        tmp_path, backend):
    """A group added after entry and not stepped yet (its parameters' grads were None):
    torch keeps no state for it and starts its accumulators from defaults at their first
    step. tiermem's state_dict() gave them step 0 and an accumulator of zeros (a record
    never written), and a plain Adagrad loaded from it stepped them from 0: different."""
    model = Synthetic(vocab=300, hidden=130, out=9, seed=3)
    ref = copy.deepcopy(model)
    batches = make_batches(model, 7, seed=5)
    ref_opt = _added_later(ref)
    _loop(ref, ref_opt, None, batches, 0, 7, edit=_edit_add_fresh)
    opt = _added_later(model)
    with tiermem.offload(opt, config(tmp_path / "swap", backend=backend), model=model):
        _loop(model, opt, None, batches, 0, 4, edit=_edit_add_fresh)
        sd = copy.deepcopy(opt.state_dict())
    plain = _added_later(model)
    plain.add_param_group({"params": [model.side.weight, model.side.bias]})
    plain.load_state_dict(sd)
    _loop(model, plain, None, batches, 4, 7)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_bitwise(p.detach(), q.detach(), name)
    compare_state_dicts(plain.state_dict(), ref_opt.state_dict())


def _warm_up_before_step(model, opt, batches, start, stop, tm):
    """A loop that sets the step's lr between backward and step(), as many warm-up loops
    do; tm.stats() first (a loop logging them) lets backward's updates finish: no race with
    the worker that a test could lose."""
    for i in range(start, stop):
        for tokens, target in batches[i]:
            loss_of(model, tokens, target, side_used(i)).backward()
        tm.stats()
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (i + 1) / stop
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_overlap_refuses_a_group_changed_between_backward_and_step(tmp_path, backend, name):
    """pipeline.overlap_backward updates partitions during backward with the group's values
    as they are then: an lr set between backward and step() reached only the partitions
    step() updated (the generic path's shadows even kept the old one for all), and the run
    ended different. step() refuses it now, as it refuses a gradient edited there."""
    make = {"adamw": lambda ps: O.AdamW(ps, lr=1e-2),
            "sgd": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9),
            "lion": _lion}[name]
    if make is None:
        pytest.skip("lion_pytorch is not installed")
    model = Synthetic(vocab=300, hidden=130, out=9, seed=3)
    batches = make_batches(model, 3, seed=5)
    opt = make(list(model.parameters()))
    c = config(tmp_path / "swap", backend=backend, host="100KiB")
    c["pipeline"]["overlap_backward"] = True
    with pytest.raises(TierMemError, match=r"param_groups\[0\]\['lr'\] changed between "
                                           r"backward and optimizer.step\(\)"):
        with tiermem.offload(opt, c, model=model) as tm:
            _warm_up_before_step(model, opt, batches, 0, 3, tm)
    # set before backward (or by a scheduler after step()) it runs, equal to the plain run
    model = Synthetic(vocab=300, hidden=130, out=9, seed=3)
    ref = copy.deepcopy(model)
    opt, ref_opt = make(list(model.parameters())), make(list(ref.parameters()))
    sched = L.LambdaLR(opt, lambda s: 1 / (1 + s))
    ref_sched = L.LambdaLR(ref_opt, lambda s: 1 / (1 + s))
    _loop(ref, ref_opt, ref_sched, batches, 0, 3)
    with tiermem.offload(opt, c, model=model):
        _loop(model, opt, sched, batches, 0, 3)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_bitwise(p.detach(), q.detach(), n)


# -- drawn runs: an optimizer, a scheduler, edits between steps, a cut ------------------------

OPTIMIZERS = {
    "adam": lambda m: O.Adam(_side_apart(m, lr=3e-3, betas=(0.8, 0.95)), lr=1e-2),
    "adamw-amsgrad-max": lambda m: O.AdamW(m.parameters(), lr=1e-2, amsgrad=True,
                                           maximize=True, weight_decay=0.05),
    "adam-fused-tensor-lr": lambda m: O.Adam(m.parameters(), lr=T(1e-2), fused=True),
    "adam-foreach": lambda m: O.Adam(_side_apart(m, weight_decay=0.1), lr=1e-2,
                                     foreach=True),
    "sgd-nesterov": lambda m: O.SGD(_side_apart(m, momentum=0.5, nesterov=False), lr=1e-2,
                                    momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening-tensor-lr": lambda m: O.SGD(m.parameters(), lr=T(1e-2), momentum=0.9,
                                               dampening=0.2),
    "adagrad": lambda m: O.Adagrad(_side_apart(m, lr_decay=0.1), lr=1e-2, lr_decay=0.01,
                                   initial_accumulator_value=0.1),
    "rmsprop": lambda m: O.RMSprop(m.parameters(), lr=1e-3, momentum=0.9, centered=True,
                                   foreach=True),
    "nadam": lambda m: O.NAdam(_side_apart(m, momentum_decay=3e-3), lr=1e-2),
    "radam-decoupled": lambda m: O.RAdam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                         decoupled_weight_decay=True),
    "adamax": lambda m: O.Adamax(m.parameters(), lr=1e-2, foreach=True),
    "adadelta": lambda m: O.Adadelta(_side_apart(m, rho=0.5), lr=1.0),
    "asgd": lambda m: O.ASGD(m.parameters(), lr=1e-2, t0=3),
    "rprop": lambda m: O.Rprop(_side_apart(m, etas=(0.4, 1.3)), lr=1e-2),
}
MOMENTUM = {"adam", "adamw-amsgrad-max", "adam-fused-tensor-lr", "adam-foreach",
            "sgd-nesterov", "sgd-dampening-tensor-lr", "rmsprop", "nadam", "radam-decoupled",
            "adamax"}  # what OneCycleLR / CyclicLR may cycle (momentum or beta1)
SCHEDULERS = {
    "one-cycle": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=12),
    "cyclic": lambda o: L.CyclicLR(o, 1e-3, 1e-2, step_size_up=3, base_momentum=0.8,
                                   max_momentum=0.95),
    "warm-restarts": lambda o: L.CosineAnnealingWarmRestarts(o, 3, 2),
    "sequential": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 3),
                                               L.ExponentialLR(o, 0.9)], [3]),
    "chained": lambda o: L.ChainedScheduler([L.ConstantLR(o, 0.5, 4),
                                             L.ExponentialLR(o, 0.9)]),
    "plateau": lambda o: L.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "lambda": lambda o: L.LambdaLR(o, lambda s: 1 / (1 + s)),
    "multiplicative": lambda o: L.MultiplicativeLR(o, lambda s: 0.9),
    "polynomial": lambda o: L.PolynomialLR(o, 12, 2.0),
}


def _edit(key: str, change, at=(2, 5)):
    def edit(opt, model, i):
        if i in at:
            for g in opt.param_groups:
                if key in g:
                    g[key] = change(g[key])
    return edit


EDITS = {
    None: None,
    "weight_decay": _edit("weight_decay", lambda v: v + 0.05),
    "betas": _edit("betas", lambda v: (v[0] * 0.9, v[1] * 0.999)),
    "momentum": _edit("momentum", lambda v: v * 0.5),
    "eps": _edit("eps", lambda v: v * 100),
    "maximize": _edit("maximize", lambda v: not v, at=(3,)),
    "nesterov": _edit("nesterov", lambda v: not v, at=(3,)),
    "foreach": _edit("foreach", lambda v: not v, at=(3,)),
}


def _drop_some(model, i):
    """Grads of whole parameters missing on some steps (beyond the side branch's)."""
    if i % 4 == 2:
        model.fc1.weight.grad = None
    if i % 3 == 0:
        model.emb.weight.grad = None


def _frozen_for_a_while(opt, model, i):
    model.fc2.bias.requires_grad_(i < 2 or i >= 4)
    _edit("weight_decay", lambda v: v + 0.01, at=(3,))(opt, model, i)


def draw(rng: random.Random) -> dict:
    opt = rng.choice(sorted(OPTIMIZERS))
    scheds = [s for s in sorted(SCHEDULERS)
              if opt in MOMENTUM or s not in ("one-cycle", "cyclic")]
    return dict(opt=opt, sched=rng.choice(scheds + [None]),
                edit=rng.choice(sorted(EDITS, key=str) + ["frozen"]),
                host=rng.choice([0, "100KiB"]), zero_none=rng.random() < 0.7,
                drop=rng.random() < 0.4,
                cut=rng.choice([(None, None), (4, "state_dict"), (5, "plain"), (3, "resume")]))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("seed", range(6))
def test_a_drawn_run_with_changing_hyperparameters_equals_the_plain_run(
        tmp_path, monkeypatch, backend, seed):
    rng = random.Random(seed * 7919 + len(backend))
    sc = draw(rng)
    edit = _frozen_for_a_while if sc["edit"] == "frozen" else EDITS[sc["edit"]]
    cut, how = sc["cut"]
    try:
        run_pair(tmp_path, monkeypatch, backend, OPTIMIZERS[sc["opt"]],
                 SCHEDULERS[sc["sched"]] if sc["sched"] else None, steps=8, host=sc["host"],
                 cut=cut, how=how, edit=edit, zero_none=sc["zero_none"],
                 drop=_drop_some if sc["drop"] else None)
    except (TierMemError, UnsupportedOptimizer):
        return  # refused with tiermem's error: never wrong
    except AssertionError as exc:
        raise AssertionError(f"{sc}: {exc}") from None


@pytest.mark.parametrize("backend", backend_params())
def test_a_checkpoint_with_amsgrad_off_is_refused_saying_which_side_has_it(
        tmp_path, backend):
    """torch steps on after amsgrad is turned off; tiermem's layout cannot drop
    max_exp_avg_sq inside the block and refuses. The refusal said "the checkpoint has
    amsgrad=False, the state laid out by tiermem.offload has not": now both values, and
    the advice works (loaded before entering, the run steps on as the plain one)."""
    model = Synthetic(vocab=300, hidden=130, out=9, seed=3)
    batches = make_batches(model, 4, seed=5)
    opt = O.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    c = config(tmp_path / "swap", backend=backend)
    with tiermem.offload(opt, c, model=model):
        _loop(model, opt, None, batches, 0, 2)
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][0]["amsgrad"] = False
        with pytest.raises(TierMemError, match=r"checkpoint has amsgrad=False and "
                                               r"tiermem.offload laid the state out for "
                                               r"amsgrad=True; load the checkpoint"):
            opt.load_state_dict(sd)
    ref = copy.deepcopy(model)
    ref_opt = O.AdamW(ref.parameters(), lr=1e-2, amsgrad=True)
    ref_opt.load_state_dict(copy.deepcopy(sd))  # (torch loads CPU tensors unmade: shared)
    _loop(ref, ref_opt, None, batches, 2, 4)
    opt = O.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    opt.load_state_dict(sd)
    # torch keeps the max it no longer uses; the layout without amsgrad has no room for
    # it, and dropping it silently would lose it (amsgrad turned on again would start
    # over): refused, saying how to drop it
    with pytest.raises(TierMemError, match=r"\['max_exp_avg_sq'\].*st.pop"):
        with tiermem.offload(opt, c, model=model):
            pass
    for st in opt.state.values():
        st.pop("max_exp_avg_sq", None)
    with tiermem.offload(opt, c, model=model):
        _loop(model, opt, None, batches, 2, 4)
        got = opt.state_dict()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_bitwise(p.detach(), q.detach(), n)
    want = ref_opt.state_dict()
    for st in want["state"].values():
        del st["max_exp_avg_sq"]  # (dropped above, on purpose)
    compare_state_dicts(got, want)
