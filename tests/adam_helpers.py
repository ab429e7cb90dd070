"""Helpers the native-kernel tests share: pinning one SIMD path, comparing bit patterns."""

from __future__ import annotations

import contextlib

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


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaNs and signed zeros compare exactly."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)
