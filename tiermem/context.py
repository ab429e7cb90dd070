"""`tiermem.offload(optimizer, config)`: the user's door.

It loads the config, picks a local or a sharded run (torch.distributed), and
takes the block's one way out (`handle.leave`) however the block ends:
normally, by an exception, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from tiermem.config import Settings, load_config
from tiermem.dist import sharded
from tiermem.errors import TierMemError, TierMemWarning
from tiermem.optim.handle import Offload, forget_kept, kept_dir, put_kept
from tiermem.optim.hooks import HOOKED, installed
from tiermem.optim.lifecycle import (ACTIVE, caller, check_arguments, check_swap_paths,
                                     explain_run_dir, refuse_non_contiguous_shared)
from tiermem.optim.offloaded import OffloadedOptimizer
from tiermem.optim.wrappers import route_wrappers, unwrap
from tiermem.signals import held, terminate_as_exception
from tiermem.swap.rundir import StaleSwapError


class NotLeft(TierMemError):
    """What ends a block that was still open when the interpreter began to exit."""


# Blocks entered and not yet left, innermost last, with where each was opened and the pid
# of the process that opened it.
_OPEN: "list[tuple[Offload, str, int]]" = []


def _leave_open_blocks() -> None:
    """Leave, at exit, the blocks nobody left (an ExitStack never closed, a REPL that quit).

    Left alone, the block's generator is finalised during interpreter teardown, where
    freeing the tensors its exit gathers aborts the process inside torch (an INTERNAL
    ASSERT in THPVariable_clear). atexit runs before that teardown, with every module
    still whole; it leaves each block the way an exception through it would.
    """
    while _OPEN:
        handle, where, pid = _OPEN.pop()
        if pid != os.getpid():
            continue  # a forked child's copy: the block and its swap files are the parent's
        where = f"name={handle.name!r}, opened at {where}"
        with held():
            try:
                handle.leave(NotLeft(f"the interpreter exited with the tiermem.offload block "
                                     f"({where}) still open"))
            except BaseException as exc:  # the next block must still be left
                message = f"could not be left at interpreter exit ({exc})"
            else:
                message = f"was left at interpreter exit: {handle.where_state_is()}"
        warnings.warn(f"tiermem: the tiermem.offload block ({where}) was never left "
                      f"and {message}", TierMemWarning, stacklevel=1)


def _still_open(handle: Offload) -> bool:
    """Take `handle` off the open list; True when this process is to leave it: False when
    the exit hook left it already, or in a child forked inside the block (leaving there
    would hand back, or delete, the parent's state)."""
    for k, (h, _, pid) in enumerate(_OPEN):
        if h is handle:
            del _OPEN[k]
            return pid == os.getpid()
    return False


@contextmanager
def offload(optimizer: torch.optim.Optimizer,
            config: "str | os.PathLike | dict | Settings | None" = None, *,
            model: torch.nn.Module | None = None, name: str = "default",
            resume: bool = False, process_group: Any = None,
            streams: Any = None) -> Iterator[Offload]:
    """Keep `optimizer`'s state in tiers for the duration of the block: Adam/AdamW, the
    rest of torch.optim with per-parameter state, and third-party optimizers through the
    generic path (docs/guide/optimizers.md says which are refused).

    config: YAML path, dict of the same shape, Settings, or None for the defaults.
    model: gives parameter names to placement rules. name: the swap
    sub-directory (`<swap path>/tiermem-<name>`), so concurrent runs can share a path.
    resume: continue from state an earlier block kept on disk (its exit said so);
    `tm.resumed_step` tells the step it had reached.
    process_group: under torch.distributed (this group, else the default one when it is
    initialised, or FSDP2 DTensor parameters) each rank tiers only its share of the state
    (docs/guide/distributed.md).
    streams: the stream backend of the host<->device lanes (and of the parameter tier's
    copies, with parameters.offload); None picks CUDA streams for CUDA parameters. `tiermem.device.lanes.DeferredBackend()` makes CPU parameters count
    as device ones and runs every device path on the CPU (tests, smoke runs).
    """
    if isinstance(optimizer, torch.nn.Module):  # before unwrap(), which would fail obscurely
        check_arguments(optimizer, model, Settings(), name)
    given = optimizer
    optimizer, unwrapped = unwrap(optimizer)  # AcceleratedOptimizer, LightningOptimizer
    settings = load_config(config)
    check_arguments(optimizer, model, settings, name)
    # A block that kept this optimizer's state on disk made opt.step() raise; a new block
    # lifts that (resume continues the state; a fresh start is what the user asked for).
    kept = forget_kept(optimizer)
    try:
        if sharded.wanted(optimizer, process_group):  # each rank tiers its share only
            if settings.parameters.offload != "none":
                raise TierMemError("parameters.offload is not supported under "
                                   "torch.distributed yet; set parameters.offload: none")
            refuse_non_contiguous_shared(optimizer)
            check_swap_paths(settings)
            handle: Offload = sharded.DistributedOffload(optimizer, settings, model=model,
                                                         name=name, resume=resume,
                                                         process_group=process_group,
                                                         streams=streams)
        else:
            settings = sharded.rank_paths(settings, 0, 0)  # {rank} / {local_rank} in one process
            check_swap_paths(settings)
            if resume:
                why = explain_run_dir(settings, name, resume=True)
                if why:  # no manifest: read_manifest would only say it is missing
                    raise TierMemError(f"cannot resume: manifest.json does not exist; {why}")
            try:
                handle = Offload(OffloadedOptimizer(optimizer, settings, model=model,
                                                    swap_name=name, resume=resume,
                                                    streams=streams))
            except StaleSwapError as exc:
                why = explain_run_dir(settings, name, resume=resume)
                if why is None:
                    raise
                raise StaleSwapError(why) from exc
    except BaseException:
        if kept is not None and kept_dir(optimizer) is None and installed(optimizer) is None:
            put_kept(optimizer, kept)  # a refused block leaves the guard as it was
        raise
    handle.unwrapped = unwrapped
    # parameters.offload routes zero_grad too (the tier's gradients); schedule-free has more
    unroute = route_wrappers(given, optimizer, (*HOOKED, "zero_grad", *getattr(
        installed(optimizer), "state_methods", ())))
    where = caller()
    ACTIVE[optimizer] = f"name={name!r}, opened at {where}"
    if not _OPEN:  # (again) at each first open block: atexit runs the latest first, so
        # a handler the user registered before the block sees it left
        atexit.unregister(_leave_open_blocks)
        atexit.register(_leave_open_blocks)
    _OPEN.append((handle, where, os.getpid()))
    with terminate_as_exception():
        try:
            yield handle
        except BaseException as exc:
            if not _still_open(handle):
                raise  # left by the exit hook (this is the generator's finalisation), or forked
            with held():  # the state is never left half moved
                handle.leave(exc)
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM as Terminated
                print(f"tiermem: interrupted ({exc or 'SIGINT'}); {handle.where_state_is()}",
                      file=sys.stderr)
            raise
        else:
            if _still_open(handle):
                with held():
                    handle.leave(None)
        finally:
            unroute()
            ACTIVE.pop(optimizer, None)
