"""What the native SGD and Adagrad kernels (native/rules.c, kernels/sgd.py and
kernels/adagrad.py) share: argument checks, the CRC mask, the thread count and the
tail torch's fused kernels update in their scalar loop."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from tiermem._lib import lib
from tiermem.kernels.checksum import combine, crc32c

ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}

# Elements per vector of torch's fused CPU kernels at each capability it dispatches to:
# the last numel % width elements of a tensor go through its scalar loop.
_WIDTH = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}


def vector_width() -> int:
    return _WIDTH.get(torch.backends.cpu.get_cpu_capability(), 8)


def tail_length(n: int) -> int:
    return n % vector_width()


def set_isa(name: str) -> bool:
    """Force the SIMD path of rules.c ("scalar", "avx2", "avx512", or "auto" for the
    best): False when this CPU lacks it. All paths give the same bits."""
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}; expected one of {', '.join(ISAS)}")
    return bool(lib.tm_rules_set_isa(ISAS[name]))


def native_threads(num_threads: int | None = None) -> int:
    """The threads a pass runs on: `num_threads`, else torch's count."""
    return max(1, torch.get_num_threads() if num_threads is None else int(num_threads))


def check_tensor(t: Tensor, what: str, dtypes: Sequence[torch.dtype], n: int) -> None:
    """What every native kernel needs of an array it reads or updates in place: a
    contiguous CPU tensor of one of `dtypes` with `n` elements, outside autograd."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    if not t.is_cpu:  # (t.device builds a device object: 5x the time, 140 times a step)
        raise ValueError(f"{what}: the native kernels run on CPU tensors, got one on "
                         f"{t.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{what}: dtype {t.dtype} not supported here (the native kernel "
                        f"takes {' or '.join(str(d) for d in dtypes)} CPU tensors)")
    if not t.is_contiguous():
        raise ValueError(f"{what}: must be contiguous (got strides {tuple(t.stride())})")
    if t.numel() != n:
        raise ValueError(f"{what}: has {t.numel()} elements, the parameters have {n}")
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{what}: updated in place outside autograd; call under "
                           "torch.no_grad() or pass a detached tensor")


def check_native(t: Tensor, what: str, n: int) -> None:
    """An fp32 array of the SGD/Adagrad kernels."""
    check_tensor(t, what, (torch.float32,), n)


def refuse_checksums(impl: str, checksums: Sequence[str]) -> None:
    """torch's kernels update in place and return nothing: the CRCs of a record's arrays
    in the same pass come only from the native kernels."""
    if checksums:
        raise ValueError(f"kernel {impl!r} cannot compute checksums in its pass; only "
                         "the native kernel can")


def crc_arrays(checksums: Sequence[str], *, state: str | None) -> int:
    """The C kernels' crc_mask for `checksums` (bit 1: the state, bit 2: the params)."""
    mask = 0
    for name in checksums:
        if name == "params":
            mask |= 2
        elif state is not None and name == state:
            mask |= 1
        else:
            allowed = ", ".join(x for x in (state, "params") if x)
            raise ValueError(f"checksums: unknown array {name!r}; expected some of {allowed}")
    return mask


def with_tail_crcs(mask: int, crcs, body: int, arrays: dict[str, Tensor | None]
                   ) -> dict[str, int]:
    """The segment's CRCs: the kernel's over [0, body), continued over the tail torch
    updated."""
    out = {}
    for bit, (name, t) in zip((1, 2), arrays.items()):
        if mask & bit and t is not None:
            c = crcs[bit - 1]
            if body < t.numel():
                c = combine(c, crc32c(t[body:]), (t.numel() - body) * 4)
            out[name] = c
    return out
