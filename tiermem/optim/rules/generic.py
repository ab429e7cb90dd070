"""Any torch.optim.Optimizer whose state is per-parameter tensors: its own step(), run over
one partition of whole parameters at a time.

A shadow of the optimizer (the same class and attributes, the partition's parameters
as its only group, its `state` pointing at views of the record) steps; whatever state
the step replaced instead of updating in place is copied back into the record. The
record layout comes from a probe: one step on a zero parameter of the same shape and
dtype shows which state tensors (any shape: Adafactor's factored row/column
statistics) and which scalars (step counts, numbers, 0-d tensors: kept on the host
and in the manifest) a parameter gets.

Stepping one partition at a time is right only if the step treats each parameter on
its own. `check` runs a probe to see it: a few small parameters stepped together in
one group and each alone must end equal (parameters, state and group values), else
the optimizer is refused as coupling its parameters. Group values a step changes
(a step counter kept in the group) are checked to come out the same from every
partition and set once, and so are the simple values the optimizer keeps on itself
(Ranger21's `lookahead_step`): without that, a counter's change would be lost with
its shadow, and a list appended in place would grow once per partition. The probe
cannot see every coupling (one that shows only after many steps, or only on the model's
real shapes); docs/guide/optimizers.md says so.
"""

from __future__ import annotations

import copy
import types
from collections import defaultdict
from typing import Any, ClassVar

import torch
from torch import Tensor

from tiermem.errors import TierMemError
from tiermem.optim.rules.base import (Batch, UnsupportedOptimizer, UpdateRule,
                                      check_group_tensors)
from tiermem.partition import Partition, WholeLayout

MASTER_KEY = "master_param"
PROBE_STEPS = 3
# the probe's parameter shapes by number of dimensions: small, odd, distinct
PROBE_SHAPES = {0: [(), ()], 1: [(37,), (11,)], 2: [(13, 7), (5, 9)],
                3: [(4, 5, 3), (3, 2, 6)], 4: [(3, 4, 2, 2), (2, 3, 2, 3)]}
# Methods besides step() that read or move the per-parameter state (schedule-free's
# train()/eval() set the weights from it): run partition by partition on shadows, as the
# step is (OffloadedOptimizer.call_state_method).
STATE_METHODS = ("train", "eval")
REFUSED = {
    "torch.optim.lbfgs.LBFGS": "LBFGS re-evaluates the closure several times per step and "
    "keeps one flat history over all parameters; tiermem cannot split it into partitions",
    "torch.optim.sparse_adam.SparseAdam": "SparseAdam updates sparse gradients; tiermem "
    "steps dense gradients only (use Adam or AdamW)",
}


def is_record_tensor(value: Any) -> bool:
    """State kept in the record: tensors with at least one dimension."""
    return isinstance(value, Tensor) and value.dim() > 0


def _subclass_refusal(opt: torch.optim.Optimizer, key: str, value: Tensor) -> str | None:
    """Why state `key` cannot go into a record, if it is a tensor subclass (torchao's
    low-bit optimizers keep OptimState8bit, OptimState4bit, OptimStateFp8: codes and block
    scales behind a float32 face). A record holds plain tensors: storing the subclass's
    dequantised values and handing them back would step on exact moments where the plain
    run steps on quantised ones, different results with no error."""
    cls = type(value)
    if cls in (Tensor, torch.nn.Parameter):
        return None
    return (f"its state {key!r} is a {_name(cls)}, a tensor subclass: tiermem's records "
            "hold plain tensors, and storing its dequantised values would change the "
            "optimizer's arithmetic (for 8-bit Adam state, run torch.optim.AdamW with "
            "optimizer.state_dtype: int8)")


_MISSING = object()  # an attribute the optimizer did not have


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN: the same value kept, not a change
    return a == b


def _close(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=1e-6,
                                                      atol=1e-9, equal_nan=True))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# The attributes a shadow gets of its own rather than from the optimizer.
SHADOW_OWN = frozenset({"param_groups", "state", "_optimizer_step_pre_hooks",
                        "_optimizer_step_post_hooks"})
SIMPLE_TENSOR = 1 << 16  # elements: a tensor attribute up to this size is a value, copied


def _simple(value: Any, depth: int = 0) -> bool:
    """A value an optimizer may keep on itself and a step may change (a step count, the
    current lr, a short history): numbers, strings, small tensors, and containers of
    them. Shadows get copies of these; anything else (a model, a callable) is shared."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    if isinstance(value, Tensor):
        return value.numel() <= SIMPLE_TENSOR and type(value) is Tensor
    if depth >= 4 or not isinstance(value, (list, tuple, dict, set, frozenset)):
        return False
    if len(value) > 4096:
        return False
    items = (list(value.keys()) + list(value.values())) if isinstance(value, dict) else value
    return all(_simple(v, depth + 1) for v in items)


def _loose_state(opt: torch.optim.Optimizer, params: list[Tensor]) -> list[Any]:
    """The keys of `opt.state` that are none of `params` (a global step count some
    optimizers keep in `state`, under a string)."""
    return [k for k in opt.state if not any(k is q for q in params)]


def own_values(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of the simple values `opt` keeps as attributes (not its groups, state or
    hooks): what a step may change besides them (Ranger21's `lookahead_step`)."""
    return {k: _copy(v) for k, v in opt.__dict__.items()
            if k not in SHADOW_OWN and not k.startswith("_tiermem") and _simple(v)}


def shadow_optimizer(opt: torch.optim.Optimizer, group: dict[str, Any],
                     params: list[Tensor]) -> torch.optim.Optimizer:
    """An optimizer of `opt`'s class and attributes stepping only `params` in one group,
    with empty state and none of the user's hooks (tiermem's own bound methods left out,
    so its step is the class's own). Its simple attribute values are copies: a step that
    changes one in place changes the shadow's, never the optimizer's."""
    sh = type(opt).__new__(type(opt))
    sh.__dict__.update({k: _copy(v) if _simple(v) else v for k, v in opt.__dict__.items()
                        if not (isinstance(v, types.MethodType) and v.__self__ is opt)
                        and not k.startswith("_tiermem")})
    sh.param_groups = [{**group, "params": params}]
    sh.state = defaultdict(dict)
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        setattr(sh, hooks, type(getattr(opt, hooks, {}))())
    return sh

class ShadowRule(UpdateRule):
    """A torch.optim.Optimizer subclass stepped by its own step() on whole parameters."""

    optimizers: ClassVar[tuple[type, ...]] = (torch.optim.Optimizer,)
    elementwise = False
    has_step = False  # the optimizer's own count, if it keeps one, is one of its scalars
    #: the class is known to treat each parameter on its own: no coupling probe
    per_parameter: ClassVar[bool] = False

    def __init__(self, *, state_dtype: str = "fp32", state_rounding: str = "nearest") -> None:
        if state_dtype != "fp32":
            raise UnsupportedOptimizer(
                f"optimizer.state_dtype {state_dtype} runs tiermem's native Adam kernel; "
                "other optimizers keep their state in the dtype they create it in: use "
                "state_dtype fp32")
        self.opt: torch.optim.Optimizer | None = None
        self._layouts: dict[tuple, WholeLayout] = {}
        self._kinds: set[str] = set()
        self._before: list[dict[str, Any]] = []  # each group's values as the step began
        self._after: dict[int, dict[str, Any]] = {}  # ... as its first partition left them
        self._own_before: dict[str, Any] | None = None  # the optimizer's own values, ditto
        self._own_after: dict[str, Any] | None = None
        self._step_changes: list[str] = []  # what the coupling probe's steps changed

    @property
    def torch_keys(self) -> dict[str, str]:  # type: ignore[override]
        return {"master": MASTER_KEY, **{k: k for k in self._kinds}}

    # -- checks ------------------------------------------------------------------

    def check(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        name = _name(type(opt))
        for cls in type(opt).__mro__:
            why = REFUSED.get(_name(cls))
            if why:
                raise UnsupportedOptimizer(f"tiermem.offload cannot run {name}: {why}")
        for g, group in enumerate(opt.param_groups):
            check_group_tensors(g, group)
            if not self.per_parameter and group["params"]:
                self._probe_coupling(g, group)

    def _shadow(self, group: dict[str, Any], params: list[Tensor]) -> torch.optim.Optimizer:
        return shadow_optimizer(self.opt, group, params)

    def _train_mode(self, sh: torch.optim.Optimizer) -> None:
        """A probe's shadow steps in training mode (schedule-free's step() refuses to run
        outside it, and the user may call train() only once the offload block began)."""
        if "train" in self.state_methods():
            with torch.no_grad():
                type(sh).train(sh)

    def _run(self, sh: torch.optim.Optimizer, what: str) -> None:
        try:
            with torch.no_grad():
                type(sh).step(sh)
        except Exception as exc:
            raise UnsupportedOptimizer(
                f"tiermem.offload cannot run {_name(type(sh))}: its step() failed on {what} "
                f"({type(exc).__name__}: {exc}). tiermem steps a copy of the optimizer "
                "holding one partition's parameters and their state (none before their "
                "first step), without a closure: an optimizer that needs a closure, or that "
                "makes its state in __init__, cannot run this way") from exc

    def _refuse_draws(self, before: Tensor) -> None:
        """A step that advanced the global RNG drew random numbers (Gravity's random initial
        state): tiermem steps the parameters partition by partition in its own order, so
        the draws would land on other parameters than in the plain run."""
        if not torch.equal(before, torch.get_rng_state()):
            raise UnsupportedOptimizer(
                f"tiermem.offload cannot run {_name(type(self.opt))}: its step draws random "
                "numbers from torch's global generator, and tiermem steps the parameters "
                "partition by partition in its own order, so each parameter would get other "
                "draws than in the plain run")

    def _probe_coupling(self, g: int, group: dict[str, Any]) -> None:
        dims = sorted({p.dim() for p in group["params"]})[:3]
        dtype = group["params"][0].dtype
        shapes = [s for d in dims for s in PROBE_SHAPES.get(d, [(2,) * d, (3,) * d])]
        gen = torch.Generator().manual_seed(0)
        init = [torch.randn(s, generator=gen, dtype=torch.float32).to(dtype) for s in shapes]
        # Scales far apart: a step that normalises over several parameters shows it.
        grads = [[torch.randn(s, generator=gen).to(dtype) * 10.0 ** (i % 3 - 1)
                  for i, s in enumerate(shapes)] for _ in range(PROBE_STEPS)]
        settings = {k: _copy(v) for k, v in group.items() if k != "params"}

        first: list[tuple[dict, dict]] = []  # the group and own values after step 1

        def run(indices: list[list[int]], note_first: bool = False):
            params = [t.clone() for t in init]
            shadows = [self._shadow({k: _copy(v) for k, v in settings.items()},
                                    [params[i] for i in idx]) for idx in indices]
            with torch.random.fork_rng(devices=[]):
                for sh in shadows:
                    self._train_mode(sh)
                rng = torch.get_rng_state()
                for step in range(PROBE_STEPS):
                    for i, p in enumerate(params):
                        p.grad = grads[step][i].clone()
                    for sh in shadows:
                        self._run(sh, "a probe")
                    if step == 0 and note_first:
                        first.append(({k: _copy(v) for k, v in shadows[0].param_groups[0]
                                       .items() if k != "params"}, own_values(shadows[0])))
                self._refuse_draws(rng)
            return params, shadows

        together, (whole,) = run([list(range(len(shapes)))], note_first=True)
        # What the steps after the first change outside the per-parameter state (a counter;
        # not a flag set once by the first step, which a fresh optimizer sets again).
        group_1, own_1 = first[0]
        own_whole = own_values(whole)
        changed = [f"param_groups[{g}][{k!r}]" for k, v in whole.param_groups[0].items()
                   if k != "params" and not _same(v, group_1.get(k, _MISSING))]
        changed += [f".{k}" for k, v in own_whole.items()
                    if not _same(v, own_1.get(k, _MISSING))]
        self._step_changes.extend(c for c in changed if c not in self._step_changes)
        apart, shadows = run([[i] for i in range(len(shapes))])
        why = None
        for i, (a, b) in enumerate(zip(together, apart)):
            if not _close(a, b):
                why = f"probe parameter {i} of shape {tuple(a.shape)} ends differently"
                break
            sa, sb = whole.state[a], shadows[i].state[b]
            for k in sa:
                if is_record_tensor(sa[k]) and not (k in sb and _close(sa[k], sb[k])):
                    why = f"state {k!r} of probe parameter {i} ends differently"
        kept = {k: v for k, v in whole.param_groups[0].items() if k != "params"}
        for sh in shadows:
            if not _same(kept, {k: v for k, v in sh.param_groups[0].items() if k != "params"}):
                why = why or "the group's own values end differently"
            if not _same(own_whole, own_values(sh)):
                why = why or "the values it keeps on itself end differently"
        if why:
            raise UnsupportedOptimizer(
                f"param_groups[{g}]: {_name(type(self.opt))} couples its parameters: stepping "
                f"them one partition at a time does not give what stepping them together "
                f"does ({why} on tiermem's probe), so tiermem cannot run it")

    # -- layout ------------------------------------------------------------------

    def whole_layout(self, param: Tensor, group: dict[str, Any], *, keep_master: bool
                     ) -> WholeLayout:
        master = keep_master or not (param.dtype == torch.float32
                                     and param.device.type == "cpu")
        dtype = torch.float32 if master else param.dtype
        g = next(i for i, gr in enumerate(self.opt.param_groups) if gr is group) \
            if any(gr is group for gr in self.opt.param_groups) else -1
        key = (tuple(param.shape), dtype, g, master)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._probe_layout(param, group, dtype, master)
            self._layouts[key] = lay
        return lay

    def _probe_layout(self, param: Tensor, group: dict[str, Any], dtype: torch.dtype,
                      master: bool) -> WholeLayout:
        """What one step makes of a zero parameter of this shape: the record's kinds."""
        p = torch.zeros(param.shape, dtype=dtype)
        p.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(1)
                             ).to(dtype)
        sh = self._shadow({k: _copy(v) for k, v in group.items() if k != "params"}, [p])
        with torch.random.fork_rng(devices=[]):
            self._train_mode(sh)
            rng = torch.get_rng_state()
            self._run(sh, f"a parameter of shape {tuple(param.shape)}")
            self._refuse_draws(rng)
        loose = _loose_state(sh, [p])
        if loose:
            raise UnsupportedOptimizer(
                f"tiermem.offload cannot run {_name(type(self.opt))}: it keeps state under "
                f"{loose[0]!r}, not under a parameter; tiermem keeps per-parameter state, and "
                "each partition's step would start that entry over")
        kinds, shapes, dtypes = ["master"] if master else [], {}, {}
        if master:
            dtypes["master"] = torch.float32
        for k, v in sh.state[p].items():
            why = _subclass_refusal(self.opt, k, v) if isinstance(v, Tensor) else None
            if why:
                raise UnsupportedOptimizer(
                    f"tiermem.offload cannot run {_name(type(self.opt))}: {why}")
            if is_record_tensor(v):
                if k == "master":
                    raise UnsupportedOptimizer(f"{_name(type(self.opt))} keeps state named "
                                               "'master', the name tiermem's master weight has")
                kinds.append(k)
                dtypes[k] = v.dtype
                if v.shape != param.shape:
                    shapes[k] = tuple(v.shape)
            elif not isinstance(v, (Tensor, int, float, bool)) and v is not None:
                raise UnsupportedOptimizer(
                    f"{_name(type(self.opt))} keeps state {k!r} as a {type(v).__name__}; "
                    "tiermem keeps per-parameter tensors and numbers only")
        self._kinds.update(k for k in kinds if k != "master")
        return WholeLayout(tuple(kinds), shapes, dtypes)

    def kinds(self, param, group, *, keep_master):
        return self.whole_layout(param, group, keep_master=keep_master).kinds

    def check_group(self, part: Partition, group: dict[str, Any]) -> None:
        pass  # the layout follows the optimizer's own state; update() checks what it finds

    def check_loaded(self, part: Partition, saved: dict[str, Any]) -> None:
        pass  # a checkpoint's tensors must match the layout: scatter's copy_ checks shapes

    def torch_state_tensors(self, param, group, dtype):
        seg_kinds = self.whole_layout(param, group, keep_master=False)
        return [(k, seg_kinds.shapes.get(k, tuple(param.shape)), seg_kinds.dtypes[k])
                for k in seg_kinds.kinds if k != "master"]

    def host_scalars(self, state: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
        return {k: _copy(v) for k, v in state.items() if not is_record_tensor(v)}

    # -- the step ----------------------------------------------------------------

    def begin_step(self, groups) -> None:
        self._before = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in groups]
        self._after = {}
        # The values the optimizer keeps on itself as the step began: every partition's
        # shadow starts from them, the first one's result is set back on the optimizer,
        # and every other partition must end with the same (as for group values).
        self._own_before = own_values(self.opt)
        self._own_after = None

    def undo_step_values(self) -> None:
        for g, before in enumerate(self._before):
            if g < len(self.opt.param_groups):
                self.opt.param_groups[g].update({k: _copy(v) for k, v in before.items()})
        for k, v in (self._own_before or {}).items():
            setattr(self.opt, k, _copy(v))

    def step_changed_values(self) -> list[str]:
        return list(self._step_changes)

    def state_methods(self) -> tuple[str, ...]:
        return tuple(m for m in STATE_METHODS if callable(getattr(type(self.opt), m, None)))

    def run_method(self, name: str, batch: Batch) -> None:
        """The optimizer's own `name`() on one partition's shadow, as update() steps it
        (batch.grads empty; a parameter never stepped has no state)."""
        def call(sh: torch.optim.Optimizer) -> None:
            with torch.no_grad():
                getattr(type(sh), name)(sh)
        self._on_shadow(batch, call)

    def update(self, batch: Batch, *, kernel: str) -> None:
        self._on_shadow(batch, lambda sh: self._run(sh, f"partition {batch.part.id}"))

    def _on_shadow(self, batch: Batch, call: Any) -> None:
        part, group = batch.part, batch.group
        tensors, views = [], []
        for j, s in enumerate(batch.segments):
            t = batch.params[j].view(s.param.shape)
            if batch.grads:
                t.grad = batch.grads[j].view(s.param.shape)
            tensors.append(t)
            views.append({k: batch.state[k][j].view(s.shapes.get(k, s.param.shape))
                          for k in batch.state})
        before = (self._before[part.group] if part.group < len(self._before)
                  else {k: v for k, v in group.items() if k != "params"})
        sh = self._shadow({k: _copy(v) for k, v in before.items()}, tensors)
        if self._own_before is not None:  # not what an earlier partition of this step set
            sh.__dict__.update({k: _copy(v) for k, v in self._own_before.items()})
        for j, t in enumerate(tensors):
            if not batch.first[j]:
                sh.state[t] = {**batch.scalars[j], **views[j]}
        call(sh)
        for j, t in enumerate(tensors):
            t.grad = None
            new = sh.state.get(t, {})
            if not new and batch.first[j] and not batch.grads:
                continue  # never stepped, and the method made no state: nothing to keep
            for k, view in views[j].items():
                v = new.get(k)
                if not isinstance(v, Tensor) or v.shape != view.shape:
                    raise TierMemError(
                        f"{_name(type(self.opt))}: after step {float(batch.steps[j]):g} "
                        f"the state {k!r} of a parameter of shape "
                        f"{tuple(batch.segments[j].param.shape)} is "
                        f"{tuple(v.shape) if isinstance(v, Tensor) else v!r}, not the "
                        f"{tuple(view.shape)} tensor tiermem laid out from its first step")
                why = _subclass_refusal(self.opt, k, v)
                if why:  # the layout's probe saw a plain tensor; this step made another
                    raise TierMemError(f"{_name(type(self.opt))}: after step "
                                       f"{float(batch.steps[j]):g}, {why}")
                if v.data_ptr() != view.data_ptr():
                    view.copy_(v)  # replaced rather than updated in place
            extra = [k for k, v in new.items() if is_record_tensor(v) and k not in views[j]]
            if extra:
                raise TierMemError(
                    f"{_name(type(self.opt))} created state {extra} after a parameter's "
                    "first step; tiermem lays the record out from the first step's state")
            batch.scalars[j].clear()
            batch.scalars[j].update({k: v for k, v in new.items() if not is_record_tensor(v)})
        self._carry_own_values(sh)
        after = {k: v for k, v in sh.param_groups[0].items() if k != "params"}
        if part.group not in self._after:
            self._after[part.group] = after
            for k, v in after.items():
                if not _same(v, before.get(k)):
                    group[k] = v
        elif not _same(after, self._after[part.group]):
            raise TierMemError(
                f"param_groups[{part.group}]: {_name(type(self.opt))} changed the group's "
                "values differently for two partitions of one step: its step couples the "
                "parameters of a group, so tiermem cannot run it")

    def _carry_own_values(self, sh: torch.optim.Optimizer) -> None:
        """Set what the first partition's step changed of the values the optimizer keeps on
        itself back on it; refuse a later partition that ends with other values."""
        own = own_values(sh)
        if self._own_after is None:
            self._own_after = own
            for k, v in own.items():
                if not _same(v, (self._own_before or {}).get(k, _MISSING)):
                    setattr(self.opt, k, _copy(v))
        elif not _same(own, self._own_after):
            changed = sorted(k for k in own.keys() | self._own_after.keys()
                             if not _same(own.get(k, _MISSING), self._own_after.get(k, _MISSING)))
            raise TierMemError(
                f"{_name(type(self.opt))} changed the values it keeps on itself ({changed}) "
                "differently for two partitions of one step: its step couples the "
                "parameters, so tiermem cannot run it")


class AdafactorRule(ShadowRule):
    """torch.optim.Adafactor: factored row/column statistics span a parameter."""

    optimizers = (torch.optim.Adafactor,)
    per_parameter = True


class MuonRule(ShadowRule):
    """torch.optim.Muon: the orthogonalisation spans a parameter."""

    optimizers = (torch.optim.Muon,)
    per_parameter = True
