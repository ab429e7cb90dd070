"""The optimizer instance's methods that tiermem takes over, and torch's step hooks.

One installer for local and sharded runs: `install(opt, target)` binds plain
functions to the user's optimizer *instance* (its class is untouched) that
route step / state_dict / load_state_dict / add_param_group to `target`;
`Installed.remove()` puts back exactly what the instance had. param_groups,
lr schedulers and zero_grad keep working on the user's object.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from typing import Any, Callable, Protocol

import torch
from torch.optim import optimizer as _optimizer_module

from tiermem.errors import TierMemError

HOOKED = ("step", "state_dict", "load_state_dict", "add_param_group")
ATTR = "_tiermem"  # the instance attribute that names the target while installed
KEPT = "_tiermem_kept"  # instance attribute of an optimizer whose state a block kept on disk
# GradScaler hands an optimizer that sets this its scale and inf flag (tiermem/optim/amp.py)
AMP = "_step_supports_amp_scaling"


class Target(Protocol):
    """What the hooked methods call: an offloaded optimizer, local or sharded."""

    def step(self, closure: Any = None) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
    def add_param_group(self, param_group: dict[str, Any]) -> None: ...


class HeldState(defaultdict):
    """`opt.state` while the tiers hold the per-parameter state: its entries are what
    opt.state keeps (none, or those under keys that are no parameter), and it is true
    when a plain optimizer's state would be. torch.distributed.checkpoint's
    get_optimizer_state_dict / set_optimizer_state_dict / get_state_dict take an empty
    `opt.state` for a never-stepped optimizer and run a step with zero gradients and lr 0
    to make its state: on a tiered optimizer that step counted one more step of every
    parameter and decayed every moment (the checkpoint was a step ahead, silently)."""

    held: Callable[[], bool] | None = None

    def __bool__(self) -> bool:
        return dict.__len__(self) > 0 or self._tiers_hold()

    def _tiers_hold(self) -> bool:
        return self.held is not None and self.held()

    # Writes keyed by a parameter would go to a dict the tiers never read (a momentum reset
    # by `opt.state[p]["momentum_buffer"] = ...`, or `opt.state.clear()`), and reads of a
    # parameter's entry would find none: both refused, naming the way that works. Entries
    # under keys that are no parameter (MADGRAD's state['k']) are opt.state's own.
    def _refuse(self, what: str) -> None:
        refuse_state_edit(what)

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, torch.Tensor):
            if called_by_torch("_unflatten_optim_state_dict", 4, skip=2):
                # set_optimizer_state_dict(flatten_optimizer_state_dict=True) reads the
                # names of each parameter's state here: it finds none, and the load it then
                # makes is refused naming that option (state_io.param_entries)
                return {}
            self._refuse("opt.state[param]")
        return super().__missing__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, torch.Tensor):
            self._refuse("opt.state[param] = ...")
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        if isinstance(key, torch.Tensor):
            self._refuse("del opt.state[param]")
        super().__delitem__(key)

    def clear(self) -> None:
        if self._tiers_hold():
            self._refuse("opt.state.clear()")
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        new = dict(*args, **kwargs)
        if any(isinstance(k, torch.Tensor) for k in new):
            self._refuse("opt.state.update({param: ...})")
        super().update(new)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if isinstance(key, torch.Tensor):
            self._refuse("opt.state.setdefault(param, ...)")
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        if isinstance(key, torch.Tensor):
            self._refuse("opt.state.pop(param)")
        return super().pop(key, *default)

    def popitem(self) -> Any:
        self._refuse("opt.state.popitem()")

    def __reduce_ex__(self, protocol: Any) -> Any:
        # What copy.deepcopy(opt), pickle and torch.save(opt) take of opt.state (torch's
        # Optimizer.__getstate__ hands them defaults, state and param_groups): the
        # per-parameter state is in the tiers, so the copy would start it over, silently.
        if self._tiers_hold():
            raise TierMemError(
                "the optimizer's per-parameter state is in tiermem's tiers, so a "
                "copy.deepcopy / pickle / torch.save of the optimizer object inside "
                "tiermem.offload would hold none of it: save optimizer.state_dict() (torch's "
                "format, gathered from the tiers), or copy the optimizer after the block")
        return (defaultdict, (dict,), None, None, iter(dict.items(self)))


def refuse_state_edit(what: str) -> None:
    """Raise the refusal of `what`, an access to opt.state's per-parameter entries inside
    the block, naming the ways that work."""
    raise TierMemError(
        f"{what} inside tiermem.offload: the per-parameter optimizer state is in "
        "tiermem's tiers, not in opt.state; read it with opt.state_dict(), change it by "
        "loading a changed one with opt.load_state_dict(), and reset it with "
        "opt.load_state_dict({'state': {}, 'param_groups': opt.state_dict()"
        "['param_groups']})")


def hold_state(opt: torch.optim.Optimizer, held: Callable[[], bool]) -> None:
    """opt.state answers truth as a plain optimizer's would (`held`: the tiers hold some
    parameter's state). Again after torch's load_state_dict, which replaces opt.state."""
    if type(opt.state) is not HeldState:
        opt.state = HeldState(dict, opt.state)
    opt.state.held = held


def load_snapshot(opt: torch.optim.Optimizer) -> list[tuple[Any, Any]]:
    """What a load of `opt` replaces (its attributes, its groups and their entries,
    opt.state's entries), the objects themselves, for changed_since."""
    return [*vars(opt).items(), *enumerate(opt.param_groups),
            *(item for group in opt.param_groups for item in group.items()),
            *dict.items(opt.state)]


def changed_since(opt: torch.optim.Optimizer, snapshot: list[tuple[Any, Any]]) -> bool:
    """Whether a load that raised changed `opt` since `snapshot`: torch's own load puts the
    new groups and state in place at its very end, so one that raised before it (an
    optimizer class's own checks) left the optimizer as it was. The snapshot holds the
    objects, so none compared here can be a new one at a freed one's address."""
    now = load_snapshot(opt)
    return len(now) != len(snapshot) or any(
        k != k0 or v is not v0 for (k, v), (k0, v0) in zip(now, snapshot))


def release_state(opt: torch.optim.Optimizer, original: Any) -> None:
    """opt.state the object it was before hold_state (a reference taken before the block
    still sees the state handed back into it), holding the entries opt.state holds now."""
    if opt.state is not original:
        entries = dict(opt.state)
        original.clear()
        original.update(entries)
        opt.state = original


def installed(opt: torch.optim.Optimizer) -> Target | None:
    """The target `opt` is routed to now, or None."""
    return opt.__dict__.get(ATTR)


class Installed:
    """The hooks on one optimizer instance; remove() restores it (idempotent)."""

    def __init__(self, opt: torch.optim.Optimizer, target: Target) -> None:
        self.opt = opt
        # Methods of the optimizer besides step() that use its per-parameter state
        # (schedule-free's train()/eval()): routed to target.call_state_method.
        extra = tuple(getattr(target, "state_methods", ()))
        # The instance's own entries (normally none: the methods come from its class).
        self._originals = {name: opt.__dict__.get(name) for name in (*HOOKED, *extra)}

        # Plain functions bound to the optimizer, so an lr scheduler that wraps opt.step
        # (it re-binds step.__func__ to opt) still lands here.
        def step(opt_self, closure=None):
            target = opt_self.__dict__.get(ATTR)
            if target is None:
                return after_the_block(opt_self, step, closure)
            if held is not None and type(opt_self.state) is not HeldState:
                # `opt.state = defaultdict(dict)` (a reset of the moments) replaced the
                # stand-in: the tiers would step on as if nothing happened
                refuse_state_edit("replacing opt.state")
            return target.step(closure)

        # torch's lr schedulers look for this mark to know opt.step reports its calls
        # (the targets set opt._opt_called, as their wrapper would).
        step._wrapped_by_lr_sched = True

        def state_dict(opt_self):
            target = opt_self.__dict__.get(ATTR)
            if target is None:
                return after_the_block(opt_self, state_dict)
            return target.state_dict()

        def load_state_dict(opt_self, state_dict):
            target = opt_self.__dict__.get(ATTR)
            if target is None:
                return after_the_block(opt_self, load_state_dict, state_dict)
            try:
                return target.load_state_dict(state_dict)
            finally:
                if held is not None:  # torch's own load, called inside, made a new opt.state
                    hold_state(opt_self, held)  # (a load failing after it too)

        def add_param_group(opt_self, param_group):
            target = opt_self.__dict__.get(ATTR)
            if target is None:
                return after_the_block(opt_self, add_param_group, param_group)
            return target.add_param_group(param_group)

        held = getattr(target, "holds_state", None)
        self._state = opt.state
        opt.__dict__[ATTR] = target
        if held is not None:
            hold_state(opt, held)
        for fn in (step, state_dict, load_state_dict, add_param_group):
            setattr(opt, fn.__name__, types.MethodType(fn, opt))
        for name in extra:
            def method(opt_self, *args, _name=name, **kwargs):
                target = opt_self.__dict__.get(ATTR)
                if target is None:
                    return after_the_block(opt_self, method, *args, **kwargs)
                return target.call_state_method(_name, *args, **kwargs)
            method.__name__ = name
            setattr(opt, name, types.MethodType(method, opt))

    def claim_amp(self) -> None:
        """Have GradScaler hand every step, skipped ones too, to the target with its scale
        and inf flag (optimizer.grad_scale / found_inf) instead of unscaling p.grad and
        deciding on its own whether to call step(): where the target cannot take a scaled
        step it must be there to refuse it (tiermem/optim/amp.py)."""
        if self._originals is not None and AMP not in self._originals:
            self._originals[AMP] = self.opt.__dict__.get(AMP)
            setattr(self.opt, AMP, True)

    def remove(self) -> None:
        if self._originals is None:
            return
        for name, orig in self._originals.items():
            if orig is None:
                self.opt.__dict__.pop(name, None)
            else:
                setattr(self.opt, name, orig)
        self.opt.__dict__.pop(ATTR, None)
        release_state(self.opt, self._state)
        self._originals = None


def in_torch_state_init(depth: int = 8) -> bool:
    """Whether the opt.step() running now was called by torch's `_init_optim_state`
    (torch.distributed.checkpoint.state_dict's, or FSDP's): the step with zero gradients
    and lr 0 that get_optimizer_state_dict / set_optimizer_state_dict take on an optimizer
    whose state is empty, only on a rank where no parameter has a gradient. Told by the
    caller's frame, not by the step's look (a real first step under a warm-up schedule
    can have lr 0 too); `depth` frames up: an lr scheduler's wrapper and the hooked
    method sit between."""
    return called_by_torch("_init_optim_state", depth, skip=2)


def called_by_torch(name: str, depth: int = 8, skip: int = 1) -> bool:
    """Whether a function of torch's named `name` is among the `depth` frames above the
    caller's (`skip`: frames of our own to pass over first)."""
    frame = sys._getframe(skip)
    for _ in range(depth):
        if frame is None:
            return False
        if (frame.f_code.co_name == name
                and str(frame.f_globals.get("__name__", "")).startswith("torch.")):
            return True
        frame = frame.f_back
    return False


def after_the_block(opt: torch.optim.Optimizer, hook: Callable, *args: Any,
                    **kwargs: Any) -> Any:
    """Run the optimizer class's method in place of `hook`, one of the methods a block put
    on `opt`, called after the block was left: something kept the bound method
    (Accelerate's GradScaler path keeps `opt.step` as it was when accelerator.prepare ran,
    and puts it back after each of its steps). The state is back in `opt`, unless the
    block kept it on disk, where step() raises what the block's guard says."""
    kept = opt.__dict__.get(KEPT)
    if kept is not None and hook.__name__ == "step":
        raise TierMemError(kept[1])
    return getattr(type(opt), hook.__name__)(opt, *args, **kwargs)


def run_pre_hooks(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple:
    """Global and per-optimizer step pre-hooks, as torch's own step wrapper runs them."""
    for hook in (*_optimizer_module._global_optimizer_pre_hooks.values(),
                 *opt._optimizer_step_pre_hooks.values()):
        result = hook(opt, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{hook} must return None or a tuple of (new_args, "
                                   f"new_kwargs), but got {result}.")
            args, kwargs = result
    return args, kwargs


def run_post_hooks(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for hook in (*opt._optimizer_step_post_hooks.values(),
                 *_optimizer_module._global_optimizer_post_hooks.values()):
        hook(opt, args, kwargs)


def step_called(opt: torch.optim.Optimizer) -> None:
    """What torch's lr schedulers check to know the optimizer stepped before them."""
    opt._opt_called = True


def load_with_hooks(opt: torch.optim.Optimizer, state_dict: dict[str, Any],
                    load: Callable[[dict[str, Any]], Any]) -> Any:
    """`load(state_dict)` between `opt`'s load_state_dict hooks, as torch's own
    load_state_dict runs them: each pre-hook may return the state dict to load instead
    (a target reads the per-parameter entries itself, so it must be given that one), and
    the post-hooks run once the tiers hold the loaded state. torch's own load, which a
    target calls inside for the groups, runs neither again."""
    for hook in list(opt._optimizer_load_state_dict_pre_hooks.values()):
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    pre, post = (opt._optimizer_load_state_dict_pre_hooks,
                 opt._optimizer_load_state_dict_post_hooks)
    # Empty stand-ins while the target loads; the user's hooks dicts come back as they were
    # (a hook that removed itself meanwhile is gone from them as from torch's).
    opt._optimizer_load_state_dict_pre_hooks = type(pre)()
    opt._optimizer_load_state_dict_post_hooks = type(post)()
    try:
        out = load(state_dict)
    finally:
        opt._optimizer_load_state_dict_pre_hooks = pre
        opt._optimizer_load_state_dict_post_hooks = post
    for hook in list(post.values()):
        hook(opt)
    return out
