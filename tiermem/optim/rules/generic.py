"""Any torch.optim.Optimizer whose state is per-parameter tensors: its own step(), run over
one partition of whole parameters at a time.

A shadow of the optimizer (the same class and attributes, the partition's parameters
as its only group, its `state` pointing at views of the record) steps; whatever state
the step replaced instead of updating in place is copied back into the record. The
record layout comes from a probe: one step on a zero parameter of the same shape and
dtype shows which state tensors (any shape: Adafactor's factored row/column
statistics; lists, tuples and dicts of them, and tensor subclasses made of plain ones,
as several: nested.py) and which scalars (step counts, numbers, 0-d tensors: kept on the
host and in the manifest) a parameter gets.

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

import contextlib
import copy
import random
import types
from collections import defaultdict
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from torch import Tensor

from tiermem.errors import TierMemError
from tiermem.optim.rules.base import (Batch, UnsupportedOptimizer, UpdateRule,
                                      check_group_tensors)
from tiermem.optim.rules.nested import (NotNested, Template, dim_order, flatten,
                                        is_record_tensor, json_exact, leaf_names, leaves_of,
                                        nests, rebuild, state_tensors, structure,
                                        value_digest)
from tiermem.partition import ORDER_KEY, Partition, WholeLayout, laid
from tiermem.swap.manifest import Unkept, kind_name_ok

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


def _subclass_refusal(opt: torch.optim.Optimizer, key: str, value: Tensor) -> str | None:
    """Why state `key` cannot go into a record, if it is a tensor subclass that does not
    say which plain tensors it is made of (one that does, as torchao's low-bit state,
    goes into the record as those: made_of_tensors). A record holds plain tensors:
    storing such a subclass's plain values and handing them back would step on other
    numbers than the plain run does (a subclass that rounds every op, a quantised face),
    different results with no error."""
    cls = type(value)
    if cls in (Tensor, torch.nn.Parameter):
        return None
    return (f"its state {key!r} is a {_name(cls)}, a tensor subclass that does not say which "
            "plain tensors it is made of (__tensor_flatten__ / __tensor_unflatten__): "
            "tiermem's records hold plain tensors, and storing its plain values would "
            "change the optimizer's arithmetic")


_MISSING = object()  # an attribute the optimizer did not have


@contextlib.contextmanager
def _rngs_forked() -> Any:
    """Run a probe's steps on copies of torch's, numpy's and Python's global generators:
    whatever the steps draw, the user's sequences go on as if they had not run."""
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def _rng_states() -> tuple[Tensor, Any, Any]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _drew(before: tuple[Tensor, Any, Any]) -> str | None:
    """Which global generator advanced since `before` (_rng_states()), if one did."""
    now = _rng_states()
    if not torch.equal(before[0], now[0]):
        return "torch's global generator"
    if not (before[1][0] == now[1][0] and np.array_equal(before[1][1], now[1][1])
            and before[1][2:] == now[1][2:]):
        return "numpy's global generator (np.random)"
    if before[2] != now[2]:
        return "Python's global generator (random)"
    return None


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


# Where a value the step may change outside the per-parameter state lives: an attribute of
# the optimizer (Ranger21's `lookahead_step`), or an entry of `opt.state` under a key that
# is no parameter (MADGRAD's state['k']). Own values are keyed by (where, name).
ATTR, STATE = "attr", "state"


def own_keys(opt: torch.optim.Optimizer) -> set[tuple[str, Any]]:
    """The simple values `opt` keeps as attributes (not its groups, state or hooks) and the
    entries of its state under keys that are no parameter: what a step may change besides
    the per-parameter state and the groups."""
    keys = {(ATTR, k) for k, v in opt.__dict__.items()
            if k not in SHADOW_OWN and not k.startswith("_tiermem") and _simple(v)}
    return keys | {(STATE, k) for k in opt.state if not isinstance(k, Tensor)}


# A value outside the per-parameter state is named by (where, key): where is a group's
# index, ATTR or STATE. The three functions below are the one way to read, set (or, with
# _MISSING, remove) and name one.


def _home(opt: torch.optim.Optimizer, where: int | str) -> dict:
    if isinstance(where, int):
        return opt.param_groups[where] if where < len(opt.param_groups) else {}
    return opt.__dict__ if where == ATTR else opt.state


def value_get(opt: torch.optim.Optimizer, key: tuple[int | str, Any]) -> Any:
    where, k = key
    # .get: reading a defaultdict must not make the entry
    return _home(opt, where).get(k, _MISSING)


def value_put(opt: torch.optim.Optimizer, key: tuple[int | str, Any], value: Any) -> None:
    where, k = key
    if value is _MISSING:
        _home(opt, where).pop(k, None)
    else:
        _home(opt, where)[k] = value


def value_name(key: tuple[int | str, Any]) -> str:
    where, k = key
    if isinstance(where, int):
        return f"param_groups[{where}][{k!r}]"
    return f".{k}" if where == ATTR else f".state[{k!r}]"


def own_values(opt: torch.optim.Optimizer) -> dict[tuple[str, Any], Any]:
    """Copies of the values own_keys() names, in a fixed order (a manifest lists them)."""
    return {key: _copy(value_get(opt, key))
            for key in sorted(own_keys(opt), key=lambda key: (key[0], str(key[1])))}


def _loose_refusal(opt: torch.optim.Optimizer) -> str | None:
    """Why an entry of `opt.state` under a key that is no parameter cannot be carried from
    step to step as a value (every partition's shadow starts from a copy of it, and the
    first one's result is kept), if one cannot."""
    for k, v in opt.state.items():
        if isinstance(k, Tensor):
            continue
        if not isinstance(k, str):
            return (f"it keeps state under {k!r}, which is neither a parameter nor a string "
                    "(torch's state_dict() numbers the parameters' entries)")
        if not _simple(v):
            return (f"it keeps state under {k!r}, not under a parameter, as a "
                    f"{type(v).__name__}; tiermem carries such an entry from step to step "
                    "only as numbers, strings, tensors of up to 65536 elements, and lists, "
                    "tuples and dicts of them")
    return None


def shadow_optimizer(opt: torch.optim.Optimizer, group: dict[str, Any],
                     params: list[Tensor], own: dict[tuple[str, Any], Any] | None = None
                     ) -> torch.optim.Optimizer:
    """An optimizer of `opt`'s class and attributes stepping only `params` in one group,
    with none of the user's hooks (tiermem's own bound methods left out, so its step is the
    class's own), and a state holding only copies of `opt`'s entries under keys that are
    no parameter. Its simple attribute values are copies: a step that changes one in place
    changes the shadow's, never the optimizer's. `own`: the values (own_values()) to copy
    instead of `opt`'s (as a step began; one `opt` has that is not among them was made
    since, and the shadow goes without it)."""
    sh = type(opt).__new__(type(opt))
    attrs = {}
    for k, v in opt.__dict__.items():
        if (isinstance(v, types.MethodType) and v.__self__ is opt) or k.startswith("_tiermem"):
            continue
        if k == "state":  # made below from `own`; opt.state is the tiers' stand-in here
            continue
        if own is not None and (ATTR, k) in own:
            attrs[k] = _copy(own[ATTR, k])
        elif _simple(v):
            if own is None:
                attrs[k] = _copy(v)
        else:
            attrs[k] = v
    if own is None:
        own = {(STATE, k): v for k, v in opt.state.items() if not isinstance(k, Tensor)}
    for where, k in own.keys():
        if where == ATTR and k not in attrs:
            attrs[k] = _copy(own[where, k])
    sh.__dict__.update(attrs)
    sh.param_groups = [{**group, "params": params}]
    sh.state = defaultdict(dict, {k: _copy(v) for (where, k), v in own.items()
                                  if where == STATE})
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        setattr(sh, hooks, type(getattr(opt, hooks, {}))())
    return sh


def shadow_of_groups(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]
                     ) -> torch.optim.Optimizer:
    """An optimizer of `opt`'s class and attributes over `groups` (each a dict with its own
    params), made as shadow_optimizer() makes one: what a rank of a process group steps of
    the user's optimizer (its own share of whole parameters, group by group). Its class's
    constructor is not called: tiermem cannot know what a third-party one takes."""
    sh = shadow_optimizer(opt, {}, [])
    sh.param_groups = [dict(g) for g in groups]
    return sh


def group_values(group: dict[str, Any]) -> dict[str, Any]:
    """Copies of a group's simple values (its settings and what a step keeps there: a
    count, schedule-free's `k`), the values two optimizers of one class can trade."""
    return {k: _copy(v) for k, v in group.items() if k != "params" and _simple(v)}


def own_attributes(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of the simple values `opt` keeps as attributes (own_keys()' ATTR ones), its
    state not read (inside a block, the user's is tiermem's stand-in)."""
    return {k: _copy(v) for k, v in opt.__dict__.items()
            if k not in SHADOW_OWN and not k.startswith("_tiermem") and _simple(v)}


def loose_state_keys(opt: torch.optim.Optimizer) -> list[Any]:
    """The keys of `opt.state` that are no parameter (MADGRAD's state['k'])."""
    return [k for k in opt.state if not isinstance(k, Tensor)]


class ShadowRule(UpdateRule):
    """A torch.optim.Optimizer subclass stepped by its own step() on whole parameters."""

    optimizers: ClassVar[tuple[type, ...]] = (torch.optim.Optimizer,)
    elementwise = False
    has_step = False  # the optimizer's own count, if it keeps one, is one of its scalars
    own_step = True
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
        self._stepped: set[int] = set()  # the groups a partition stepped (not end_step)
        # the optimizer's own values (own_values()), ditto
        self._own_before: dict[tuple[str, Any], Any] | None = None
        self._own_after: dict[tuple[str, Any], Any] | None = None
        # what the coupling probe's steps after the first changed outside the state: group
        # keys (group index, key) and the names of values kept on the optimizer
        self._changed_groups: list[tuple[int, str]] = []
        self._changed_own: list[tuple[str, Any]] = []
        # what the probe's first step set or made there: (group index, key), own_keys()
        self._set_once: set[tuple[int | str, Any]] = set()
        # this step's: hands each partition's shadow the loss of the user's closure
        self._closure: Callable[[], Any] | None = None
        self._closure_checked = False
        self._uses_loss: bool | None = None

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

    def _shadow(self, group: dict[str, Any], params: list[Tensor],
                own: dict[str, Any] | None = None) -> torch.optim.Optimizer:
        return shadow_optimizer(self.opt, group, params, own)

    def _train_mode(self, sh: torch.optim.Optimizer) -> None:
        """A probe's shadow steps in training mode (schedule-free's step() refuses to run
        outside it, and the user may call train() only once the offload block began)."""
        if "train" in self.state_methods():
            with torch.no_grad():
                type(sh).train(sh)

    def _run(self, sh: torch.optim.Optimizer, what: str,
             closure: Callable[[], Any] | None = None) -> None:
        try:
            with torch.no_grad():
                type(sh).step(sh) if closure is None else type(sh).step(sh, closure)
        except Exception as exc:
            raise UnsupportedOptimizer(
                f"tiermem.offload cannot run {_name(type(sh))}: its step() failed on {what} "
                f"({type(exc).__name__}: {exc}). tiermem steps a copy of the optimizer "
                "holding one partition's parameters and their state (none before their "
                "first step); its probes run without a closure: an optimizer that cannot "
                "step without one, or that makes its state in __init__, cannot run this "
                "way") from exc

    def check_closure(self) -> None:
        """tiermem evaluates a closure once, then steps the partitions' shadows, each with a
        closure handing back that loss (an optimizer may use it: EmoNavi scales its step by
        the loss's trend). The plain step calls its closure once too, before the update;
        one that calls it more often (to re-evaluate at moved weights) or never would step
        on other gradients than tiermem's. A probe counts the calls, once."""
        if self._closure_checked or self.per_parameter:
            return
        group = next((g for g in self.opt.param_groups if g["params"]), None)
        if group is None:
            return
        first = group["params"][0]
        shape = PROBE_SHAPES.get(first.dim(), [(2,) * first.dim()])[0]
        p = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(first.dtype)
        sh = self._shadow({k: _copy(v) for k, v in group.items() if k != "params"}, [p])
        calls = []

        def closure() -> Tensor:
            calls.append(1)
            return torch.tensor(1.0 / len(calls))
        after = []  # the group's and the optimizer's own values after each step
        with _rngs_forked():
            self._train_mode(sh)
            for step in range(PROBE_STEPS):
                p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(3 + step)
                                     ).to(first.dtype)
                self._run(sh, "a probe with a closure", closure)
                if len(calls) != step + 1:
                    raise UnsupportedOptimizer(
                        f"tiermem.offload cannot run {_name(type(self.opt))}.step(closure): "
                        f"its step called the closure {len(calls) - step} times on tiermem's "
                        "probe; tiermem evaluates a closure once, before stepping the "
                        "partitions, as a step that calls it once does. Call backward "
                        "yourself and step() without a closure")
                after.append(({k: _copy(v) for k, v in sh.param_groups[0].items()
                               if k != "params"}, own_values(sh)))
        # What the steps change with a loss to see (EmoNavi's loss averages in
        # state['ema']: the coupling probe, stepping without a closure, saw them set once
        # and kept): kept in the manifest from now on, as the probe's changed values are.
        self._note_changes(next(i for i, gr in enumerate(self.opt.param_groups)
                                if gr is group), after)
        self._closure_checked = True

    def uses_loss(self) -> bool:
        """Two shadows stepped on the same gradients, their closures returning different
        losses: a step that reads the loss (EmoNavi) ends them apart. Probed once."""
        if self._uses_loss is not None:
            return self._uses_loss
        group = next((g for g in self.opt.param_groups if g["params"]), None)
        if group is None or self.per_parameter:
            self._uses_loss = False
            return False
        first = group["params"][0]
        shape = PROBE_SHAPES.get(first.dim(), [(2,) * first.dim()])[0]
        ends = []
        for losses in ([1.0, 0.5, 0.25], [4.0, 9.0, 0.125]):
            p = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(first.dtype)
            sh = self._shadow({k: _copy(v) for k, v in group.items() if k != "params"}, [p])
            with _rngs_forked():
                self._train_mode(sh)
                for step, loss in enumerate(losses):
                    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(
                        3 + step)).to(first.dtype)
                    self._run(sh, "a probe with a closure",
                              lambda loss=loss: torch.tensor(loss))
            ends.append([p.detach().clone()] + [v for v in sh.state[p].values()
                                                if isinstance(v, Tensor)])
        self._uses_loss = len(ends[0]) != len(ends[1]) or not all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(*ends))
        return self._uses_loss

    def _note_changes(self, g: int, after: list[tuple[dict, dict]]) -> None:
        """Note the values outside the state that a probe's steps after its first changed
        (`after`: the group's values and own_values() after each step): a manifest keeps
        them, a resume sets them back."""
        (group_1, own_1), *later = after
        for group_n, own_n in later:
            self._changed_groups += [(g, k) for k, v in group_n.items()
                                     if not _same(v, group_1.get(k, _MISSING))
                                     and (g, k) not in self._changed_groups]
            self._changed_own += [key for key, v in own_n.items()
                                  if not _same(v, own_1.get(key, _MISSING))
                                  and key not in self._changed_own]

    def _refuse_draws(self, before: tuple[Tensor, Any, Any]) -> None:
        """A step that advanced a global generator drew random numbers (Gravity's random
        initial state from torch's, Kron's balancing from numpy's): tiermem steps the
        parameters partition by partition in its own order, and a draw made once a step
        is made once a partition, so the draws would land otherwise than in the plain run."""
        which = _drew(before)
        if which:
            raise UnsupportedOptimizer(
                f"tiermem.offload cannot run {_name(type(self.opt))}: its step draws random "
                f"numbers from {which}, and tiermem steps the parameters partition by "
                "partition in its own order, so each parameter would get other draws than "
                "in the plain run")

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

        # the group values, own values and state layout after each step (note_after)
        after: list[tuple[dict, dict, list]] = []

        def run(indices: list[list[int]], note_after: bool = False):
            params = [t.clone() for t in init]
            shadows = [self._shadow({k: _copy(v) for k, v in settings.items()},
                                    [params[i] for i in idx]) for idx in indices]
            def values() -> tuple[dict, dict]:
                return ({k: _copy(v) for k, v in shadows[0].param_groups[0].items()
                         if k != "params"}, own_values(shadows[0]))
            before_methods = values() if note_after else None
            with _rngs_forked():
                for sh in shadows:
                    self._train_mode(sh)
                if note_after:
                    # What train() changed (schedule-free's group train_mode) says which
                    # weights the records hold: a resume sets it back, so that the resumed
                    # run's own train() does not move them again.
                    self._note_changes(g, [before_methods, values()])
                    after.append((*values(), []))  # as the optimizer is before its first step
                rng = _rng_states()
                for step in range(PROBE_STEPS):
                    for i, p in enumerate(params):
                        p.grad = grads[step][i].clone()
                    for sh in shadows:
                        self._run(sh, "a probe")
                    self.writes_grads |= any(
                        p.grad is not None and not torch.equal(p.grad, grads[step][i])
                        for i, p in enumerate(params))
                    if note_after:
                        after.append(({k: _copy(v) for k, v in shadows[0].param_groups[0]
                                       .items() if k != "params"}, own_values(shadows[0]),
                                      [structure(shadows[0].state[p]) for p in params]))
                self._refuse_draws(rng)
            return params, shadows

        together, (whole,) = run([list(range(len(shapes)))], note_after=True)
        self._refuse_loose(whole)
        # What the steps after the first change outside the per-parameter state (a counter,
        # also one that comes back to its first value, as Ranger21's lookahead_step every
        # lookahead_merge_time steps; not a flag set once by the first step, which a fresh
        # optimizer sets again), and whether the state keeps its first step's layout.
        (group_0, own_0, _), (group_1, own_1, laid_out), *later = after
        own_whole = own_values(whole)
        for _, _, layout_n in later:
            for i, now in enumerate(layout_n):
                if now != laid_out[i]:
                    keys = sorted(k for k in now.keys() | laid_out[i].keys()
                                  if now.get(k) != laid_out[i].get(k))
                    raise UnsupportedOptimizer(
                        f"tiermem.offload cannot run {_name(type(self.opt))}: the state it "
                        f"keeps per parameter changes its layout after the first step ({keys} "
                        "on tiermem's probe), and a record is laid out from the first step's "
                        "state")
        self._note_changes(g, [(group_n, own_n) for group_n, own_n, _ in after[1:]])
        # Set by the first step (bitsandbytes' `initialized`, a count's first value): a
        # resumed optimizer's first step sets them again, so a manifest keeps them only if
        # a later step changes them too.
        self._set_once |= {(g, k) for k, v in group_1.items()
                           if not _same(v, group_0.get(k, _MISSING))}
        self._set_once |= {key for key, v in own_1.items()
                           if not _same(v, own_0.get(key, _MISSING))}
        apart, shadows = run([[i] for i in range(len(shapes))])
        why = None
        for i, (a, b) in enumerate(zip(together, apart)):
            if not _close(a, b):
                why = f"probe parameter {i} of shape {tuple(a.shape)} ends differently"
                break
            sa, sb = state_tensors(whole.state[a]), state_tensors(shadows[i].state[b])
            for k in sa:
                if not (k in sb and isinstance(sa[k], Tensor) and isinstance(sb[k], Tensor)
                        and _close(sa[k], sb[k])):
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

    def _refuse_loose(self, sh: torch.optim.Optimizer) -> None:
        why = _loose_refusal(sh)
        if why:
            raise UnsupportedOptimizer(f"tiermem.offload cannot run {_name(type(self.opt))}: "
                                       f"{why}")

    def _probe_layout(self, param: Tensor, group: dict[str, Any], dtype: torch.dtype,
                      master: bool) -> WholeLayout:
        """What one step makes of a zero parameter of this shape: the record's kinds."""
        p = torch.zeros(param.shape, dtype=dtype)
        p.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(1)
                             ).to(dtype)
        sh = self._shadow({k: _copy(v) for k, v in group.items() if k != "params"}, [p])
        with _rngs_forked():
            self._train_mode(sh)
            rng = _rng_states()
            self._run(sh, f"a parameter of shape {tuple(param.shape)}")
            self._refuse_draws(rng)
        self._refuse_loose(sh)
        kinds, shapes, dtypes = ["master"] if master else [], {}, {}
        nested: dict[str, Template] = {}
        if master:
            dtypes["master"] = torch.float32
        state = sh.state[p]
        for k, v in state.items():
            if nests(v):
                nested[k] = self._lay_out_container(k, v, state, kinds, shapes, dtypes)
                continue
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
            elif not isinstance(v, Tensor) and not json_exact(v):
                raise UnsupportedOptimizer(
                    f"{_name(type(self.opt))} keeps state {k!r} as a {type(v).__name__}; "
                    "tiermem keeps per-parameter tensors, lists and dicts of tensors, and "
                    "numbers (and lists of them) only")
        odd = [k for k in kinds if not kind_name_ok(k)]
        if odd:
            raise UnsupportedOptimizer(
                f"{_name(type(self.opt))} keeps state named {odd[0]!r}, which tiermem's "
                "manifests cannot name (up to 256 printable characters, the [key]s of an "
                "item inside lists and dicts included)")
        self._kinds.update(k for k in kinds if k != "master")
        return WholeLayout(tuple(kinds), shapes, dtypes, nested)

    def _lay_out_container(self, key: str, value: Any, state: dict[str, Any],
                           kinds: list[str], shapes: dict[str, tuple[int, ...]],
                           dtypes: dict[str, torch.dtype]) -> Template:
        """A list, tuple or dict of tensors in the state: a record kind per tensor."""
        name = _name(type(self.opt))
        try:
            template, leaves = flatten(value, key)
        except NotNested as exc:
            raise UnsupportedOptimizer(
                f"{name} keeps state {key!r} as a {type(value).__name__} holding tensors "
                f"and {exc}; tiermem keeps lists, tuples and dicts of tensors (each in the "
                "record) but nothing else beside them") from None
        for kind, t in leaves:
            why = _subclass_refusal(self.opt, kind, t)
            if why:
                raise UnsupportedOptimizer(f"tiermem.offload cannot run {name}: {why}")
            if kind in state or kind == "master":
                raise UnsupportedOptimizer(
                    f"{name} keeps state {kind!r} beside {key!r}, whose items tiermem would "
                    "name so: it cannot lay out both")
            kinds.append(kind)
            dtypes[kind] = t.dtype
            shapes[kind] = tuple(t.shape)
        return template

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

    def begin_step(self, groups, *, closure: Callable[[], Any] | None = None) -> None:
        self._closure = closure
        self._before = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in groups]
        self._after = {}
        self._stepped = set()
        # The values the optimizer keeps on itself as the step began: every partition's
        # shadow starts from them, the first one's result is set back on the optimizer,
        # and every other partition must end with the same (as for group values).
        self._own_before = own_values(self.opt)
        self._own_after = None

    def end_step(self, groups) -> None:
        # The plain step goes through every group, and some optimizers count steps in the
        # group whether or not any parameter has a gradient (pytorch-optimizer's Lamb and
        # Adan: group['step'] += 1). A group no partition of this step updated (none of its
        # parameters has a gradient, or it has none) steps as a shadow with no parameters:
        # its values move as the plain step would move them.
        for g, group in enumerate(groups):
            if g in self._after:
                continue
            before = self._before[g] if g < len(self._before) else {
                k: v for k, v in group.items() if k != "params"}
            sh = self._shadow({k: _copy(v) for k, v in before.items()}, [], self._own_before)
            self._run(sh, f"param_groups[{g}], none of whose parameters has a gradient",
                      self._closure)
            self._settle(g, group, before, sh)

    def undo_step_values(self) -> None:
        for g, before in enumerate(self._before):
            if g < len(self.opt.param_groups):
                group = self.opt.param_groups[g]
                for k in [k for k in group if k != "params" and k not in before]:
                    del group[k]  # made by the failed step (a count its first step sets up)
                group.update({k: _copy(v) for k, v in before.items()})
        if self._own_before is None:
            return
        for key in own_keys(self.opt) - self._own_before.keys():
            value_put(self.opt, key, _MISSING)  # likewise: the retried step must make it again
        for key, v in self._own_before.items():
            value_put(self.opt, key, _copy(v))

    def _changed(self) -> list[tuple[int | str, Any]]:
        """(where, key) of each value the probe saw the step change outside the
        per-parameter state (value_name() names it)."""
        return [(g, k) for g, k in self._changed_groups] + list(self._changed_own)

    def step_changed_values(self) -> list[str]:
        return [value_name(key) for key in self._changed()]

    def _kept(self) -> list[tuple[int | str, Any]]:
        """(where, key) of every value a manifest keeps: those the probe saw a step
        change, and besides them every simple value the optimizer keeps on itself (but
        private ones, named with a leading underscore, and `defaults`, the user's) or in
        its state under a string key, and every group value that is none of the user's
        hyperparameters (not in `defaults`), unless the probe's first step set it: a value
        that first changes after the probe's steps (a flag set at the end of a warm-up) is
        kept too."""
        kept = self._changed()
        skip = set(kept) | self._set_once
        for key in sorted(own_keys(self.opt), key=lambda key: (key[0], str(key[1]))):
            if key not in skip and not (key[0] == ATTR and (key[1].startswith("_")
                                                            or key[1] == "defaults")):
                kept.append(key)
        defaults = getattr(self.opt, "defaults", {})
        for g, group in enumerate(self.opt.param_groups):
            kept += [(g, k) for k, v in group.items()
                     if k != "params" and k not in defaults and (g, k) not in skip
                     and _simple(v)]
        return kept

    def step_values(self) -> dict[str, Any]:
        values: dict[str, Any] = {"groups": {}, "own": {}, "state": {}, "absent": []}
        for key in self._kept():
            where, k = key
            value = value_get(self.opt, key)
            if value is _MISSING:  # not made yet (a count the first step sets up)
                values["absent"].append(value_name(key))
            elif isinstance(where, int):
                values["groups"].setdefault(str(where), {})[k] = value
            else:
                values["own" if where == ATTR else "state"][k] = value
        return values

    def restore_step_values(self, values: dict[str, Any]) -> None:
        kept = {(int(g), k): v for g, vs in values.get("groups", {}).items()
                for k, v in vs.items()}
        kept.update({(ATTR, k): v for k, v in values.get("own", {}).items()})
        kept.update({(STATE, k): v for k, v in values.get("state", {}).items()})
        absent = set(values.get("absent", ()))
        missing = [value_name(key) for key in self._changed()
                   if key not in kept and value_name(key) not in absent]
        if missing:
            raise UnsupportedOptimizer(
                f"cannot resume {_name(type(self.opt))} from disk: its step changes "
                f"{', '.join(missing)}, outside its per-parameter state, and the manifest "
                "does not keep them (written by an older tiermem), so the resumed run would "
                "start them over; resume it through torch.save(optimizer.state_dict()) and "
                "load_state_dict() instead")
        for key, v in kept.items():
            if isinstance(v, Unkept) and v.digest != value_digest(value_get(self.opt, key)):
                raise UnsupportedOptimizer(
                    f"cannot resume {_name(type(self.opt))} from disk: its "
                    f"{value_name(key)} was {v.text} at the committed step, which the "
                    "manifest could not keep exactly, and this optimizer holds another "
                    "value; resume it through torch.save(optimizer.state_dict()) and "
                    "load_state_dict() instead")
        for key, v in kept.items():
            if not isinstance(v, Unkept):  # (an Unkept is what the optimizer holds)
                value_put(self.opt, key, v)
        for key in self._changed():  # as the committed step left them: not made yet
            if value_name(key) in absent:
                value_put(self.opt, key, _MISSING)

    def state_methods(self) -> tuple[str, ...]:
        return tuple(m for m in STATE_METHODS if callable(getattr(type(self.opt), m, None)))

    def bind(self, opt: torch.optim.Optimizer) -> None:
        """Make the partitions' shadows from `opt` from now on: under a process group the
        rule is checked (and its coupling probed) on the user's optimizer, whose groups
        hold every parameter on every rank, so that every rank comes to the same answer;
        it then steps a rank's own optimizer of the same class (shadow_of_groups), whose
        groups are the user's, in the same order, holding that rank's share."""
        self.opt = opt

    def state_keys_made(self) -> list[Any]:
        """The keys that are no parameter under which the probe's steps made or changed an
        entry of the optimizer's state (an optimizer-wide count kept in `opt.state`)."""
        return sorted({k for where, k in [*self._changed_own, *self._set_once]
                       if where == STATE}, key=str)

    def settled_groups(self) -> set[int]:
        """The groups a partition of the current step (or state method) stepped: where the
        group's values are a real step's, not a shadow's with no parameters."""
        return set(self._stepped)

    def closure_refusal(self) -> str | None:
        """Why a closure cannot be handed to this optimizer's step under a process group, if
        it cannot: each rank evaluates the closure on its own batch, so a step that reads
        the loss (uses_loss) would use a different loss on each rank's share; and one that
        calls it other than once would step on other gradients (check_closure)."""
        try:
            self.check_closure()
        except UnsupportedOptimizer as exc:
            return str(exc)
        if self.uses_loss():
            return (f"{_name(type(self.opt))}'s step uses the loss its closure returns, and "
                    "under a process group each rank's closure returns its own batch's loss, "
                    "so the ranks' shares would be stepped with different losses where the "
                    "plain optimizer on the mean gradient sees one. Call backward yourself "
                    "and step() without a closure")
        return None

    def run_method(self, name: str, batch: Batch) -> None:
        """The optimizer's own `name`() on one partition's shadow, as update() steps it
        (batch.grads empty; a parameter never stepped has no state)."""
        def call(sh: torch.optim.Optimizer) -> None:
            with torch.no_grad():
                getattr(type(sh), name)(sh)
        self._on_shadow(batch, call)

    def update(self, batch: Batch, *, kernel: str) -> None:
        self._on_shadow(batch, lambda sh: self._run(sh, f"partition {batch.part.id}",
                                                    self._closure))

    def _on_shadow(self, batch: Batch, call: Any) -> None:
        part, group = batch.part, batch.group
        tensors, views, orders_of, nested = [], [], [], []
        for j, s in enumerate(batch.segments):
            t = batch.params[j].view(s.param.shape)
            if batch.grads:
                t.grad = batch.grads[j].view(s.param.shape)
            tensors.append(t)
            orders = dict(batch.scalars[j].pop(ORDER_KEY, ()))
            orders_of.append(orders)
            nested.append(self.whole_layout(s.param, group,
                                            keep_master="master" in part.kinds).nested)
            views.append({k: laid(batch.state[k][j], s.shapes.get(k, tuple(s.param.shape)),
                                  orders.get(k)) for k in batch.state})
        before = (self._before[part.group] if part.group < len(self._before)
                  else {k: v for k, v in group.items() if k != "params"})
        # the optimizer's own values as the step began, not what an earlier partition of
        # this step set (nor one it made: a count its first step sets up)
        sh = self._shadow({k: _copy(v) for k, v in before.items()}, tensors, self._own_before)
        for j, t in enumerate(tensors):
            if not batch.first[j]:
                sh.state[t] = {**batch.scalars[j], **self._nest(views[j], nested[j])}
        call(sh)
        for j, t in enumerate(tensors):
            t.grad = None
            new = sh.state.get(t, {})
            if not new and batch.first[j] and not batch.grads:
                continue  # never stepped, and the method made no state: nothing to keep
            new = self._unnest(new, nested[j], batch, j)
            orders = orders_of[j]
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
                    # replaced rather than updated in place: into the record in its own
                    # memory order, which the next step's view takes again
                    orders[k] = dim_order(v)
                    laid(batch.state[k][j], tuple(v.shape), orders[k]).copy_(v)
            extra = [k for k, v in new.items()
                     if (is_record_tensor(v) or nests(v)) and k not in views[j]]
            if extra:
                raise TierMemError(
                    f"{_name(type(self.opt))} created state {extra} after a parameter's "
                    "first step; tiermem lays the record out from the first step's state")
            batch.scalars[j].clear()
            batch.scalars[j].update({k: v for k, v in new.items() if not is_record_tensor(v)})
            kept = [[k, list(o)] for k, o in orders.items() if o is not None]
            if kept:  # (a manifest keeps it as it keeps the scalars)
                batch.scalars[j][ORDER_KEY] = kept
        self._settle(part.group, group, before, sh)
        self._stepped.add(part.group)

    def _settle(self, g: int, group: dict[str, Any], before: dict[str, Any],
                sh: torch.optim.Optimizer) -> None:
        """Group `g`'s values (and the optimizer's own) as shadow `sh` left them, set on the
        group by the first shadow of the step; every other must leave the same."""
        self._carry_own_values(sh)
        after = {k: v for k, v in sh.param_groups[0].items() if k != "params"}
        if g not in self._after:
            self._after[g] = after
            for k, v in after.items():
                if not _same(v, before.get(k)):
                    group[k] = v
        elif not _same(after, self._after[g]):
            raise TierMemError(
                f"param_groups[{g}]: {_name(type(self.opt))} changed the group's "
                "values differently for two partitions of one step: its step couples the "
                "parameters of a group, so tiermem cannot run it")

    @staticmethod
    def _nest(flat: dict[str, Tensor], nested: dict[str, Template]) -> dict[str, Any]:
        """One parameter's record views as its state: containers rebuilt around them."""
        out = dict(flat)
        for key, template in nested.items():
            for name in leaf_names(template):
                del out[name]
            out[key] = rebuild(template, flat)
        return out

    def _unnest(self, state: dict[str, Any], nested: dict[str, Template], batch: Batch,
                j: int) -> dict[str, Any]:
        """A shadow's state after its step with each container's tensors under their kinds;
        a container whose structure is not the layout's is an error, never dropped."""
        if not nested:
            return state
        out = dict(state)
        for key, template in nested.items():
            got = leaves_of(template, out.pop(key, None))
            if got is None:
                raise TierMemError(
                    f"{_name(type(self.opt))}: after step {float(batch.steps[j]):g} the "
                    f"state {key!r} of a parameter of shape "
                    f"{tuple(batch.segments[j].param.shape)} is no longer laid out as its "
                    "first step left it (tiermem keeps each tensor inside it in the record)")
            out.update(got)
        return out

    def to_torch_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]
                       ) -> dict[str, Any]:
        state = dict(state)
        for k, order in state.pop(ORDER_KEY, ()):
            if k in state:  # the record's bytes, in the memory order the optimizer left
                state[k] = laid(state[k].reshape(-1), tuple(state[k].shape), tuple(order))
        nested = self.whole_layout(param, group, keep_master=False).nested
        return self._nest(state, nested) if nested else state

    def from_torch_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]
                         ) -> dict[str, Any]:
        lay = self.whole_layout(param, group, keep_master=False)
        nested = lay.nested
        unknown = [k for k, v in state.items() if k not in nested and k not in lay.kinds
                   and k != MASTER_KEY and (is_record_tensor(v) or nests(v))]
        if unknown:
            # SPAM makes a mask per matrix in __init__, before any step: the record, laid
            # out from a first step on a fresh parameter, has no room for it, and the steps
            # would go on without it (the masked arithmetic rounds differently)
            raise UnsupportedOptimizer(
                f"tiermem.offload cannot take {_name(type(self.opt))}'s state {unknown} of a "
                f"parameter of shape {tuple(param.shape)}: the record is laid out from what "
                "the optimizer's first step makes for a parameter without state, and that "
                "step does not make it (state made before the first step, as in __init__, "
                "or by a later one)")
        out = dict(state)
        for key, template in nested.items():
            if key not in out:
                continue
            got = leaves_of(template, out.pop(key))
            if got is None:
                raise TierMemError(
                    f"{_name(type(self.opt))}: the state dict's {key!r} of a parameter of "
                    f"shape {tuple(param.shape)} is not laid out as the optimizer's own "
                    "first step lays it out")
            out.update(got)
        kept = []
        for k, v in list(out.items()):
            order = dim_order(v) if is_record_tensor(v) else None
            if order is not None:  # the record keeps its bytes in memory order
                out[k] = v.permute(order).reshape(-1)
                kept.append([k, list(order)])
        out.pop(ORDER_KEY, None)
        if kept:
            out[ORDER_KEY] = kept
        return out

    def _carry_own_values(self, sh: torch.optim.Optimizer) -> None:
        """Set what the first partition's step changed of the values the optimizer keeps on
        itself (and in its state under keys that are no parameter) back on it; refuse a
        later partition that ends with other values."""
        keys = own_keys(sh)
        if self._own_after is None:
            self._own_after = {key: _copy(value_get(sh, key)) for key in keys}
            for key, v in self._own_after.items():
                if not _same(v, (self._own_before or {}).get(key, _MISSING)):
                    value_put(self.opt, key, _copy(v))
            return
        changed = sorted(value_name(key) for key in keys | self._own_after.keys()
                         if not _same(value_get(sh, key) if key in keys else _MISSING,
                                      self._own_after.get(key, _MISSING)))
        if changed:
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
