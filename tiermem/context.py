"""`tiermem.offload(optimizer, config)`: the user's door.

It loads the config, picks a local or a sharded run (torch.distributed), and
takes the block's one way out (`handle.leave`) however the block ends:
normally, by an exception, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import traceback
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from tiermem.config import Settings, load_config
from tiermem.dist import sharded
from tiermem.errors import TierMemError, TierMemWarning
from tiermem.optim.handle import KEPT, Offload, forget_kept, kept_dir, mark_kept
from tiermem.optim.hooks import installed
from tiermem.optim.offloaded import OffloadedOptimizer
from tiermem.optim.wrappers import unwrap
from tiermem.signals import held, terminate_as_exception
from tiermem.swap.paths import check_paths
from tiermem.swap.rundir import StaleSwapError, run_dirs
from tiermem.swap.runs import describe, in_the_way

# The open block of each optimizer (its name= and where it was opened), for the error a
# second block on the same optimizer gets.
_ACTIVE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, str]" = weakref.WeakKeyDictionary()


def _caller() -> str:
    """file:line of the user's `with tiermem.offload(...)`."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not frame.filename.endswith(("contextlib.py", os.path.join("tiermem", "context.py"))):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _check_arguments(optimizer: Any, model: Any, settings: Settings, name: str) -> None:
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
            f"({_ACTIVE.get(optimizer, 'opened elsewhere')}); one block per optimizer at a "
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


def _check_swap_paths(settings: Settings) -> None:
    report = check_paths(settings.swap.paths)
    report.raise_first()
    for w in report.all_warnings():
        warnings.warn(f"tiermem: {w}", TierMemWarning, stacklevel=4)


def _explain_run_dir(settings: Settings, name: str, resume: bool) -> str | None:
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


@contextmanager
def offload(optimizer: torch.optim.Optimizer,
            config: "str | os.PathLike | dict | Settings | None" = None, *,
            model: torch.nn.Module | None = None, name: str = "default",
            resume: bool = False, process_group: Any = None,
            streams: Any = None) -> Iterator[Offload]:
    """Keep `optimizer`'s state (torch Adam/AdamW) in tiers for the duration of the block.

    config: YAML path, dict of the same shape, Settings, or None for the defaults.
    model: gives parameter names to placement rules. name: the swap
    sub-directory (`<swap path>/tiermem-<name>`), so concurrent runs can share a path.
    resume: continue from state an earlier block kept on disk (its exit said so);
    `tm.resumed_step` tells the step it had reached.
    process_group: under torch.distributed (this group, else the default one when it is
    initialised, or FSDP2 DTensor parameters) each rank tiers only its share of the state
    (docs/guide/distributed.md).
    streams: the stream backend of the host<->device lanes; None picks CUDA streams for
    CUDA parameters. `tiermem.device.lanes.DeferredBackend()` makes CPU parameters count
    as device ones and runs every device path on the CPU (tests, smoke runs).
    """
    if isinstance(optimizer, torch.nn.Module):  # before unwrap(), which would fail obscurely
        _check_arguments(optimizer, model, Settings(), name)
    optimizer, unwrapped = unwrap(optimizer)  # AcceleratedOptimizer, LightningOptimizer
    settings = load_config(config)
    _check_arguments(optimizer, model, settings, name)
    # A block that kept this optimizer's state on disk made opt.step() raise; a new block
    # lifts that (resume continues the state; a fresh start is what the user asked for).
    kept = optimizer.__dict__.get(KEPT)
    forget_kept(optimizer)
    try:
        if sharded.wanted(optimizer, process_group):  # each rank tiers its share only
            _check_swap_paths(settings)
            handle: Offload = sharded.DistributedOffload(optimizer, settings, model=model,
                                                         name=name, resume=resume,
                                                         process_group=process_group,
                                                         streams=streams)
        else:
            settings = sharded.rank_paths(settings, 0, 0)  # {rank} / {local_rank} in one process
            _check_swap_paths(settings)
            if resume:
                why = _explain_run_dir(settings, name, resume=True)
                if why:  # no manifest: read_manifest would only say it is missing
                    raise TierMemError(f"cannot resume: manifest.json does not exist; {why}")
            try:
                handle = Offload(OffloadedOptimizer(optimizer, settings, model=model,
                                                    swap_name=name, resume=resume,
                                                    streams=streams))
            except StaleSwapError as exc:
                why = _explain_run_dir(settings, name, resume=resume)
                if why is None:
                    raise
                raise StaleSwapError(why) from exc
    except BaseException:
        if kept is not None and kept_dir(optimizer) is None and installed(optimizer) is None:
            mark_kept(optimizer, kept, os.path.basename(kept).removeprefix("tiermem-"), None)
        raise
    handle.unwrapped = unwrapped
    _ACTIVE[optimizer] = f"name={name!r}, opened at {_caller()}"
    with terminate_as_exception():
        try:
            yield handle
        except BaseException as exc:
            with held():  # the state is never left half moved
                handle.leave(exc)
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM as Terminated
                print(f"tiermem: interrupted ({exc or 'SIGINT'}); {handle.where_state_is()}",
                      file=sys.stderr)
            raise
        else:
            with held():
                handle.leave(None)
        finally:
            _ACTIVE.pop(optimizer, None)
