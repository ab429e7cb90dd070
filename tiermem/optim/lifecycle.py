"""What a `tiermem.offload` block checks before it opens: the arguments, the swap paths,
the run directories already there, and that no other block holds the optimizer.

Each check turns a mistake that would fail later with a raw error (or not at all) into
one sentence naming what is wrong and what to do.
"""

from __future__ import annotations

import fnmatch
import os
import traceback
import warnings
import weakref
from typing import Any

import torch

from tiermem.config import Settings
from tiermem.errors import TierMemError, TierMemWarning
from tiermem.optim.hooks import installed
from tiermem.optim.rules.base import UnsupportedOptimizer
from tiermem.swap.paths import check_paths
from tiermem.swap.rundir import run_dirs
from tiermem.swap.runs import describe, in_the_way

# The open block of each optimizer (its name= and where it was opened), for the error a
# second block on the same optimizer gets.
ACTIVE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, str]" = weakref.WeakKeyDictionary()


def caller() -> str:
    """file:line of the user's `with tiermem.offload(...)`."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not frame.filename.endswith(("contextlib.py", os.path.join("tiermem", "context.py"),
                                        os.path.join("tiermem", "optim", "lifecycle.py"))):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def check_arguments(optimizer: Any, model: Any, settings: Settings, name: str) -> None:
    """Mistakes that would otherwise fail later with a raw error, or not at all."""
    if isinstance(optimizer, torch.nn.Module):
        raise TierMemError(
            f"tiermem.offload takes the optimizer, got a model ({type(optimizer).__name__}); "
            "call tiermem.offload(optimizer, config, model=model)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TierMemError(f"tiermem.offload takes a torch.optim.Optimizer, got "
                           f"{type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TierMemError(f"model= takes a torch.nn.Module, got {type(model).__name__}")
    if installed(optimizer) is not None:
        raise TierMemError(
            f"this optimizer is already offloaded by an open tiermem.offload block "
            f"({ACTIVE.get(optimizer, 'opened elsewhere')}); one block per optimizer at a "
            f"time: leave that block first (asked for name={name!r})")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        owned = {id(p) for p in model.parameters()}
        foreign = [p for p in params if id(p) not in owned]
        if foreign:
            warnings.warn(
                f"tiermem: model= does not own {len(foreign)} of the optimizer's "
                f"{len(params)} parameters: placement rules cannot see their names (is it "
                "the model this optimizer was built for?)", TierMemWarning, stacklevel=4)
        names = [n for n, p in model.named_parameters()
                 if id(p) in {id(q) for q in params}]
        for i, rule in enumerate(settings.placement):
            if not any(fnmatch.fnmatchcase(n, rule.match) for n in names):
                sample = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                warnings.warn(
                    f"tiermem: placement[{i}] (match {rule.match!r} -> {rule.tier}) matches "
                    f"no parameter of the optimizer (names look like: {sample or 'none'})",
                    TierMemWarning, stacklevel=4)


def check_swap_paths(settings: Settings) -> None:
    report = check_paths(settings.swap.paths)
    report.raise_first()
    for w in report.all_warnings():
        warnings.warn(f"tiermem: {w}", TierMemWarning, stacklevel=4)


def explain_run_dir(settings: Settings, name: str, resume: bool) -> str | None:
    first, *others = run_dirs(settings.swap.paths, name)
    why = in_the_way(first, resume=resume)
    if why or describe(first) is not None:
        # The other paths' run directories hold the stripes of the run in the first, whose
        # manifest (only there) speaks for all of them.
        return why
    for d in others:
        why = in_the_way(d, resume=resume)
        if why:
            return why
    return None


def refuse_non_contiguous_shared(optimizer: torch.optim.Optimizer) -> None:
    """Under torch.distributed each rank's share is a run of a parameter's elements in
    row-major order, and its gradients are read by reshape: on a channels_last weight that
    is a copy in logical order, whose pieces would not line up with the memory-order
    records a single-process run keeps. Refused until the sharded path addresses memory
    order too."""
    for g, group in enumerate(optimizer.param_groups):
        for n, p in enumerate(group["params"]):
            if not p.is_contiguous():
                raise UnsupportedOptimizer(
                    f"param_groups[{g}]: params[{n}] (shape {tuple(p.shape)}, strides "
                    f"{tuple(p.stride())}) is not contiguous (channels_last?): tiermem under "
                    "torch.distributed tiers contiguous parameters only; convert the model "
                    "with model.to(memory_format=torch.contiguous_format), or tier it in one "
                    "process")
