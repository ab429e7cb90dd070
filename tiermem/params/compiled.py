"""The parameter tier under torch.compile.

Dynamo traces a compiled model's forward into graphs. The tier's work (a unit's forward
pre- and post-hooks, the root's saved-tensor hooks, the guard's materialisation of a
released weight) must not be traced: it moves weights in and out of p.data, takes locks,
reads records. Each is a graph break instead (`untraced`): it runs eagerly between the
graphs, as without compile, so a module's forward is a graph of its own, traced and run
with its weights in place. No tier code runs inside a graph, and dynamo guards each graph
on its inputs' shapes and devices at its entry, so a weight materialised when a graph was
traced is materialised whenever it runs, and one released then (the empty tensor the tier
leaves in p.data) would be traced as empty.

dynamo answers a tensor's `shape`, `ndim` and `nbytes` from what it traced, with no torch
call the guard's mode sees: a parent's forward reading `self.child.weight.shape` while the
child's weights were out of the window was traced with `(0,)`, silently. So a released
weight of an open tier given to dynamo (its wrapping, the moment dynamo first reads the
tensor in a frame) is refused with a TierMemError naming it (`CompiledRead`). A graph
break there instead was tried: dynamo resumed the frame with a wrong stack (a float added
to a torch.Size). The hook is in dynamo's internals (VariableBuilder.wrap_tensor); a torch
whose dynamo lacks it is refused at the first torch call compiled code makes with a
parameter (`traced_use`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Protocol, TypeVar

import torch

from tiermem.errors import TierMemError

F = TypeVar("F", bound=Callable[..., Any])


class Tier(Protocol):
    def released_name(self, p: torch.Tensor) -> str | None: ...


class CompiledRead(TierMemError, AssertionError):
    """A released weight read by code torch.compile traces (an AssertionError too: dynamo
    passes those through as they are, where it wraps others in its internal error)."""


# the parameter tiers open now, whose released weights dynamo must not trace
_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()
_patched: str | None = None  # "yes", or why dynamo could not be hooked
_eager: Callable[..., Any] | None = None  # _call, under torch.compiler.disable
_callback: Callable[[], Any] = lambda: None  # dynamo's frame callback (None: none set)


def untraced(fn: F) -> F:
    """fn never traced by torch.compile, and nothing it calls: reached from code dynamo
    traces (the tier's forward hooks, which a compiled model's forward calls), the call is a
    graph break and fn runs eagerly between the graphs, as without compile; called in the
    eager stretch between two graphs (the guard's materialisation of a weight, autograd's
    saved-tensor hooks), fn runs as plain Python (else dynamo compiled each of its frames on
    its own, and failed in the tier's native code). A plain call until a tier is open
    (register: dynamo hooked)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _eager is None or (not torch.compiler.is_compiling() and _callback() is None):
            return fn(*args, **kwargs)  # (not under a compiled call: 0.15 us, not 0.45)
        return _eager(fn, *args, **kwargs)
    return run  # type: ignore[return-value]


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def register(tier: Tier) -> None:
    """`tier` is open: dynamo hooked before it can trace anything. (Importing dynamo here
    costs nothing: torch.optim's Optimizer imports it at its first zero_grad or step.)"""
    _OPEN.add(tier)
    _hook_dynamo()


def unregister(tier: Tier) -> None:
    _OPEN.discard(tier)


def traced_use() -> None:
    """Run in code dynamo traces, at a torch call given a parameter (the guard's): where
    dynamo could not be hooked, a refusal, raised eagerly at that call (a graph break)."""
    if _patched != "yes" and _eager is not None:
        _eager(check_dynamo)


def check_dynamo() -> None:
    """Refuse to go on under compile where dynamo could not be hooked."""
    if _patched != "yes":
        raise TierMemError(
            "parameters.offload: a torch.compile'd model (or function) reached the parameter "
            f"tier, but this torch's dynamo cannot be hooked to keep released weights out "
            f"of its graphs ({_patched}); compiled graphs could then read a weight out of "
            "memory as the empty tensor the tier leaves. Use parameters.offload: none with "
            "torch.compile, or run the model uncompiled")


def _released_name(value: Any) -> str | None:
    if type(value) is not torch.nn.Parameter:
        return None
    for tier in list(_OPEN):
        name = tier.released_name(value)
        if name is not None:
            return name
    return None


def _hook_dynamo() -> None:
    global _patched, _eager, _callback
    if _patched is not None:
        return
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        _eager = torch.compiler.disable(_call)
        _callback = get_eval_frame_callback
        from torch._dynamo.eval_frame import skip_code
        from torch._dynamo.variables.builder import VariableBuilder
        wrap = VariableBuilder.wrap_tensor
    except (ImportError, AttributeError) as e:
        _patched = f"no dynamo hooks where tiermem knows them: {e}"
        return

    @functools.wraps(wrap)
    def wrap_tensor(self: Any, value: torch.Tensor) -> Any:
        name = _released_name(value) if _OPEN else None
        if name is not None:
            raise CompiledRead(
                f"parameters.offload: torch.compile traced a read of {name} while its weights "
                "are out of memory: the parameter tier brings a module's weights in for its "
                "own forward, and this code reads them from outside it (a parent's forward "
                "using a child's weight or its shape, a compiled function reading a "
                "parameter or calling opt.step()); traced, the read would see the empty "
                "tensor the tier leaves in "
                "p.data. Compile only modules whose forward uses their own weights (a child's "
                "through calling the child), leave that read out of the compiled code, or use "
                "parameters.offload: none with torch.compile")
        return wrap(self, value)

    VariableBuilder.wrap_tensor = wrap_tensor  # type: ignore[method-assign]
    # untraced's wrapper, called as a frame of its own in an eager stretch (autograd's hooks
    # in a backward that a compiled function calls) is not compiled: dynamo made a graph of
    # it per hook and grad mode, up to its recompile limit. (Traced code calling it still
    # inlines it, and breaks the graph at the call.)
    skip_code(untraced(_call).__code__)
    _patched = "yes"
