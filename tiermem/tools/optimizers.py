"""The optimizers `tiermem stress` and `tiermem plan` run by name, what each keeps per
parameter (asked of its update rule), and the plain optimizer's in-memory recomputation of
a partition that `stress --verify` compares with.

A name stands for one optimizer class and its settings (SGD is SGD with momentum 0.9,
RMSprop is centered with momentum: the settings that keep the most state). Third-party
names need their package (the `thirdparty` extra); the error says which. Any other
torch.optim.Optimizer subclass is named by its import path (`bitsandbytes.optim.AdamW8bit`,
`pytorch_optimizer.SOAP`), and a name or path may carry keyword arguments as Python
literals: `sgd(momentum=0.5, nesterov=True)`, `pytorch_optimizer.SOAP(precondition_frequency=10)`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from tiermem.config import Settings
from tiermem.errors import TierMemError
from tiermem.optim.rules import AdamRule, UpdateRule, rule_class, rule_for, shadow_optimizer
from tiermem.partition import (MOMENT_DTYPES, QUANT_BLOCK, SCALE_KINDS, Partition,
                               flat_like, kind_dtype)


class UnknownOptimizer(TierMemError, ValueError):
    """A name `--optimizer` does not know, or whose package is not installed."""


@dataclass(frozen=True)
class Choice:
    """One `--optimizer NAME`: the class (module, name), its settings, and which parameters
    it steps."""

    module: str
    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    matrices_only: bool = False  # Muon: 2-D parameters only
    package: str | None = None  # the pip package of a third-party optimizer


OPTIMIZERS: dict[str, Choice] = {
    "adamw": Choice("torch.optim", "AdamW", dict(weight_decay=0.01)),
    "adam": Choice("torch.optim", "Adam"),
    "sgd": Choice("torch.optim", "SGD", dict(momentum=0.9)),
    "adagrad": Choice("torch.optim", "Adagrad"),
    "rmsprop": Choice("torch.optim", "RMSprop", dict(momentum=0.9, centered=True)),
    "adamax": Choice("torch.optim", "Adamax"),
    "nadam": Choice("torch.optim", "NAdam"),
    "radam": Choice("torch.optim", "RAdam"),
    "adadelta": Choice("torch.optim", "Adadelta"),
    "asgd": Choice("torch.optim", "ASGD"),
    "rprop": Choice("torch.optim", "Rprop"),
    "adafactor": Choice("torch.optim", "Adafactor"),
    "muon": Choice("torch.optim", "Muon", matrices_only=True),
    "lion": Choice("lion_pytorch", "Lion", dict(weight_decay=0.01), package="lion-pytorch"),
    "lamb": Choice("torch_optimizer", "Lamb", package="torch-optimizer"),
    "adan": Choice("pytorch_optimizer", "Adan", package="pytorch-optimizer"),
}


def known() -> str:
    return ", ".join(OPTIMIZERS)


def _normalised(spec: str) -> str:
    """`spec` with a table name in lower case and module:Class (as entry points write
    it) as module.Class."""
    head, paren, rest = spec.strip().partition("(")
    head = head.strip()
    head = head.lower() if head.lower() in OPTIMIZERS else head.replace(":", ".")
    return head + paren + rest


def _split(spec: str) -> tuple[str, dict[str, Any]]:
    """`name` or `name(key=literal, ...)`: the name and the keyword arguments."""
    spec = _normalised(spec)
    if "(" not in spec:
        return spec, {}
    try:
        call = ast.parse(spec, mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise ValueError("keyword arguments only")
        name = ast.unparse(call.func)
        kwargs = {}
        for kw in call.keywords:
            if kw.arg is None:
                raise ValueError("no **")
            kwargs[kw.arg] = ast.literal_eval(kw.value)
    except (SyntaxError, ValueError) as exc:
        raise UnknownOptimizer(
            f"cannot read optimizer {spec!r} ({exc}): give a name or an import path, "
            "optionally with keyword arguments as Python literals, as "
            "'sgd(momentum=0.5)' or 'pytorch_optimizer.SOAP(precondition_frequency=10)'"
        ) from None
    return name, kwargs


def canonical(spec: str) -> str:
    """`spec` as the rest of tiermem compares it: a table name in lower case; UnknownOptimizer
    if it names nothing that loads, or its arguments are not the class's."""
    c = choice(spec)
    try:  # the class's own check of its arguments (a negative lr, a misspelt keyword)
        optimizer_class(c)([torch.zeros(2, 2, requires_grad=True)], **{"lr": 1e-3, **c.kwargs})
    except Exception as exc:
        raise UnknownOptimizer(f"optimizer {spec.strip()!r}: {c.module}.{c.cls} does not take "
                               f"these arguments ({type(exc).__name__}: {exc})") from None
    return _normalised(spec)


def choice(spec: str) -> Choice:
    """The Choice for `spec` (a name of the table or a class's import path, each optionally
    with keyword arguments), its class importable; UnknownOptimizer otherwise."""
    name, kwargs = _split(spec)
    c = OPTIMIZERS.get(name.lower())
    if c is None:
        module, _, cls = name.rpartition(".")
        if not module:
            raise UnknownOptimizer(f"unknown optimizer {name!r}; known: {known()}; or any "
                                   "torch.optim.Optimizer subclass by its import path "
                                   "(package.module.Class)")
        c = Choice(module, cls)
    try:
        found = getattr(importlib.import_module(c.module), c.cls)
    except (ImportError, AttributeError) as exc:
        hint = (f"pip install {c.package} (or tiermem[thirdparty])" if c.package
                else "a newer torch" if c.module.startswith("torch.")
                else f"install the package that provides {c.module}")
        raise UnknownOptimizer(f"optimizer {name!r} needs {c.module}.{c.cls}, which does not "
                               f"load here ({exc}): {hint}") from None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise UnknownOptimizer(f"{c.module}.{c.cls} is not a torch.optim.Optimizer subclass")
    if kwargs:
        c = dataclasses.replace(c, kwargs={**c.kwargs, **kwargs})
    return c


def optimizer_class(c: Choice) -> type[torch.optim.Optimizer]:
    return getattr(importlib.import_module(c.module), c.cls)


def stepped(c: Choice, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters the optimizer steps."""
    return [p for p in params if p.dim() == 2] if c.matrices_only else list(params)


def make_optimizer(name: str, params: Sequence[torch.Tensor], lr: float
                   ) -> torch.optim.Optimizer:
    """`name`'s optimizer over `params` (lr: unless the name gives one)."""
    c = choice(name)
    return optimizer_class(c)(stepped(c, params), **{"lr": lr, **c.kwargs})


# -- state bytes per parameter: asked of the rule ----------------------------------------

# Each whole-parameter shape is probed on two small stand-ins of its rank whose sizes
# differ in every dimension, so that each state tensor's dimensions map back to the
# parameter's: a size alike in both is a constant (a code map), a pair of sizes is that
# dimension of the parameter, and a 1-D size both stand-ins' element counts divide by the
# same number is one value per block of that many elements (block scales). The first two
# dimensions are multiples of 64 and a matrix has 4096 elements or more: the sizes at
# which bitsandbytes' and torchao's 8-bit formats take over (smaller ones get fp32 state).
PROXIES = ((192, 320, 3, 5, 7, 11), (320, 448, 5, 7, 11, 13))
PROXIES_MANY = ((11, 13, 17, 19, 23, 29, 31, 37), (13, 17, 19, 23, 29, 31, 37, 41))


def _probe_rule(name: str, dtype: torch.dtype, settings: Settings
                ) -> tuple[UpdateRule, torch.optim.Optimizer]:
    c = choice(name)
    dims = (2,) if c.matrices_only else (1, 2)
    probe = [torch.zeros((7,) * d, dtype=dtype, requires_grad=True) for d in dims]
    opt = optimizer_class(c)(probe, **{"lr": 1e-3, **c.kwargs})
    o = settings.optimizer
    options = dict(state_dtype=o.state_dtype, state_rounding=o.state_rounding)
    if o.master_weights != "fp32" and rule_class(opt) is AdamRule:
        options["master_weights"] = o.master_weights  # what only the Adam rule takes
    return rule_for(opt, **options), opt


def state_bytes(name: str, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype,
                settings: Settings, *, on_gpu: bool = False) -> int:
    """Bytes of optimizer state the rule running `name` keeps for parameters of `shapes`
    (of `dtype`, in host memory): its record layout, master weights included (low-precision
    models, and crash-consistent runs, which commit the weights with the state; `on_gpu`:
    a GPU model's host or NVMe records, which keep one as its weights are on the device).

    Whole-parameter rules lay a record out from one step of the optimizer: that step runs
    on two small stand-ins of each shape's rank (PROXIES), and each state tensor's
    dimensions map back to the parameter's, so nothing of the real size is made."""
    rule, opt = _probe_rule(name, dtype, settings)
    c = choice(name)
    group = opt.param_groups[0]
    for p in group["params"]:
        if opt.state.get(p):  # state the class makes before a step: what entry would take
            rule.from_torch_state(p, group, opt.state[p])
    keep_master = settings.swap.durability == "crash_consistent" or on_gpu
    total = 0
    for shape in shapes:
        if c.matrices_only and len(shape) != 2:
            continue
        numel = math.prod(shape)
        if rule.elementwise:
            p = torch.zeros(1, dtype=dtype)
            kinds = rule.kinds(p, group, keep_master=keep_master)
            # only the Adam rule keeps its moments in another dtype than fp32
            moments = MOMENT_DTYPES[settings.optimizer.state_dtype if isinstance(rule, AdamRule)
                                   else "fp32"]
            total += math.ceil(numel * sum(
                4 / QUANT_BLOCK if k in SCALE_KINDS else kind_dtype(k, moments).itemsize
                for k in kinds))
            continue
        total += _whole_bytes(rule, group, shape, dtype, keep_master)
    return total


def _whole_bytes(rule: Any, group: dict, shape: tuple[int, ...], dtype: torch.dtype,
                 keep_master: bool) -> int:
    rank = len(shape)
    if rank > len(PROXIES_MANY[0]):
        raise TierMemError(f"a parameter of shape {shape}: more dimensions than the plan "
                           "probes")
    p1, p2 = (tuple(p[:rank]) for p in (PROXIES if rank <= 4 else PROXIES_MANY))
    lay1, lay2 = (rule.whole_layout(torch.zeros(p, dtype=dtype), group,
                                    keep_master=keep_master) for p in (p1, p2))
    name = type(rule.opt).__name__
    if lay1.kinds != lay2.kinds or lay1.dtypes != lay2.dtypes:
        raise TierMemError(f"{name} keeps other state for parameters of shapes {p1} and {p2}: "
                           f"the plan cannot scale it to {shape}")
    numel, n1, n2 = math.prod(shape), math.prod(p1), math.prod(p2)
    total = 0
    for k in lay1.kinds:
        s1, s2 = lay1.shapes.get(k, p1), lay2.shapes.get(k, p2)
        if len(s1) != len(s2):
            raise TierMemError(f"{name}'s state {k!r} has shapes {s1} and {s2} for parameters "
                               f"of shapes {p1} and {p2}: the plan cannot scale it to {shape}")
        n = 1
        for a, b in zip(s1, s2):
            if a == b:
                n *= a  # the same for any shape
            elif (a, b) in zip(p1, p2):
                n *= shape[list(zip(p1, p2)).index((a, b))]
            elif len(s1) == 1 and n1 % a == 0 and n2 % b == 0 and n1 // a == n2 // b:
                n *= -(-numel // (n1 // a))  # one value per block of n1 // a elements
            else:
                raise TierMemError(
                    f"{name}'s state {k!r} has shapes {s1} and {s2} for parameters of "
                    f"shapes {p1} and {p2}: the plan cannot scale it to {shape}")
        total += n * lay1.dtypes[k].itemsize
    return total


# -- the plain optimizer's recomputation of one partition (stress --verify) ---------------


def plain_reference(off: Any, part: Partition, rec: dict[str, torch.Tensor],
                    weights: list[tuple[Any, torch.Tensor]], *,
                    steps: dict[int, torch.Tensor] | None = None,
                    scalars: dict[int, dict[str, Any]] | None = None,
                    grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                    values: tuple[dict[str, Any], dict] | None = None) -> None:
    """Step copies of `part`'s parameters (or their masters), gradients and state (`rec`,
    taken from the record before the step) with the plain optimizer, in memory; write the
    result into `rec` and `weights` (per segment, a copy of the model's weights), which
    then hold what the tiered step must produce. steps / scalars: each parameter's step
    count and scalars as they were when `rec` was taken (default: the optimizer's now,
    which is the same unless updates ran since: pipeline.overlap_backward). grad_of: a
    parameter's gradient for the step (default its .grad; with parameters.offload the
    parameter tier holds it). values: the group's values and the optimizer's own values
    (rules.own_values) as they were then, likewise (default: now).

    Each segment is stepped as the update rule sees it: a flat slice of its parameter for
    an elementwise rule (parameters are cut at multiples of 1024 elements, so torch's
    kernels take the same vector body and tail), the whole parameter otherwise, its state
    in torch's format (lists, dicts and tensor subclasses rebuilt around the record's
    tensors, in the memory order the record keeps them in) and back."""
    rule, opt = off.rule, off.opt
    real_group = opt.param_groups[part.group]
    group = ({k: v for k, v in real_group.items() if k != "params"} if values is None
             else dict(values[0]))
    if off.settings.optimizer.kernel == "fused" and getattr(rule, "has_fused", False):
        group.update(fused=True, foreach=False)  # what the rule then runs
    master = "master" in rec
    params, entries = [], []
    for i, s in enumerate(part.segments):
        full = s.param.grad if grad_of is None else grad_of(s.param)
        if full is None:
            continue
        # (with parameters.offload p is empty between uses: its shape is the tier's)
        whole = s.param if off.weights is None else off.weights.stand_in(s.param)
        shape = (s.length,) if rule.elementwise else tuple(whole.shape)
        sl = {k: part.slices(k)[i] for k in rec}
        cur = weights[i][1]
        p = (rec["master"][sl["master"]] if master else cur).clone().view(shape)
        g = flat_like(full, whole)[s.start: s.start + s.length]  # in memory order
        p.grad = g.to(p.dtype).clone().view(shape)
        params.append(p)
        entries.append((i, s, p, sl))
    if not params:
        return
    ref = shadow_optimizer(opt, group, params, None if values is None else values[1])
    for i, s, p, sl in entries:
        step = off.steps[s.index] if steps is None else steps[s.index]
        if float(step) == 0:
            continue  # its first step: the optimizer builds its state, as plain torch does
        st: dict[str, Any] = {}
        if rule.has_step:
            st["step"] = step.clone()
        st.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in (off.latest_scalars(s.index) if scalars is None
                                else scalars[s.index]).items()})
        for k in rec:
            if k != "master":
                st[rule.torch_keys[k]] = rec[k][sl[k]].clone().view(
                    s.shapes.get(k, p.shape) if not rule.elementwise else (-1,))
        ref.state[p] = st if rule.elementwise else rule.to_torch_state(p, real_group, st)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        type(ref).step(ref)
    for i, s, p, sl in entries:
        st = ref.state[p]
        if not rule.elementwise:
            st = rule.from_torch_state(p, real_group, st)
        for k in rec:
            if k == "master":
                rec[k][sl[k]].copy_(p.reshape(-1))
            else:
                rec[k][sl[k]].copy_(st[rule.torch_keys[k]].reshape(-1))
        weights[i][1].copy_(p.reshape(-1))


def verifies_with_plain(rule: UpdateRule) -> bool:
    """Adam's own check runs tiermem's kernels (native included); every other rule is
    checked against its plain optimizer."""
    return not isinstance(rule, AdamRule)
