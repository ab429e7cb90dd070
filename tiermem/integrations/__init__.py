"""Glue between `tiermem.offload` and training frameworks: one module per framework.

Importing `tiermem.integrations` imports no framework; `tiermem.integrations.lightning`
needs `lightning`, `tiermem.integrations.transformers` needs `transformers`. Accelerate
needs no module: `tiermem.offload` takes its `AcceleratedOptimizer` as it is
(tiermem/optim/wrappers.py). docs/guide/integrations/ has one page per framework.
"""

from __future__ import annotations

import contextlib


def leave(stack: contextlib.ExitStack | None, exc: BaseException | None) -> None:
    """Leave the offload blocks a callback entered on `stack`, through their one exit, as
    the block ended: normally (exc None) or with `exc`."""
    if stack is None:
        return
    if exc is None:
        stack.__exit__(None, None, None)
    else:
        # offload's exit re-raises `exc`, which the stack reports as not handled: only an
        # error of the exit itself propagates from here.
        stack.__exit__(type(exc), exc, exc.__traceback__)
