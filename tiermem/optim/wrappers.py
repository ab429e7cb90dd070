"""The optimizer wrappers that frameworks hand their users, unwrapped for `tiermem.offload`.

Accelerate's `AcceleratedOptimizer`, Lightning's `LightningOptimizer` and Fabric's
`_FabricOptimizer` hold the torch optimizer in `.optimizer` and route step / state_dict /
load_state_dict to it, so tiering the inner instance is what the user meant: tiermem hooks
that instance, and the wrapper's calls land in the hooks (those Lightning's and Fabric's
classes inherit from the optimizer's are routed there: route_wrappers). They are
recognised by the module and name of a class in the wrapper's MRO (Lightning makes a
class per optimizer, `LightningAdamW`, that also derives from the optimizer's class), so
neither framework is imported here.

Any other object that carries a torch optimizer in `.optimizer`, or in any other
attribute (timm's Lookahead and pytorch-optimizer's SAM family keep theirs in
`.base_optimizer`), is refused with the attribute to pass instead: its own step may or
may not reach the inner optimizer, and tiering the wrong instance would train with an
empty state, silently. Tiering the outer one is no better: tiermem steps an optimizer
one partition at a time on shadows of it, and each shadow's step would call the inner
optimizer on every parameter of the model (measured: a wrapper around AdamW in `.base`
ended 6e-3 away from its plain run, with no error).
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from typing import Any, Callable, Iterable

import torch

from tiermem.optim.rules import RULES, UnsupportedOptimizer

# (module, class) of the wrappers whose `.optimizer` is what they step.
KNOWN = {
    ("accelerate.optimizer", "AcceleratedOptimizer"),
    ("lightning.pytorch.core.optimizer", "LightningOptimizer"),
    ("pytorch_lightning.core.optimizer", "LightningOptimizer"),
    # what Fabric.setup returns: a class derived from the optimizer's, as Lightning's
    ("lightning.fabric.wrappers", "_FabricOptimizer"),
    ("lightning_fabric.wrappers", "_FabricOptimizer"),
}
DEPTH = 4  # a wrapper of a wrapper is possible (Lightning over Accelerate); a loop is not


def _known(obj: Any) -> str | None:
    """`module.Class` of the known wrapper class `obj` is an instance of, or None."""
    for cls in type(obj).__mro__:
        if (cls.__module__, cls.__qualname__) in KNOWN:
            return f"{cls.__module__}.{cls.__qualname__}"
    return None


def _check_accelerate(obj: Any) -> None:
    # With a GradScaler (fp16 mixed precision), AcceleratedOptimizer.step puts the
    # optimizer's step method it saw at prepare() back onto the instance after each step:
    # that removes tiermem's hook, and the next step would run plain torch on an empty state.
    if getattr(obj, "scaler", None) is not None:
        raise UnsupportedOptimizer(
            "this AcceleratedOptimizer steps through a GradScaler (mixed_precision='fp16'), "
            "which replaces the optimizer's step method tiermem hooks; tiermem supports "
            "Accelerate with mixed_precision 'no' or 'bf16'")


def unwrap(optimizer: Any) -> tuple[torch.optim.Optimizer, str | None]:
    """(the torch optimizer to tier, the wrapper classes removed as 'a.B -> c.D' or None)."""
    removed: list[str] = []
    obj = optimizer
    for _ in range(DEPTH):
        name = _known(obj)
        if name is None:
            break
        if name.startswith("accelerate."):
            _check_accelerate(obj)
        removed.append(name)
        obj = obj.optimizer
    found = _inner_optimizer(obj)
    if found is not None and not any(isinstance(obj, rule.optimizers) for rule in RULES):
        attr, inner = found
        cls = type(obj)
        raise UnsupportedOptimizer(
            f"tiermem.offload got a {cls.__module__}.{cls.__qualname__}, a wrapper tiermem "
            f"does not know, around a {type(inner).__module__}.{type(inner).__qualname__} in "
            f"its .{attr}: pass that (tiermem.offload(wrapper.{attr}, ...)) and keep "
            "stepping through the wrapper if its step reaches the inner optimizer's step")
    _check_accelerate_around(obj)
    return obj, " -> ".join(removed) or None


def _check_accelerate_around(inner: torch.optim.Optimizer) -> None:
    """Refuse `inner` when an AcceleratedOptimizer with a GradScaler holds it: passed its
    `.optimizer` rather than the wrapper, the block opened and each of the wrapper's steps
    put torch's own step method on `inner` (_check_accelerate), so every step ran past
    tiermem, silently. Nothing reaches a wrapper from the optimizer it holds, so tiermem
    keeps the wrappers with a GradScaler itself (_scaled_registry), once Accelerate is
    loaded. Such a wrapper is in a reference cycle (its patched step refers to it), so one
    no longer used lives on until a collection: one runs before a wrapper found is
    refused."""
    cls = getattr(sys.modules.get("accelerate.optimizer"), "AcceleratedOptimizer", None)
    if not isinstance(cls, type) or not _scaled_wrappers(inner, cls):
        return
    gc.collect()
    for wrapper in _scaled_wrappers(inner, cls):
        _check_accelerate(wrapper)


_SCALED: dict[type, weakref.WeakSet] = {}  # AcceleratedOptimizer -> its instances with a scaler


def _scaled_registry(cls: type) -> weakref.WeakSet:
    """The live instances of `cls` (AcceleratedOptimizer) made with a GradScaler. The first
    call finds those made so far in the garbage collector's list of objects (once per
    process: a search of every object costs tens of milliseconds in a large process, too
    much for every block) and wraps cls.__init__ to add the ones made from then on."""
    found = _SCALED.get(cls)
    if found is not None:
        return found
    found = _SCALED[cls] = weakref.WeakSet()
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "scaler", None) is not None:
            found.add(self)

    cls.__init__ = __init__
    # type(obj), not isinstance: isinstance reads obj.__class__, which some objects answer
    # with a deprecation warning (torch.distributed.reduce_op's) or other work of their own
    found.update(obj for obj in gc.get_objects()
                 if issubclass(type(obj), cls) and getattr(obj, "scaler", None) is not None)
    return found


def _scaled_wrappers(inner: torch.optim.Optimizer, cls: type) -> list[Any]:
    """The instances of `cls` (AcceleratedOptimizer) holding `inner` with a GradScaler."""
    return [w for w in list(_scaled_registry(cls))
            if vars(w).get("optimizer") is inner and getattr(w, "scaler", None) is not None]


# (wrapper class, method name) -> [its _Routed, how many open blocks route it]
_PATCHED: dict[tuple[type, str], list] = {}
# id(optimizer) -> (optimizer, the names routed) for each optimizer whose block is open
_ROUTED: dict[int, tuple[torch.optim.Optimizer, frozenset[str]]] = {}


class _Routed:
    """A method of a known wrapper class, while a block is open, that calls the tiered
    optimizer's own method when the wrapper's `.optimizer` is one, and is otherwise what
    the class would have without it (the next class in the MRO, else AttributeError, so
    the wrapper's __getattr__ answers as before and hasattr() says what it said)."""

    def __init__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is not None:
            inner = vars(obj).get("_optimizer")  # what `.optimizer` returns, read safely
            entry = _ROUTED.get(id(inner))
            if entry is not None and entry[0] is inner and self.name in entry[1]:
                return getattr(inner, self.name)
        mro = (objtype or type(obj)).__mro__
        for cls in mro[mro.index(self.owner) + 1:]:
            if self.name in vars(cls):
                found = vars(cls)[self.name]
                get = getattr(type(found), "__get__", None)
                return found if get is None else get(found, obj, objtype)
        raise AttributeError(self.name)


def _wrapper_classes(optimizer: Any) -> list[type]:
    """The known wrapper classes loaded now, and those in `optimizer`'s chain of wrappers
    (as tiermem.offload got it)."""
    found: list[type] = []
    for module, qualname in sorted(KNOWN):
        cls = getattr(sys.modules.get(module), qualname, None)
        if isinstance(cls, type):
            found.append(cls)
    obj = optimizer
    for _ in range(DEPTH):
        if _known(obj) is None:
            break
        found += [c for c in type(obj).__mro__
                  if (c.__module__, c.__qualname__) in KNOWN and c not in found]
        obj = obj.optimizer
    return found


def route_wrappers(optimizer: Any, inner: torch.optim.Optimizer,
                   names: Iterable[str]) -> Callable[[], None]:
    """Until the returned function is called, make every Lightning or Fabric wrapper around
    `inner` call `inner`'s own `names` methods, the ones tiermem put on that instance:
    the wrapper tiermem.offload was given (`optimizer`), one around the inner optimizer the
    user passed instead (`tiermem.offload(self.optimizers().optimizer, ...)`), and one
    made inside the block (`fabric.setup` or `trainer.fit` after it was entered).

    Lightning's and Fabric's wrapper class derives from the optimizer's class, so a method
    it does not define itself (zero_grad, state_dict, load_state_dict, schedule-free's
    train()/eval()) is the optimizer class's own, run on the wrapper: it reaches `inner`'s
    state and param_groups, not the methods tiermem installed on `inner`. Measured: the
    state_dict of `self.optimizers()` was empty, schedule-free's train()/eval() swapped
    nothing (the weights 3.6e-3 off the plain fit), and zero_grad left the parameter
    tier's gradients in place. Each wrapper's class is made for that one wrapper, so the
    method goes on the wrapper's base class (LightningOptimizer, _FabricOptimizer), where
    it reaches wrappers made later too, and routes only the wrappers of a tiered optimizer.
    Accelerate's wrapper defines each of them as a call to its `.optimizer`."""
    wanted = frozenset(n for n in names if hasattr(inner, n))
    classes = _wrapper_classes(optimizer)
    _ROUTED[id(inner)] = (inner, wanted)
    added: list[tuple[type, str]] = []
    for cls in classes:
        for name in sorted(wanted):
            key = (cls, name)
            if key in _PATCHED:
                _PATCHED[key][1] += 1
            elif name in vars(cls):
                continue  # the wrapper's own method: it calls its .optimizer's itself
            else:
                _PATCHED[key] = [_Routed(cls, name), 1]
                setattr(cls, name, _PATCHED[key][0])
            added.append(key)

    def restore() -> None:
        if _ROUTED.get(id(inner), (None,))[0] is inner:
            del _ROUTED[id(inner)]
        while added:
            key = added.pop()
            _PATCHED[key][1] -= 1
            if _PATCHED[key][1] == 0:
                routed = _PATCHED.pop(key)[0]
                if vars(key[0]).get(key[1]) is routed:
                    delattr(*key)

    return restore


def _inner_optimizer(obj: Any) -> tuple[str, torch.optim.Optimizer] | None:
    """(attribute, optimizer) of a torch optimizer `obj` holds: in `.optimizer` (a property
    too), else in any attribute of its own, directly or in a list, tuple or dict."""
    inner = getattr(obj, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not obj:
        return "optimizer", inner
    for attr, value in getattr(obj, "__dict__", {}).items():
        items = (value.values() if isinstance(value, dict)
                 else value if isinstance(value, (list, tuple)) else (value,))
        for item in items:
            if isinstance(item, torch.optim.Optimizer) and item is not obj:
                return attr, item
    return None
