"""Resolve MKL VML's kernel dispatch before any update runs (pytorch/pytorch#188792).

torch sends contiguous float unary ops (sqrt, exp, log, ...) to MKL VML, each intra-op
thread calling it on its chunk. oneMKL 2024.2 (what torch's CPU wheels bundle) picks each
VML function's kernel lazily on that function's first call; when that first call runs on
two threads at once, one of them can run a low-accuracy kernel for its whole chunk, though
high accuracy was asked for. Seen here: in a fresh process, the first Adam step on a
5120-element record (two chunks of 2560 on two threads) put sqrt(v) 1e-4 off in one
half, so the master weights drifted ~1e-6 from torch's, about once in two hundred
processes. A one-element call of each function per dtype runs on the calling thread alone
(below torch's grain size) and settles the dispatch for every later call.
"""

from __future__ import annotations

import functools

import torch

# The unary ops torch routes to VML for float32/float64 (aten/src/ATen/cpu/vml.h).
VML_OPS = ("sqrt", "exp", "expm1", "log", "log10", "log1p", "sin", "cos", "tan", "sinh",
           "cosh", "tanh", "asin", "acos", "atan", "erf", "erfc", "erfinv", "lgamma")


@functools.cache
def resolve_vml_dispatch() -> tuple[str, ...]:
    """Call each VML op once on one element of float32 and float64, on this thread alone,
    so no later multithreaded call is a function's first. Returns the ops called (none
    where torch was built without MKL). Runs once per process."""
    if not torch.backends.mkl.is_available():
        return ()
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)  # inside every op's domain
        for name in VML_OPS:
            getattr(torch, name)(one)
    return VML_OPS
