"""Every torch.optim optimizer torch tests on the CPU, and third-party ones, under tiermem.

The table is torch's own: each optim_db entry's optim_inputs_func(device="cpu"). Each
configuration runs on the small model both with tiermem (tiny partitions, so large
parameters are cut across partitions; all state on NVMe, and split host/NVMe) and
plainly, and must end equal: bitwise for the elementwise family (torch's functional
implementations on the segment views) and for whole-parameter rules (the optimizer's own
step()). Then state_dict() must equal the plain one, and a plain optimizer loaded from
tiermem's state_dict (and tiermem loaded from a plain one) must keep stepping equal.
"""

from __future__ import annotations

import copy
import random
import types

import numpy as np
import pytest
import torch

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer
from tiermem.swap.manifest import read_manifest, write_manifest

from offload_helpers import (Synthetic, assert_same_tensor, backend_params, config, make_batches,
                             same_state_value, swap_dir, train)

optim_db = pytest.importorskip("torch.testing._internal.common_optimizers").optim_db

STEPS = 3
REFUSED = {"LBFGS", "SparseAdam"}


def small() -> Synthetic:
    """The parity model, smaller: the embedding (18300 elements) is still cut across
    64 KiB partitions, and the run costs a fraction of a second."""
    return Synthetic(vocab=300, hidden=130, out=9)


def muon_params(model):
    return [p for p in model.parameters() if p.dim() == 2]


def params_for(cls, model):
    return muon_params(model) if cls is torch.optim.Muon else list(model.parameters())


def db_rows():
    rows = []
    for entry in optim_db:
        cls = entry.optim_cls
        if cls.__name__ in REFUSED:
            continue
        for n, inp in enumerate(entry.optim_inputs_func(device="cpu")):
            kw = dict(inp.kwargs)
            if n % 2 and "foreach" in entry.supported_impls and "fused" not in kw:
                kw["foreach"] = True  # every other row runs the multi-tensor implementation
            for placement in ("nvme", "mixed"):
                rows.append(pytest.param(cls, kw, placement,
                                         id=f"{cls.__name__}-{n}-{placement}-{inp.desc}"))
    return rows


def state_equal(sd, ref_sd, what):
    assert set(sd["state"]) == set(ref_sd["state"]), what
    for i, ref in ref_sd["state"].items():
        got = sd["state"][i]
        if not isinstance(i, int):  # under a key that is no parameter (MADGRAD's 'k')
            same_state_value(got, ref, f"{what}: state[{i!r}]")
            continue
        assert set(got) - {"master_param"} == set(ref), f"{what}: state[{i}] keys"
        for k, b in ref.items():
            same_state_value(got[k], b, f"{what}: state[{i}][{k!r}]")


def params_equal(model, ref, what):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"{what}: {n}")


def cfg(tmp_path, backend, placement, **kw):
    # mixed: fc1's state on NVMe by rule, the rest on the host
    rules = [{"match": "fc1.*", "tier": "nvme"}] if placement == "mixed" else []
    return config(tmp_path, backend=backend, host="1MiB" if rules else 0, kernel="match",
                  placement=rules, **kw)


def kept_on_disk(tmp_path, monkeypatch, model, opt, batches) -> dict:
    """Train crash-consistent, leaving the committed state on disk as a crash does (no
    host memory to hand it back to); returns the config a resume uses."""
    c = cfg(tmp_path, "threads", "mixed")
    c["swap"]["durability"] = "crash_consistent"
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            train(model, opt, batches)
    monkeypatch.undo()
    assert swap_dir(tmp_path).exists()
    return c


def resumed(c, model, make, batches, start):
    """A copy of `model` and a new optimizer (make(params)) resumed from the state kept
    under config `c`, then trained on `batches` from step `start`."""
    model2 = copy.deepcopy(model)
    opt2 = make(model2)
    with tiermem.offload(opt2, c, model=model2, resume=True):
        train(model2, opt2, batches, start=start)
    return model2, opt2


def pair(cls, kw):
    model = small()
    ref = copy.deepcopy(model)
    return model, cls(params_for(cls, model), **kw), ref, cls(params_for(cls, ref), **kw)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw, placement", db_rows())
def test_optim_db_parity(tmp_path, backend, cls, kw, placement):
    model, opt, ref, ref_opt = pair(cls, kw)
    batches = make_batches(model, STEPS + 2)
    with tiermem.offload(opt, cfg(tmp_path, backend, placement), model=model) as tm:
        losses = train(model, opt, batches[:STEPS])
        tiers = tm.plan()["state_bytes"]
        sd = opt.state_dict()
    assert tiers["nvme"] > 0 and (tiers["host"] > 0) == (placement == "mixed")
    ref_losses = train(ref, ref_opt, batches[:STEPS])
    assert losses == ref_losses
    params_equal(model, ref, "after the run")
    state_equal(sd, ref_opt.state_dict(), "state_dict()")
    state_equal(opt.state_dict(), ref_opt.state_dict(), "state handed back")
    # state_dict both ways: tiermem loads the plain optimizer's, a plain one tiermem's,
    # and both keep stepping as the reference does
    plain = cls(params_for(cls, model), **kw)
    plain.load_state_dict(sd)
    opt.load_state_dict(ref_opt.state_dict())
    with tiermem.offload(opt, cfg(tmp_path, backend, placement), model=model):
        train(model, opt, batches[STEPS:], start=STEPS)
    train(ref, ref_opt, batches[STEPS:], start=STEPS)
    params_equal(model, ref, "after loading the plain state_dict")
    state_equal(opt.state_dict(), ref_opt.state_dict(), "after loading")
    state_equal(plain.state_dict(), sd, "plain optimizer loaded from tiermem")


class Stepped(torch.optim.Optimizer):
    """The test optimizers' common part: one lr, a walk over the parameters with a grad."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    def with_grads(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    yield group, p, self.state[p]


class SelfCounted(Stepped):
    """Bias-corrected momentum whose step count and last learning rate live on the optimizer
    object (as Ranger21's lookahead_step and current_lr do), with a history list it appends
    to in place."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, lr)
        self.t, self.current_lr, self.lrs = 0, lr, []

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        self.current_lr = self.param_groups[0]["lr"] / (1 + 0.1 * self.t)
        self.lrs.append(self.current_lr)
        for _, p, st in self.with_grads():
            if not st:
                st["m"] = torch.zeros_like(p)
            st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            p.sub_(st["m"] / (1 - 0.9 ** self.t), alpha=self.current_lr)


class SavesItsCount(SelfCounted):
    """SelfCounted whose state_dict() carries its count beside "state" and "param_groups",
    and whose load_state_dict() takes it back (pytorch_optimizer's StableSPAM does so with
    its total_step)."""

    def state_dict(self):
        return {**super().state_dict(), "t": self.t}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.t = state_dict.get("t", 0)


class GlobalStep(Stepped):
    """Bias-corrected momentum counting its steps in state["global_step"], not under a
    parameter (MADGRAD keeps state["k"])."""

    @torch.no_grad()
    def step(self, closure=None):
        self.state["global_step"] = self.state.get("global_step", 0) + 1
        t = self.state["global_step"]
        for group, p, st in self.with_grads():
            if not st:
                st["m"] = torch.zeros_like(p)
            st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            p.sub_(st["m"] / (1 - 0.9 ** t), alpha=group["lr"])


class RandomStart(Stepped):
    """Momentum whose buffer starts as random noise drawn from torch's global generator (as
    Gravity's does): which draws a parameter gets depends on the order of the steps."""

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, st in self.with_grads():
            if not st:
                st["m"] = torch.randn_like(p) * 1e-2
            st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            p.sub_(st["m"], alpha=group["lr"])


class SelfCoupled(SelfCounted):
    """Steps each parameter on its own but keeps on itself the gradient norm over all of
    them (for the user's logging): the weights would come out right, that value not."""

    @torch.no_grad()
    def step(self, closure=None):
        self.t = 0.0
        for group, p, _ in self.with_grads():
            self.t += float(p.grad.square().sum())
            p.sub_(p.grad, alpha=group["lr"])


class GroupNormalised(torch.optim.Optimizer):
    """Momentum on gradients divided by the norm over the whole group: a step that couples
    the parameters of a group, which tiermem must refuse rather than run per partition."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            norm = torch.sqrt(sum(p.grad.square().sum() for p in ps))
            for p in ps:
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                st["m"].mul_(0.9).add_(p.grad / norm)
                p.add_(st["m"], alpha=-group["lr"])


class PerParameter(GroupNormalised):
    """The same, normalised per parameter: no coupling, so tiermem runs it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1  # a group value the step changes
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"], st["step"] = torch.zeros_like(p), 0
                st["step"] += 1
                st["m"].mul_(0.9).add_(p.grad / p.grad.norm())
                p.add_(st["m"], alpha=-group["lr"] / st["step"])


@pytest.mark.parametrize("cls, kw", [
    (torch.optim.ASGD, dict(t0=1)), (torch.optim.NAdam, dict(weight_decay=0.1)),
    (torch.optim.SGD, dict(momentum=0.9, dampening=0.5)), (torch.optim.Rprop, {}),
    (torch.optim.Adafactor, {}), (torch.optim.Adagrad, dict(lr_decay=0.01)),
    (torch.optim.RMSprop, dict(centered=True, momentum=0.9)), (torch.optim.Adamax, {}),
    (torch.optim.RAdam, dict(decoupled_weight_decay=True, weight_decay=0.1)),
    (torch.optim.Adadelta, {}), (torch.optim.Muon, {}),
    (torch.optim.AdamW, dict(amsgrad=True)),
    # the generic path with uint8 codes and block scales in its records
    (("bitsandbytes.optim", "AdamW8bit"), dict(lr=1e-3, min_8bit_size=1024)),
    (("bitsandbytes.optim", "Lion8bit"), dict(lr=1e-4)),
    # a momentum per beta in a dict
    (("torch_optimizer", "AggMo"), dict(lr=1e-3)),
    # counts outside the per-parameter state, kept in the manifest's values: .t,
    # .current_lr and the list .lrs on the optimizer; Ranger21's group step, .current_lr
    # and .lookahead_step; SOAP's group step; a count in the group
    (SelfCounted, {}),
    # a count in state["global_step"] / state["k"] (a 1-element tensor), loss averages in a
    # dict in state["ema"]
    (GlobalStep, {}), (("pytorch_optimizer", "MADGRAD"), dict(lr=1e-3)),
    (("pytorch_optimizer", "EmoNavi"), dict(lr=1e-3)),
    (("pytorch_optimizer", "Ranger21"), dict(lr=1e-3, num_iterations=20,
                                             lookahead_merge_time=2)),
    (("pytorch_optimizer", "SOAP"), dict(lr=1e-3, precondition_frequency=2)),
    # a cache in the group that its step rewrites: a list of [step, N_sma, step_size]
    (("torch_optimizer", "RAdam"), dict(lr=1e-3)),
    (PerParameter, {})],
    ids=lambda v: getattr(v, "__name__", None) or (v[1] if isinstance(v, tuple) else None))
def test_crash_consistent_resume(tmp_path, monkeypatch, cls, kw):
    """Every rule: kept per-parameter scalars (ASGD's eta, mu; NAdam's mu_product), records
    and the values a step changes outside the state (a count in a group or on the
    optimizer) come back from the committed manifest, and a resumed run continues exactly
    as an uninterrupted one. (No host memory to hand the state back to keeps it on disk, as
    a crash does.)"""
    if isinstance(cls, tuple):
        cls = load(*cls)
    model, opt, ref, ref_opt = pair(cls, kw)
    batches = make_batches(model, 5)
    c = kept_on_disk(tmp_path, monkeypatch, model, opt, batches[:3])
    model2, opt2 = resumed(c, model, lambda m: cls(params_for(cls, m), **kw), batches[3:], 3)
    train(ref, ref_opt, batches)
    params_equal(model2, ref, "resumed")
    state_equal(opt2.state_dict(), ref_opt.state_dict(), "resumed")
    own = ("t", "current_lr", "lrs", "lookahead_step")
    assert {k: v for k, v in vars(opt2).items() if k in own} == \
        {k: v for k, v in vars(ref_opt).items() if k in own}


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_refused_with_a_clear_error(tmp_path, cls):
    model = Synthetic()
    opt = cls(model.parameters())
    with pytest.raises(UnsupportedOptimizer, match=cls.__name__):
        with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme")):
            pass


def thirdparty():
    rows = [pytest.param(PerParameter, None, {}, id="per-parameter")]
    for mod, name, kw in [("lion_pytorch", "Lion", dict(lr=1e-3, weight_decay=0.1)),
                          ("torch_optimizer", "Lamb", dict(lr=1e-3)),
                          ("torch_optimizer", "AdaBelief", dict(lr=1e-3)),
                          ("torch_optimizer", "Yogi", dict(lr=1e-2)),
                          ("pytorch_optimizer", "Adan", dict(lr=1e-3)),
                          ("pytorch_optimizer", "AdaBelief", dict(lr=1e-3)),
                          # keeps lookahead_step and current_lr on itself, not per parameter
                          ("pytorch_optimizer", "Ranger21", dict(lr=1e-3, num_iterations=20,
                                                                 lookahead_merge_time=2)),
                          # keeps its step count in state['k'], not under a parameter
                          ("pytorch_optimizer", "MADGRAD", dict(lr=1e-3)),
                          # and loss averages in state['ema']
                          ("pytorch_optimizer", "EmoNavi", dict(lr=1e-3)),
                          # makes a (random) mask per matrix in __init__
                          ("pytorch_optimizer", "SPAM", dict(lr=1e-3, density=0.5)),
                          # draws its initial state from torch's global generator
                          ("pytorch_optimizer", "Gravity", dict(lr=1e-3)),
                          ("schedulefree", "AdamWScheduleFree", dict(lr=1e-3)),
                          # blockwise 8-bit state: uint8 codes, per-block scales and a code
                          # map per parameter (min_8bit_size 1024: the small ones too)
                          ("bitsandbytes.optim", "AdamW8bit", dict(lr=1e-3, min_8bit_size=1024)),
                          ("bitsandbytes.optim", "Lion8bit", dict(lr=1e-4)),
                          ("bitsandbytes.optim", "SGD8bit", dict(lr=1e-2, momentum=0.9)),
                          # per-side preconditioners in lists, column-major eigenbases
                          # (made again every 2 steps: used from the record in between)
                          ("pytorch_optimizer", "SOAP", dict(lr=1e-3, precondition_frequency=2)),
                          ("pytorch_optimizer", "SPlus", dict(lr=1e-3)),
                          # a momentum per beta in a dict keyed by the beta
                          ("pytorch_optimizer", "AggMo", dict(lr=1e-3)),
                          ("torch_optimizer", "AggMo", dict(lr=1e-3)),
                          # its last gradients in a deque
                          ("pytorch_optimizer", "AdaShift", dict(lr=1e-3))]:
        rows.append(pytest.param(mod, name, kw, id=f"{mod}.{name}"))
    return rows


REFUSED_THIRDPARTY = {"SPAM": "that step does not make it",
                      "Gravity": "its step draws random numbers",
                      "AdaShift": "keeps state 'grad_queue' as a deque"}


def load(mod, name):
    if isinstance(mod, type):
        return mod
    return getattr(pytest.importorskip(mod), name)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("mod, name, kw", thirdparty())
def test_thirdparty_equal_or_refused(tmp_path, backend, mod, name, kw):
    """Each third-party optimizer ends equal to its plain run, or is refused with
    tiermem's error: never different."""
    cls = load(mod, name)
    model, opt, ref, ref_opt = pair(cls, kw)
    batches = make_batches(model, STEPS + 2)
    modes = callable(getattr(cls, "train", None))  # schedule-free: train() before steps
    try:
        with tiermem.offload(opt, cfg(tmp_path, backend, "mixed"), model=model):
            if modes:
                opt.train()
            train(model, opt, batches[:STEPS])
            sd = opt.state_dict()
    except UnsupportedOptimizer as exc:
        assert cls.__name__ in str(exc)
        assert name in REFUSED_THIRDPARTY, f"refused unexpectedly: {exc}"
        assert REFUSED_THIRDPARTY[name] in str(exc)
        return
    assert name not in REFUSED_THIRDPARTY, "ran, where tiermem should refuse it"
    if modes:
        ref_opt.train()
    train(ref, ref_opt, batches[:STEPS])
    params_equal(model, ref, cls.__name__)
    state_equal(sd, ref_opt.state_dict(), f"{cls.__name__}: state_dict() under offload")
    state_equal(opt.state_dict(), ref_opt.state_dict(), cls.__name__)
    for g, h in zip(opt.param_groups, ref_opt.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == \
            {k: v for k, v in h.items() if k != "params"}
    # state_dict both ways: a plain optimizer loads tiermem's, tiermem the plain one's,
    # and the tiered one keeps stepping as the reference does
    plain = cls(params_for(cls, model), **kw)
    plain.load_state_dict(sd)
    state_equal(plain.state_dict(), sd, f"{cls.__name__}: plain loaded from tiermem")
    opt.load_state_dict(ref_opt.state_dict())
    with tiermem.offload(opt, cfg(tmp_path, backend, "mixed"), model=model):
        train(model, opt, batches[STEPS:], start=STEPS)
    train(ref, ref_opt, batches[STEPS:], start=STEPS)
    params_equal(model, ref, f"{cls.__name__}: after loading the plain state_dict")
    state_equal(opt.state_dict(), ref_opt.state_dict(), f"{cls.__name__}: after loading")


class Rounded(torch.Tensor):
    """Momentum kept at bf16 precision behind an fp32 face, as torchao's low-bit optimizer
    states keep codes and scales: every in-place op on it rounds the result to bf16."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func.__name__.endswith("_") and args and type(args[0]) is cls:
            with torch._C.DisableTorchFunctionSubclass():
                args[0].copy_(args[0].to(torch.bfloat16).float())
        return out


class RoundedMomentum(Stepped):
    """SGD with momentum whose buffer is a Rounded tensor subclass."""

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, st in self.with_grads():
            if not st:
                st["m"] = torch.zeros_like(p).as_subclass(Rounded)
            st["m"].mul_(0.9).add_(p.grad)
            p.sub_(st["m"].as_subclass(torch.Tensor), alpha=group["lr"])


def test_tensor_subclass_state_refused(tmp_path):
    """State in a tensor subclass (torchao's OptimState8bit/4bit/Fp8) is refused at the
    layout probe, before any of the optimizer's state or the weights changed."""
    model = small()
    before = [p.detach().clone() for p in model.parameters()]
    opt = RoundedMomentum(model.parameters())
    with pytest.raises(UnsupportedOptimizer, match=r"'m' is a .*Rounded, a tensor subclass"):
        with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme"), model=model):
            train(model, opt, make_batches(model, 1))
    assert not opt.state
    for p, b in zip(model.parameters(), before):
        assert_same_tensor(p.detach(), b, "a weight after the refusal")


def lowbit_pair(name):
    """torchao's low-bit AdamW keeps OptimState8bit/4bit/Fp8 for parameters of 4096 or more
    elements that its block size divides (the others get plain fp32 state)."""
    cls = getattr(pytest.importorskip("torchao.optim"), name)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(),
                                   torch.nn.Linear(512, 8))
    model, ref = make(), make()
    return cls, model, cls(model.parameters(), lr=1e-2), ref, cls(ref.parameters(), lr=1e-2)


def lowbit_train(model, opt, xs):
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_torchao_low_bit_state_equal(tmp_path, backend, name):
    """torchao's low-bit state is a tensor subclass made of plain tensors (codes, block
    scales, a code map): the record keeps those, in their own dtypes, so the NVMe bytes are
    the optimizer's own few per parameter and the run is bitwise the plain one."""
    cls, model, opt, ref, ref_opt = lowbit_pair(name)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 256, generator=g) for _ in range(6)]
    with tiermem.offload(opt, cfg(tmp_path, backend, "nvme"), model=model) as tm:
        lowbit_train(model, opt, xs[:4])
        sd = opt.state_dict()
        on_disk = tm.plan()["state_bytes"]["nvme"]
    lowbit_train(ref, ref_opt, xs[:4])
    params_equal(model, ref, name)
    ref_sd = ref_opt.state_dict()
    state_equal(sd, ref_sd, f"{name}: state_dict()")
    state_equal(opt.state_dict(), ref_sd, f"{name}: state handed back")
    big = model[0].weight
    assert type(opt.state[big]["exp_avg"]) is type(ref_opt.state[ref[0].weight]["exp_avg"])
    n = sum(p.numel() for p in model.parameters())
    assert on_disk < 4 * n, f"{on_disk} bytes on NVMe for {n} parameters: not low-bit"
    # state_dict both ways
    plain = cls(model.parameters(), lr=1e-2)
    plain.load_state_dict(sd)
    state_equal(plain.state_dict(), sd, f"{name}: plain loaded from tiermem")
    opt.load_state_dict(ref_sd)
    with tiermem.offload(opt, cfg(tmp_path, backend, "nvme"), model=model):
        lowbit_train(model, opt, xs[4:])
    lowbit_train(ref, ref_opt, xs[4:])
    params_equal(model, ref, f"{name}: after loading the plain state_dict")
    state_equal(opt.state_dict(), ref_opt.state_dict(), f"{name}: after loading")


def test_torchao_low_bit_state_resumes(tmp_path, monkeypatch):
    """A crash-consistent run of torchao's 4-bit AdamW (its shape is in the subclass's
    context) resumes from the manifest and continues as an uninterrupted run."""
    cls, model, opt, ref, ref_opt = lowbit_pair("AdamW4bit")
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 256, generator=g) for _ in range(5)]
    c = cfg(tmp_path, "threads", "nvme")
    c["swap"]["durability"] = "crash_consistent"
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            lowbit_train(model, opt, xs[:3])
    monkeypatch.undo()
    model2 = copy.deepcopy(model)
    opt2 = cls(model2.parameters(), lr=1e-2)
    with tiermem.offload(opt2, c, model=model2, resume=True):
        lowbit_train(model2, opt2, xs[3:])
    lowbit_train(ref, ref_opt, xs)
    params_equal(model2, ref, "resumed")
    state_equal(opt2.state_dict(), ref_opt.state_dict(), "resumed")


def test_tensor_subclass_refusal_is_what_keeps_it_exact(tmp_path, monkeypatch):
    """Without the refusal the run goes through and ends different from the plain one (the
    record keeps the subclass's values as a plain tensor, which then steps unrounded): the
    refusal is what stands between this optimizer and a silently different result."""
    import tiermem.optim.rules.generic as generic

    monkeypatch.setattr(generic, "_subclass_refusal", lambda *a: None)
    model, opt, ref, ref_opt = pair(RoundedMomentum, {})
    batches = make_batches(model, STEPS)
    with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme"), model=model):
        train(model, opt, batches)
    train(ref, ref_opt, batches)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


class CoinFlipped(Stepped):
    """Momentum that skips its update on a coin flip once a step (as Kron decides on
    balancing its preconditioner with np.random): `coin` draws from a global generator."""

    coin = staticmethod(lambda: np.random.random())

    @torch.no_grad()
    def step(self, closure=None):
        skip = self.coin() < 0.5
        for group, p, st in self.with_grads():
            if not st:
                st["m"] = torch.zeros_like(p)
            st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            if not skip:
                p.sub_(st["m"], alpha=group["lr"])


class PythonCoinFlipped(CoinFlipped):
    coin = staticmethod(lambda: random.random())


def _seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("cls, which", [
    (RandomStart, "torch's global generator"), (CoinFlipped, r"numpy's global generator"),
    (PythonCoinFlipped, r"Python's global generator")],
    ids=lambda v: getattr(v, "__name__", None))
def test_random_draws_refused(tmp_path, monkeypatch, cls, which):
    """A step that draws from torch's, numpy's or Python's global generator is refused at
    entry, the generators and the state untouched; with the checks patched out the run ends
    different from the plain one (same seeds before each)."""
    import tiermem.optim.rules.generic as generic

    model, opt, ref, ref_opt = pair(cls, {})
    batches = make_batches(model, 4)
    _seed_all(3)
    with pytest.raises(UnsupportedOptimizer, match=f"its step draws random numbers from {which}"):
        with tiermem.offload(opt, cfg(tmp_path, "threads", "mixed"), model=model):
            pass
    draws = (torch.rand(()), np.random.random(), random.random())
    _seed_all(3)
    assert draws == (torch.rand(()), np.random.random(), random.random())
    assert not opt.state
    monkeypatch.setattr(generic.ShadowRule, "_refuse_draws", lambda self, before: None)
    # (a coin flipped once a partition also makes the coupling probe's runs differ)
    monkeypatch.setattr(generic.ShadowRule, "_probe_coupling", lambda self, g, group: None)
    _seed_all(5)
    with tiermem.offload(opt, cfg(tmp_path, "threads", "mixed"), model=model):
        train(model, opt, batches)
    _seed_all(5)
    train(ref, ref_opt, batches)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("backend", backend_params())
def test_state_not_under_a_parameter_carried_across_partitions(tmp_path, backend):
    """A step count kept in state["global_step"] (MADGRAD keeps state["k"]) is carried as
    the values kept on the optimizer are: each partition's shadow starts from the step's
    value, the first one's result stays in opt.state. state_dict() keeps it under its key,
    both ways."""
    model, opt, ref, ref_opt = pair(GlobalStep, {})
    batches = make_batches(model, 5)
    with tiermem.offload(opt, cfg(tmp_path, backend, "mixed"), model=model) as tm:
        train(model, opt, batches[:3])
        assert len(tm.offloaded.parts) > 1
        sd = opt.state_dict()
    train(ref, ref_opt, batches[:3])
    assert opt.state["global_step"] == 3 and sd["state"]["global_step"] == 3
    params_equal(model, ref, "GlobalStep")
    state_equal(sd, ref_opt.state_dict(), "GlobalStep: state_dict() under offload")
    plain = GlobalStep(model.parameters())
    plain.load_state_dict(sd)
    state_equal(plain.state_dict(), sd, "GlobalStep: plain loaded from tiermem")
    opt.load_state_dict(ref_opt.state_dict())
    with tiermem.offload(opt, cfg(tmp_path, backend, "mixed"), model=model):
        train(model, opt, batches[3:], start=3)
    train(ref, ref_opt, batches[3:], start=3)
    params_equal(model, ref, "GlobalStep: after loading the plain state_dict")
    assert opt.state["global_step"] == ref_opt.state["global_step"] == 5


class ObjectCounted(Stepped):
    """Keeps an object (not a value tiermem can copy and compare) in its state."""

    @torch.no_grad()
    def step(self, closure=None):
        self.state.setdefault("clock", types.SimpleNamespace(t=0)).t += 1
        for group, p, _ in self.with_grads():
            p.sub_(p.grad, alpha=group["lr"])


class NumberKeyed(Stepped):
    """Keeps a count in its state under the number 7."""

    @torch.no_grad()
    def step(self, closure=None):
        self.state[7] = self.state.get(7, 0) + 1
        for group, p, _ in self.with_grads():
            p.sub_(p.grad, alpha=group["lr"])


class MadeInInit(Stepped):
    """Makes a mask per matrix in __init__ (as SPAM does), before any step."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, lr)
        for _, p, st in ((g, p, self.state[p]) for g in self.param_groups
                         for p in g["params"]):
            if p.dim() == 2:
                st["mask"] = torch.ones_like(p, dtype=torch.bool)

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, st in self.with_grads():
            if "m" not in st:
                st["m"] = torch.zeros_like(p)
            st["m"].mul_(0.9).add_(p.grad)
            update = st["m"] if "mask" not in st else torch.where(st["mask"], st["m"], 0.0)
            p.sub_(update, alpha=group["lr"])


@pytest.mark.parametrize("cls, why", [
    (ObjectCounted, "keeps state under 'clock', not under a parameter, as a SimpleNamespace"),
    (NumberKeyed, "keeps state under 7, which is neither a parameter nor a string"),
    (MadeInInit, r"state \['mask'\] of a parameter of shape .*does not make it")],
    ids=lambda v: getattr(v, "__name__", None))
def test_state_tiermem_cannot_carry_refused(tmp_path, cls, why):
    """Refused at entry, naming the entry, with the weights and the optimizer's state as
    they were."""
    model = small()
    opt = cls(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: dict(v) for k, v in opt.state.items()}
    with pytest.raises(UnsupportedOptimizer, match=why):
        with tiermem.offload(opt, cfg(tmp_path, "threads", "mixed"), model=model):
            pass
    assert {k: dict(v) for k, v in opt.state.items()} == state_before
    for p, b in zip(model.parameters(), before):
        assert_same_tensor(p.detach(), b, "a weight after the refusal")


@pytest.mark.parametrize("backend", backend_params())
def test_values_kept_on_the_optimizer_carried_across_partitions(tmp_path, backend):
    """The step changes values the optimizer keeps on itself once per step, as the plain run
    does: each partition's shadow starts from the step's values and the first one's result
    is set back (a list appended in place grows by one entry a step, not one a partition)."""
    model, opt, ref, ref_opt = pair(SelfCounted, {})
    batches = make_batches(model, 4)
    with tiermem.offload(opt, cfg(tmp_path, backend, "mixed"), model=model) as tm:
        train(model, opt, batches)
        assert len(tm.offloaded.parts) > 1
    train(ref, ref_opt, batches)
    assert (opt.t, opt.current_lr, opt.lrs) == (ref_opt.t, ref_opt.current_lr, ref_opt.lrs)
    params_equal(model, ref, "SelfCounted")


class GroupCounted(Stepped):
    """Bias-corrected momentum counting its steps in each group, every step, whether or not
    any parameter of the group has a gradient (as pytorch-optimizer's Lamb and Adan do)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                p.sub_(st["m"] / (1 - 0.9 ** group["step"]), alpha=group["lr"])


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_a_group_without_gradients_still_counts_its_step(tmp_path, backend, overlap):
    """The side branch, in a group of its own, has gradients only on steps 1 and 4 (and
    an empty group none ever): the plain step counts in every group every step, and so
    must the tiered one, though no partition of such a group is updated."""
    def groups(m):
        side = [m.side.weight, m.side.bias]
        return [{"params": [p for p in m.parameters() if all(p is not q for q in side)]},
                {"params": side, "lr": 2e-3}, {"params": []}]
    model = small()
    ref = copy.deepcopy(model)
    opt, ref_opt = GroupCounted(groups(model)), GroupCounted(groups(ref))
    batches = make_batches(model, 6)
    c = cfg(tmp_path, backend, "nvme")
    c["pipeline"]["overlap_backward"] = overlap
    with tiermem.offload(opt, c, model=model):
        train(model, opt, batches)
    train(ref, ref_opt, batches)
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in ref_opt.param_groups]
    params_equal(model, ref, "GroupCounted")
    state_equal(opt.state_dict(), ref_opt.state_dict(), "GroupCounted")


@pytest.mark.parametrize("cls, count", [(SelfCounted, lambda o: o.t),
                                        (GlobalStep, lambda o: o.state.get("global_step"))],
                         ids=["on-the-optimizer", "in-its-state"])
def test_values_kept_on_the_optimizer_are_what_keeps_it_exact(tmp_path, monkeypatch, cls,
                                                              count):
    """With the carrying patched out, the shadows' counts are lost and the run ends different
    from the plain one, with no error."""
    from tiermem.optim.rules.generic import ShadowRule

    monkeypatch.setattr(ShadowRule, "_carry_own_values", lambda self, sh: None)
    model, opt, ref, ref_opt = pair(cls, {})
    batches = make_batches(model, 4)
    with tiermem.offload(opt, cfg(tmp_path, "threads", "mixed"), model=model):
        train(model, opt, batches)
    train(ref, ref_opt, batches)
    assert count(opt) != count(ref_opt)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_resume_before_the_first_step_of_a_lazily_counted_optimizer(tmp_path, monkeypatch):
    """A crash before the first step resumes to step 0, where the counts a first step makes
    (on the optimizer, in its group) do not exist yet: the manifest says so, and the
    resumed run makes them as an uninterrupted one does."""
    model, opt, ref, ref_opt = pair(LazilyCounted, {})
    batches = make_batches(model, 3)
    c = kept_on_disk(tmp_path, monkeypatch, model, opt, [])
    assert read_manifest(str(swap_dir(tmp_path)), None).values["absent"] == [
        "param_groups[0]['count']", ".t", ".state['seen']"]
    model2, opt2 = resumed(c, model, lambda m: LazilyCounted(m.parameters()), batches, 0)
    train(ref, ref_opt, batches)
    params_equal(model2, ref, "resumed")
    assert (opt2.t, opt2.param_groups[0]["count"], opt2.state["seen"]) == (ref_opt.t, 3, 3)


class LateLatched(Stepped):
    """Halves its step size from its fifth step on, by a flag on itself, a key in its group
    and an entry in its state that the fifth step sets (after the coupling probe's three
    steps, which see only its group count change)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, lr)
        self.warm = False

    @torch.no_grad()
    def step(self, closure=None):
        group0 = self.param_groups[0]
        group0["n"] = group0.get("n", 0) + 1
        if group0["n"] == 5:
            self.warm, group0["scale"], self.state["phase"] = True, 0.5, "late"
        for group, p, st in self.with_grads():
            if not st:
                st["m"] = torch.zeros_like(p)
            st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            scale = group0.get("scale", 1.0) * (0.5 if self.warm else 1.0)
            if self.state.get("phase") == "late":
                scale *= 0.5
            p.sub_(st["m"], alpha=group["lr"] * scale)


@pytest.mark.parametrize("probe_seen_only", [False, True])
def test_resume_keeps_values_that_first_change_after_the_probe(tmp_path, monkeypatch,
                                                                 probe_seen_only):
    """The manifest keeps every simple value outside the state, not only those the coupling
    probe saw change: a flag, a group key and a state entry the fifth step sets come back
    from a commit after it, and the resumed run continues exactly. With only the probe's
    values kept, it ends different, with no error."""
    from tiermem.optim.rules.generic import ShadowRule

    if probe_seen_only:
        monkeypatch.setattr(ShadowRule, "_kept", ShadowRule._changed)
    model, opt, ref, ref_opt = pair(LateLatched, {})
    batches = make_batches(model, 8)
    c = kept_on_disk(tmp_path, monkeypatch, model, opt, batches[:6])
    model2, opt2 = resumed(c, model, lambda m: LateLatched(m.parameters()), batches[6:], 6)
    train(ref, ref_opt, batches)
    same = all(torch.equal(p, q) for p, q in zip(model2.parameters(), ref.parameters()))
    assert same != probe_seen_only
    if not probe_seen_only:
        assert (opt2.warm, opt2.param_groups[0]["scale"], opt2.state["phase"]) == \
            (True, 0.5, "late")


class Keyed(SelfCounted):
    """SelfCounted that also keeps a dict of its last learning rates: no manifest value."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        self.by_step = {self.t: self.current_lr}


@pytest.mark.parametrize("unkept", [False, True])
def test_resume_refused_when_the_manifest_cannot_keep_a_changed_value(
        tmp_path, monkeypatch, unkept):
    """A changed value JSON cannot keep exactly (a dict keyed by ints), or a manifest that
    does not keep the changed values (an earlier tiermem's): the resume is refused, naming
    the value, and the kept state stays on disk."""
    model, opt, ref, ref_opt = pair(Keyed if unkept else SelfCounted, {})
    batches = make_batches(model, 3)
    c = kept_on_disk(tmp_path, monkeypatch, model, opt, batches)
    if not unkept:  # as an earlier tiermem wrote it: no "values"
        run_dir = swap_dir(tmp_path)
        m = read_manifest(str(run_dir), None)
        m.values = {}
        write_manifest(str(run_dir), m)
    opt2 = type(opt)(params_for(type(opt), model))
    with pytest.raises(UnsupportedOptimizer, match="cannot resume") as err:
        with tiermem.offload(opt2, c, model=model, resume=True):
            pass
    assert (".by_step" if unkept else ".lrs") in str(err.value), str(err.value)
    assert swap_dir(tmp_path).exists()  # the kept state is still there


def failing_second_partition(tmp_path, cls):
    """A crash-consistent config with all state on NVMe, and a step() for `cls` that raises
    on the second partition it is called for (the first one's values already set back)."""
    c = cfg(tmp_path, "threads", "nvme")
    c["swap"]["durability"] = "crash_consistent"
    plain_step, calls = cls.step, []

    def second_fails(self, closure=None):
        calls.append(self)
        if len(calls) == 2:
            raise RuntimeError("boom in the second partition")
        return plain_step(self, closure)
    return c, second_fails


@pytest.mark.parametrize("cls, count", [
    (SelfCounted, lambda o: (o.t, list(o.lrs))),
    (GlobalStep, lambda o: o.state["global_step"])], ids=["on-the-optimizer", "in-its-state"])
def test_rolled_back_step_puts_back_the_values_kept_on_the_optimizer(tmp_path, monkeypatch,
                                                                    cls, count):
    """A step that fails part-way (the optimizer's own step raising on the second partition,
    after the first had set the optimizer's count) rolls back the state and the count with
    it: training then goes on exactly as the plain run."""
    model, opt, ref, ref_opt = pair(cls, {})
    batches = make_batches(model, 4)
    c, second_fails = failing_second_partition(tmp_path, cls)
    with tiermem.offload(opt, c, model=model) as tm:
        train(model, opt, batches[:2])
        assert len(tm.offloaded.parts) > 2
        after_two = count(opt)
        monkeypatch.setattr(cls, "step", second_fails)
        with pytest.raises(UnsupportedOptimizer, match="boom in the second") as info:
            train(model, opt, batches[2:3], start=2)
        monkeypatch.undo()
        assert "rolled back to committed step 2" in "".join(info.value.__notes__)
        assert count(opt) == after_two
        opt.zero_grad()  # the failed step's gradients, which the retry would add to
        train(model, opt, batches[2:], start=2)
    train(ref, ref_opt, batches)
    assert count(opt) == count(ref_opt)
    params_equal(model, ref, "after the roll-back")


class LazilyCounted(Stepped):
    """Makes its step count on itself, a count in its group and one in its state at its
    first step."""

    @torch.no_grad()
    def step(self, closure=None):
        if not hasattr(self, "t"):
            self.t = 0
            self.param_groups[0]["count"] = 0
        self.state["seen"] = self.state.get("seen", 0) + 1
        self.t += 1
        self.param_groups[0]["count"] += 1
        for group, p, st in self.with_grads():
            if not st:
                st["m"] = torch.zeros_like(p)
            st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            p.sub_(st["m"] / (1 - 0.9 ** self.t), alpha=group["lr"])


def test_rolled_back_first_step_removes_what_it_made(tmp_path, monkeypatch):
    """The first step failing part-way is rolled back to step 0, and what it made outside
    the state (a count on the optimizer, a key in its group) goes with it: the retried step
    makes them again, and training goes on exactly as the plain run."""
    model, opt, ref, ref_opt = pair(LazilyCounted, {})
    batches = make_batches(model, 3)
    c, second_fails = failing_second_partition(tmp_path, LazilyCounted)
    with tiermem.offload(opt, c, model=model):
        monkeypatch.setattr(LazilyCounted, "step", second_fails)
        with pytest.raises(UnsupportedOptimizer, match="boom in the second"):
            train(model, opt, batches[:1])
        monkeypatch.undo()
        assert not hasattr(opt, "t") and "count" not in opt.param_groups[0]
        assert "seen" not in opt.state
        opt.zero_grad()
        train(model, opt, batches)
    train(ref, ref_opt, batches)
    assert (opt.t, opt.param_groups[0]["count"], opt.state["seen"]) == (ref_opt.t, 3, 3)
    params_equal(model, ref, "after the roll-back")


@pytest.mark.parametrize("cls, why", [
    (GroupNormalised, "probe parameter 0 .* ends differently"),
    # a value kept on the optimizer that sums over parameters (its weights come out right)
    (SelfCoupled, "the values it keeps on itself end differently")],
    ids=lambda v: getattr(v, "__name__", None))
def test_coupling_optimizer_refused(tmp_path, cls, why):
    model = Synthetic()
    opt = cls(model.parameters())
    with pytest.raises(UnsupportedOptimizer, match=f"couples its parameters.*{why}"):
        with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme")):
            pass
    assert not opt.state and getattr(opt, "t", 0) == 0  # refused before anything changed


def test_whole_parameter_partitions(tmp_path):
    """Muon's orthogonalisation and Adafactor's factored statistics span a parameter: it is
    never cut, one larger than the partition is a partition of its own, and Adafactor's
    row/column statistics take their own size in the record."""
    model = Synthetic()
    opt = torch.optim.Muon(muon_params(model))
    with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme")) as tm:
        parts = tm.offloaded.parts
        for part in parts:
            for s in part.segments:
                assert s.start == 0 and s.length == s.param.numel()
        big = [p for p in parts if any(s.param is model.fc1.weight for s in p.segments)]
        assert len(big) == 1 and len(big[0].segments) == 1
        assert big[0].record_bytes > 64 * 1024  # larger than partition_size: its own
    opt = torch.optim.Adafactor(model.parameters())
    with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme")) as tm:
        part = next(p for p in tm.offloaded.parts
                    if any(s.param is model.fc1.weight for s in p.segments))
        seg = next(s for s in part.segments if s.param is model.fc1.weight)
        assert seg.size("row_var") == 1031 and seg.size("col_var") == 61


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9)), (torch.optim.Adagrad, dict(lr=0.05)),
    (torch.optim.RMSprop, dict(lr=0.01, centered=True)), (torch.optim.Adafactor, {})])
def test_closures_and_lr_schedulers(tmp_path, backend, cls, kw):
    """step(closure) and an lr scheduler stepping the groups' lr (a plain float, read by
    the rule each step) end equal to the plain run."""
    model, opt, ref, ref_opt = pair(cls, kw)
    batches = make_batches(model, 4)

    def sched(o):
        return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    with tiermem.offload(opt, cfg(tmp_path, backend, "nvme"), model=model):
        losses = train(model, opt, batches, closure=True, sched=sched(opt))
    ref_losses = train(ref, ref_opt, batches, closure=True, sched=sched(ref_opt))
    assert losses == ref_losses
    params_equal(model, ref, "closure + scheduler")
    state_equal(opt.state_dict(), ref_opt.state_dict(), "closure + scheduler")
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != kw.get("lr", 0.01)


@pytest.mark.parametrize("backend", backend_params())
def test_load_state_dict_hands_the_optimizer_its_own_keys(tmp_path, backend):
    """An optimizer whose state_dict() adds its own keys beside state and param_groups gets
    them back in a load under tiermem, as in a plain load: a fresh optimizer loading a
    plain one's state_dict steps on as the plain one does."""
    model, opt, ref, ref_opt = pair(SavesItsCount, {})
    batches = make_batches(model, 4)
    train(ref, ref_opt, batches[:2])
    model.load_state_dict(ref.state_dict())
    with tiermem.offload(opt, cfg(tmp_path, backend, "mixed"), model=model):
        opt.load_state_dict(ref_opt.state_dict())
        train(model, opt, batches[2:], start=2)
        sd = opt.state_dict()
    train(ref, ref_opt, batches[2:], start=2)
    assert (opt.t, sd["t"]) == (ref_opt.t, ref_opt.t) == (4, 4)
    params_equal(model, ref, "after loading a state_dict with its own keys")
