"""Helpers the native-kernel tests share: pinning one SIMD path, whose threads a call runs
on, comparing bit patterns."""

from __future__ import annotations

import contextlib
import threading

import torch

from tiermem.kernels import native_adam as na


@contextlib.contextmanager
def isa(name: str):
    """Run the block on one SIMD path ("avx512", "avx2", "scalar"), then back to auto."""
    na.set_isa(name)
    try:
        yield
    finally:
        na.set_isa("auto")


def on_team_and_pool(run):
    """run() once as it comes (OpenMP's team for a main-thread call, when built with it)
    and once on tiermem's own threads (native_adam.set_threads("pool")): (team, pool)."""
    team = run()
    na.set_threads("pool")
    try:
        pool = run()
    finally:
        na.set_threads("auto")
    return team, pool


def on_another_thread(run):
    """run()'s result, run on a thread of its own (not the main one: native calls from
    there use tiermem's own threads, never OpenMP's team)."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(run()))
    worker.start()
    worker.join()
    return out[0]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaNs and signed zeros compare exactly."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """The one bitwise comparison of the suite: same dtype, shape and bit pattern of every
    element (NaN payloads and the sign of zero included)."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        same = bits(a.contiguous()) == bits(b.contiguous())
    else:
        same = a == b
    if not bool(same.all()):
        diff = (~same).reshape(-1).nonzero()
        first = diff[0].item()
        big = (a.double() - b.double()).abs().max() if a.is_floating_point() else None
        raise AssertionError(
            f"{what}: {diff.numel()} of {a.numel()} elements differ, first at {first}: "
            f"{a.reshape(-1)[first].item()!r} vs {b.reshape(-1)[first].item()!r}"
            + (f" (max abs diff {float(big):.3g})" if big is not None else ""))
