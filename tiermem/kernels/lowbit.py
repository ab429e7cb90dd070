"""Adam/AdamW on 8-bit blockwise moments (optimizer.state_dtype: int8), and the weight
formats of bf16 / fp16 models without an fp32 master (optimizer.master_weights), with
int8, fp32 or bf16 moments.

One segment's update, one keyword-only signature, two kernels behind `lowbit_update`:

- "native": native/adam_lowbit.c (AVX-512 or scalar, threaded), one pass that
  dequantises, updates and quantises, and can return the CRC32C of what it wrote;
- "reference": the same arithmetic in plain torch (fp32 operations, each correctly
  rounded: fused multiply-adds and sqrt emulated through round-to-odd in float64), bit for bit
  the native result. Tests hold the native kernel to it; it also runs wherever the
  native kernel cannot (tensors off the CPU).

The format (native/adam_lowbit.c has the full rationale): blocks of BLOCK = 256
elements, a block starting at each segment's element 0, one fp32 scale per block and
moment (the power of two that puts the block's largest finite magnitude in
(0.9375, 1.875], so a dequantised block quantises back to itself), one byte per
element: exp_avg
sign + 4-bit exponent + 3-bit mantissa, exp_avg_sq 5-bit exponent + 3-bit mantissa;
code 0 is zero, code 1 NaN (any non-finite moment). `quantize` / `dequantize` convert a
segment between fp32 and that format; `segment_values` / `store_segment` do it for one
segment of a record (state_dict(), load_state_dict(), tiermem recover and DCP checkpoints
use them).

Dense moments (exp_avg / exp_avg_sq fp32 or bf16 tensors, no scales: master_weights
kahan/none with state_dtype fp32 or bf16) run the same pass and the same weight
arithmetic; only the moments' load and store differ. bf16 moments are rounded as the
codes are: to nearest even, or stochastically with the low (exp_avg) and high
(exp_avg_sq) 16 bits of the same stream. The moments' format is their tensors' dtype.
Dense moments take amsgrad too (max_exp_avg_sq in their format, rounded with
exp_avg_sq's bits).

The weights without a master are bf16 or fp16 (the param's dtype; a Kahan term has
it too). fp16 ones round to nearest even as IEEE does (subnormals, overflow to inf;
NaN the canonical 0x7E00), a Kahan term is 0 where the weight overflowed, and
stochastic rounding to fp16 (`f16_stochastic`) follows fp16's spacing into its
subnormals (native/adam_lowbit.c has the definition).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch
from torch import Tensor

from tiermem.kernels.native_rules import check_tensor, native_threads
from tiermem.partition import QUANT_BLOCK, SCALE_OF

BLOCK = QUANT_BLOCK  # 256: divides CUT_ALIGN, so a partition cut never splits a block
TOP = 1.875  # the largest code's value
M_EBIAS, V_EBIAS = 112, 96  # 127 - exponent bias of exp_avg's / exp_avg_sq's code
NAN_CODE = 1
MASTERS = {"fp32": 0, "kahan": 1, "none": 2}
GRAD_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the moments' tensor dtype -> native/adam_lowbit.c's moment_dtype
MOMENT_FORMATS = {torch.uint8: 0, torch.float32: 1, torch.bfloat16: 2}
OUT_DTYPES = {torch.bfloat16: 1, torch.float16: 2}
# master_weights kahan/none: the weights' (and the Kahan term's) dtype -> weight_dtype
LOW_WEIGHTS = {torch.bfloat16: 1, torch.float16: 2}
ROUNDINGS = ("nearest", "stochastic")
# crc_mask bits of the arrays the native pass can checksum
CRC_ARRAYS = {"master": 1, "exp_avg": 2, "exp_avg_scale": 4, "exp_avg_sq": 8,
              "exp_avg_sq_scale": 16, "kahan": 32}
W_KEY = 0xA511E9B3
M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
FLT_MIN = 2.0 ** -126


def blocks(n: int) -> int:
    """Scale entries of an n-element segment."""
    return -(-n // BLOCK)


# -- the reference ---------------------------------------------------------------------

def _f32(x: float) -> Tensor:
    return torch.tensor(x, dtype=torch.float64).float()


def fma32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fp32 a*b + c rounded once: the product is exact in float64, the sum is made
    round-to-odd there (TwoSum gives its error), and a round-to-odd float64 rounds to
    the correctly rounded fp32 (53 >= 24 + 2 bits)."""
    p = a.double() * b.double()
    c = c.double().expand_as(p)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _mul32(x: Tensor, c: int) -> Tensor:
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def _weyl(idx: Tensor, k0: int) -> Tensor:
    """numeric.h's sr_weyl: the Weyl step idx * SR_W + k0 mod 2^32 that sr_bits mixes and
    code_bits takes as it is."""
    return (_mul32(idx & M32, 0x9E3779B1) + k0) & M32


def sr_bits(idx: Tensor, k0: int, k1: int) -> Tensor:
    """numeric.h's sr_bits on int64 indices (taken mod 2^32)."""
    x = _weyl(idx, k0)
    x ^= x >> 16
    x = _mul32(x, 0x7FEB352D)
    x ^= x >> 15
    x ^= k1
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def code_bits(idx: Tensor, k0: int, k1: int) -> Tensor:
    """native/adam_lowbit.c's code_bits, the int8 codes' random bits: sr_bits' Weyl step x
    unmixed, exp_avg the top half of x (in the low 16 bits), exp_avg_sq that of x + k1."""
    x = _weyl(idx, k0)
    return (x >> 16) | ((x + k1) & 0xFFFF0000)


def _keys(seed: int, offset: int) -> tuple[int, int]:
    key = splitmix64(seed ^ splitmix64(offset >> 32))
    return key & M32, key >> 32


def _as_f32(bits: Tensor) -> Tensor:
    return (((bits & M32) ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)


def _per_element(scale: Tensor, n: int) -> Tensor:
    return scale.repeat_interleave(BLOCK)[:n]


def dequantize(codes: Tensor, scale: Tensor, *, signed: bool) -> Tensor:
    """fp32 values of one segment's codes (exp_avg: signed, exp_avg_sq: not)."""
    c = codes.view(torch.uint8).to(torch.int64)
    mag = c & 0x7F if signed else c
    bits = torch.where(mag >= 8, (mag << 20) + ((M_EBIAS if signed else V_EBIAS) << 23), 0)
    if signed:
        bits = bits | ((c & 0x80) << 24)
    bits = torch.where(mag == NAN_CODE, 0x7FC00000, bits)
    return _as_f32(bits) * _per_element(scale.float(), c.numel())


def segment_values(views: dict[str, Tensor], slices: dict[str, list[slice]], kind: str,
                   n: int) -> Tensor:
    """Segment n of a record's `kind` (views, slices: Partition.views() and each kind's
    Partition.slices()) as values: an int8 moment's codes (its scales' kind in the record)
    dequantised exactly with their block scales, any other kind its view."""
    value = views[kind][slices[kind][n]]
    scale = SCALE_OF.get(kind)
    if scale not in views:
        return value
    return dequantize(value, views[scale][slices[scale][n]], signed=kind == "exp_avg")


def store_segment(views: dict[str, Tensor], slices: dict[str, list[slice]], kind: str, n: int,
                  values: Tensor) -> None:
    """`values` into segment n of a record's `kind`: an int8 moment quantised to nearest
    (its blocks start at the segment's element 0) with its block scales, any other kind
    copied (copy_ casts: bf16 rounds to nearest even)."""
    scale = SCALE_OF.get(kind)
    if scale not in views:
        views[kind][slices[kind][n]].copy_(values)
        return
    codes, sc = quantize(values, signed=kind == "exp_avg")
    views[kind][slices[kind][n]].copy_(codes)
    views[scale][slices[scale][n]].copy_(sc)


def _scales(x: Tensor) -> tuple[Tensor, Tensor]:
    n = x.numel()
    a = x.abs()
    a = torch.where(a < math.inf, a, 0.0)  # NaN compares false: dropped too
    a = torch.nn.functional.pad(a, (0, blocks(n) * BLOCK - n)).view(-1, BLOCK)
    amax = a.amax(dim=1) if n else a.new_zeros(0)
    s = _as_f32(amax.view(torch.int32).to(torch.int64) & 0x7F800000)
    s = torch.where((amax > TOP * s) & (s < 2.0 ** 127), s * 2, s)
    s = torch.where(amax >= FLT_MIN, s, 0.0)
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    return s, inv


def _encode(x: Tensor, inv: Tensor, r16: Tensor | None, *, signed: bool) -> Tensor:
    n = x.numel()
    ax = x.abs()
    a = ax * _per_element(inv, n)
    u = a.view(torch.int32).to(torch.int64)
    ebias = M_EBIAS if signed else V_EBIAS
    t = u - (ebias << 23)
    rnd = (r16 << 4) | 8 if r16 is not None else 0x7FFFF + ((t >> 20) & 1)
    cn = torch.clamp((t + rnd) >> 20, max=0x7F if signed else 0xFF)
    if signed:
        thr = ((65535.5 - r16.float()) * 2.0 ** -16 if r16 is not None
               else torch.tensor(0.5))
        low = torch.where(a * 2.0 ** 14 >= thr, 8, 0)
    else:
        low = torch.where(a > 0, 8, 0)  # up, never to 0
    c = torch.where(u >= ((ebias + 1) << 23), cn, low)
    if signed:
        c = c | torch.where((x < 0) & (c != 0), 0x80, 0)  # zero is stored +0
    c = torch.where(ax < math.inf, c, NAN_CODE)
    return c.to(torch.uint8)


def quantize(x: Tensor, *, signed: bool, rounding: str = "nearest", seed: int = 0,
             offset: int = 0, high: bool = False) -> tuple[Tensor, Tensor]:
    """(codes, scales) of one segment's fp32 values; stochastic rounding draws the
    low (`high` False: exp_avg) or high 16 bits of code_bits(offset + i)."""
    x = x.float().reshape(-1)
    s, inv = _scales(x)
    r16 = None
    if rounding == "stochastic":
        k0, k1 = _keys(seed, offset)
        r = code_bits(torch.arange(x.numel(), dtype=torch.int64) + (offset & M32), k0, k1)
        r16 = r >> 16 if high else r & 0xFFFF
    return _encode(x, inv, r16, signed=signed), s


def adam_lowbit_reference(*, param: Tensor, grad: Tensor, exp_avg: Tensor,
                          exp_avg_scale: Tensor | None = None, exp_avg_sq: Tensor,
                          exp_avg_sq_scale: Tensor | None = None, kahan: Tensor | None = None,
                          max_exp_avg_sq: Tensor | None = None,
                          weight_out: Tensor | None = None, master: str = "fp32",
                          step: float | int | Tensor, lr: float | Tensor, beta1: float,
                          beta2: float, eps: float, weight_decay: float = 0.0,
                          maximize: bool = False, decoupled_weight_decay: bool = True,
                          rounding: str = "stochastic", seed: int = 0, offset: int = 0,
                          checksums: Sequence[str] = (), num_threads: int | None = None
                          ) -> dict[str, int]:
    """The update in plain torch, on any device; every tensor updated in place."""
    _check_args(master, rounding, kahan, weight_out, param)
    dense = _check_moments(exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale,
                           max_exp_avg_sq)
    if checksums:
        raise ValueError("checksums: the reference kernel computes none; hash the record")
    step = float(step.item() if isinstance(step, Tensor) else step)
    lr = float(lr)
    n = param.numel()
    if n == 0:
        return {}
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    c1 = _f32(1.0 - beta1)
    c1m1 = c1 - 1.0
    small = bool(c1.abs() < 0.5)
    b2, c2 = _f32(beta2), _f32(1.0 - beta2)
    bc2s, eps32, nss = _f32(math.sqrt(bc2)), _f32(eps), _f32(-(lr / bc1))
    wd, decay = _f32(weight_decay), _f32(1.0 - lr * weight_decay)
    g = grad.reshape(-1).float()
    p = param.reshape(-1).float()
    if master == "kahan":
        p = p + kahan.reshape(-1).float()
    if dense:
        m, v = exp_avg.reshape(-1).float(), exp_avg_sq.reshape(-1).float()
    else:
        m = dequantize(exp_avg, exp_avg_scale, signed=True)
        v = dequantize(exp_avg_sq, exp_avg_sq_scale, signed=False)
    if maximize:
        g = -g
    if weight_decay != 0.0:
        if decoupled_weight_decay:
            p = p * decay
        else:
            g = fma32(p, wd.expand_as(p), g)
    d = g - m
    m = fma32(c1.expand_as(d), d, m) if small else fma32(c1m1.expand_as(d), d, g)
    cg = c2 * g
    v = fma32(cg, g, v * b2)
    vv = v
    if max_exp_avg_sq is not None:  # amsgrad: NaN if either is, as the kernels' max
        vv = torch.where(torch.isnan(v) | torch.isnan(max_exp_avg_sq.reshape(-1).float()),
                         math.nan, torch.maximum(max_exp_avg_sq.reshape(-1).float(), v))
    # torch's fp32 sqrt is not correctly rounded on every CPU build; float64's is, and
    # rounding it to fp32 is then too (53 >= 2 * 24 + 2 bits).
    root = torch.sqrt(vv.double()).float()
    if dense:  # adam.c's step
        p = p + (nss * m) / (root / bc2s + eps32)
    else:  # int8 moments: the bias corrections folded into one division (adam_lowbit.c)
        p = p + (_f32(-(lr / bc1) * math.sqrt(bc2)) * m) / (root + _f32(eps * math.sqrt(bc2)))
    idx = torch.arange(n, dtype=torch.int64, device=p.device) + (offset & M32)
    k0, k1 = _keys(seed, offset)
    if master == "fp32":
        param.view(-1).copy_(p)
        if weight_out is not None:  # to nearest even, as the kernel writes it
            weight_out.view(-1).copy_(bf16_nearest(p) if weight_out.dtype == torch.bfloat16
                                      else p)
    elif master == "kahan":
        nb = low_nearest(p, param.dtype)
        param.view(-1).copy_(nb)
        kahan.view(-1).copy_(kahan_term(p, nb))
    else:
        rw = sr_bits(idx, k0 ^ W_KEY, k1) & 0xFFFF
        param.view(-1).copy_(bf16_stochastic(p, rw) if param.dtype == torch.bfloat16
                             else f16_stochastic(p, rw))
    r = None
    if rounding == "stochastic":  # bf16 moments: sr_bits; int8 codes: code_bits
        r = (sr_bits if dense else code_bits)(idx, k0, k1)
    if dense:
        pairs = [(exp_avg, m, 0), (exp_avg_sq, v, 16)]
        if max_exp_avg_sq is not None:  # rounded with exp_avg_sq's bits: stays >= it
            pairs.append((max_exp_avg_sq, vv, 16))
        for dst, x, shift in pairs:
            if dst.dtype == torch.float32:
                dst.view(-1).copy_(x)
            elif r is None:
                dst.view(-1).copy_(bf16_nearest(x))
            else:
                dst.view(-1).copy_(bf16_stochastic(x, (r >> shift) & 0xFFFF))
        return {}
    sm, im = _scales(m)
    sv, iv = _scales(v)
    exp_avg.view(-1).copy_(_encode(m, im, r & 0xFFFF if r is not None else None, signed=True))
    exp_avg_sq.view(-1).copy_(_encode(v, iv, r >> 16 if r is not None else None,
                                      signed=False))
    exp_avg_scale.copy_(sm)
    exp_avg_sq_scale.copy_(sv)
    return {}


def bf16_nearest(x: Tensor) -> Tensor:
    """x to bf16, nearest even, every NaN the canonical 0x7FC0 (torch's vector
    conversion keeps a NaN's sign)."""
    return torch.where(torch.isnan(x), _BF16_NAN, x.to(torch.bfloat16))


_BF16_NAN = torch.tensor(0x7FC0, dtype=torch.int16).view(torch.bfloat16)


_F16_NAN = torch.tensor(0x7E00, dtype=torch.int16).view(torch.float16)


def f16_nearest(x: Tensor) -> Tensor:
    """x to fp16, nearest even (IEEE: subnormals, overflow to inf), every NaN 0x7E00."""
    return torch.where(torch.isnan(x), _F16_NAN, x.to(torch.float16))


def low_nearest(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x to bf16 or fp16, nearest even, canonical NaN."""
    return bf16_nearest(x) if dtype == torch.bfloat16 else f16_nearest(x)


def kahan_term(p: Tensor, weight: Tensor) -> Tensor:
    """The compensation term of fp32 value p beside its rounded weight (bf16 or fp16):
    p - weight rounded to nearest in the weight's dtype; an fp16 term is 0 where the
    weight overflowed to inf (p - inf would make the next p + term NaN)."""
    c = low_nearest(p - weight.float(), weight.dtype)
    if weight.dtype == torch.float16:
        c = torch.where(torch.isinf(weight), torch.zeros_like(c), c)
    return c


def f16_stochastic(x: Tensor, r16: Tensor) -> Tensor:
    """x rounded to fp16 with 16 random bits, as native/adam_lowbit.c's f16w_sr: the
    fraction of an fp16 spacing x lies above the fp16 value toward zero from it (cut to 16
    bits) plus r16 carries 1 or 0 into that value; 2^-24 spacing below 2^-14; from 65536
    on, inf; NaN 0x7E00."""
    u = x.view(torch.int32).to(torch.int64) & M32
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    e = a >> 23
    normal = a >= 0x38800000
    sh = torch.where(normal, 13, torch.clamp(126 - e, max=40))
    m24 = torch.where(e > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    base = torch.where(normal, (a - (112 << 23)) >> 13, m24 >> sh)
    rem = torch.where(normal, a & 0x1FFF, m24 & ((1 << sh) - 1))
    q = torch.where(sh >= 16, rem >> torch.clamp(sh - 16, min=0),
                    rem << torch.clamp(16 - sh, min=0))
    h = base + ((q + r16) >> 16)
    h = torch.where(a >= 0x47800000, 0x7C00, h) | sign
    h = torch.where(a > 0x7F800000, 0x7E00, h)
    return ((h ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16)


def bf16_stochastic(x: Tensor, r16: Tensor) -> Tensor:
    """x + 16 random bits, truncated to bf16 (NaN: 0x7FC0), as numeric.h rounds."""
    u = x.view(torch.int32).to(torch.int64) & M32
    h = ((u + r16) >> 16) & 0xFFFF
    h = torch.where(torch.isnan(x), 0x7FC0, h)
    return ((h ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)


def _check_moments(exp_avg: Tensor, exp_avg_sq: Tensor, exp_avg_scale: Tensor | None,
                   exp_avg_sq_scale: Tensor | None, max_exp_avg_sq: Tensor | None = None
                   ) -> bool:
    """Whether the moments are dense (fp32 or bf16 values, no scales) rather than int8
    codes with their block scales; refuse a mix, and amsgrad's max beside int8 codes."""
    if exp_avg.dtype not in MOMENT_FORMATS or exp_avg_sq.dtype != exp_avg.dtype:
        raise TypeError(f"exp_avg, exp_avg_sq: expected both uint8 (int8 codes), float32 or "
                        f"bfloat16, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    dense = exp_avg.dtype != torch.uint8
    scales = (exp_avg_scale is not None, exp_avg_sq_scale is not None)
    if scales != (not dense, not dense):
        raise ValueError("exp_avg_scale, exp_avg_sq_scale: int8 codes need both, "
                         f"{exp_avg.dtype} moments take neither")
    if max_exp_avg_sq is not None and (not dense or max_exp_avg_sq.dtype != exp_avg.dtype):
        raise ValueError(f"max_exp_avg_sq: amsgrad runs with fp32 or bf16 moments, in their "
                         f"dtype ({exp_avg.dtype}), got {max_exp_avg_sq.dtype}")
    return dense


def _check_args(master: str, rounding: str, kahan: Tensor | None, weight_out: Tensor | None,
                param: Tensor) -> None:
    if master not in MASTERS:
        raise ValueError(f"master: {master!r}; expected one of {', '.join(MASTERS)}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: {rounding!r}; expected one of {', '.join(ROUNDINGS)}")
    if (master == "kahan") != (kahan is not None):
        raise ValueError("kahan: the compensation term goes with master='kahan' only")
    if master == "fp32" and param.dtype != torch.float32:
        raise TypeError(f"param: master='fp32' updates an fp32 tensor, got {param.dtype}")
    if master != "fp32":
        if param.dtype not in LOW_WEIGHTS:
            raise TypeError(f"param: master={master!r} updates bf16 or fp16 weights, got "
                            f"{param.dtype}")
        if kahan is not None and kahan.dtype != param.dtype:
            raise TypeError(f"kahan: the compensation term of {param.dtype} weights is "
                            f"{param.dtype}, got {kahan.dtype}")
        if weight_out is not None:
            raise ValueError(f"weight_out: master={master!r} updates the weights themselves")


# -- the native kernel -----------------------------------------------------------------

def _ptr(ffi, t: Tensor | None, ctype: str):
    return ffi.NULL if t is None else ffi.cast(ctype, t.data_ptr())


def adam_lowbit_native(*, param: Tensor, grad: Tensor, exp_avg: Tensor,
                       exp_avg_scale: Tensor | None = None, exp_avg_sq: Tensor,
                       exp_avg_sq_scale: Tensor | None = None,
                       kahan: Tensor | None = None, max_exp_avg_sq: Tensor | None = None,
                       weight_out: Tensor | None = None,
                       master: str = "fp32", step: float | int | Tensor, lr: float | Tensor,
                       beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                       maximize: bool = False, decoupled_weight_decay: bool = True,
                       rounding: str = "stochastic", seed: int = 0, offset: int = 0,
                       checksums: Sequence[str] = (), num_threads: int | None = None
                       ) -> dict[str, int]:
    """native/adam_lowbit.c on one segment; returns {array: CRC32C} for `checksums`
    (names among CRC_ARRAYS; "master" is `param`, "kahan" the compensation term)."""
    from tiermem._lib import ffi, lib
    from tiermem.kernels import native_adam  # the ISA choice (TIERMEM_ADAM_ISA) is shared

    native_adam.isa()  # applies TIERMEM_ADAM_ISA before the first call
    _check_args(master, rounding, kahan, weight_out, param)
    dense = _check_moments(exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale,
                           max_exp_avg_sq)
    n = param.numel()
    check_tensor(param, "param", (param.dtype,), n)
    check_tensor(grad, "grad", tuple(GRAD_DTYPES), n)
    check_tensor(exp_avg, "exp_avg", (exp_avg.dtype,), n)
    check_tensor(exp_avg_sq, "exp_avg_sq", (exp_avg.dtype,), n)
    if max_exp_avg_sq is not None:
        check_tensor(max_exp_avg_sq, "max_exp_avg_sq", (exp_avg.dtype,), n)
    if not dense:
        check_tensor(exp_avg_scale, "exp_avg_scale", (torch.float32,), blocks(n))
        check_tensor(exp_avg_sq_scale, "exp_avg_sq_scale", (torch.float32,), blocks(n))
    if kahan is not None:
        check_tensor(kahan, "kahan", (param.dtype,), n)
    if weight_out is not None:
        check_tensor(weight_out, "weight_out", tuple(OUT_DTYPES), n)
    for name, value in (("seed", seed), ("offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= M64:
            raise ValueError(f"{name}: expected an integer in 0..2**64-1, got {value!r}")
    mask = 0
    for name in checksums:
        if name not in CRC_ARRAYS:
            raise ValueError(f"checksums: unknown array {name!r}; expected some of "
                             f"{', '.join(CRC_ARRAYS)}")
        if dense and name.endswith("_scale"):
            raise ValueError(f"checksums: {exp_avg.dtype} moments have no {name}")
        mask |= CRC_ARRAYS[name]
    step = float(step.item() if isinstance(step, Tensor) else step)
    if n and step < 1:
        raise ValueError(f"step must be the count after this step's increment (>= 1), "
                         f"got {step}")
    crcs = ffi.new("uint32_t[6]")
    rc = lib.tm_adam_lowbit_step(
        _ptr(ffi, param, "void *"), MASTERS[master], LOW_WEIGHTS.get(param.dtype, 0),
        _ptr(ffi, kahan, "uint16_t *"),
        MOMENT_FORMATS[exp_avg.dtype], _ptr(ffi, exp_avg, "void *"),
        _ptr(ffi, exp_avg_scale, "float *"), _ptr(ffi, exp_avg_sq, "void *"),
        _ptr(ffi, exp_avg_sq_scale, "float *"), _ptr(ffi, max_exp_avg_sq, "void *"),
        _ptr(ffi, grad, "void *"), GRAD_DTYPES[grad.dtype], _ptr(ffi, weight_out, "void *"),
        OUT_DTYPES[weight_out.dtype] if weight_out is not None else 0, n, float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), step, int(maximize),
        int(decoupled_weight_decay), int(rounding == "stochastic"), seed, offset,
        native_threads(num_threads), mask, crcs)
    if rc == -34:  # ERANGE
        raise ValueError(f"offset {offset} + {n} elements crosses a 2^32-element window of "
                         "the random stream; split the call there")
    if rc != 0:
        raise RuntimeError(f"tm_adam_lowbit_step failed: {os.strerror(-rc)}")
    return {name: crcs[bit.bit_length() - 1] for name, bit in CRC_ARRAYS.items()
            if mask & bit}


KERNELS = {"native": adam_lowbit_native, "reference": adam_lowbit_reference}


def lowbit_update(*, kernel: str, **kwargs) -> dict[str, int]:
    """Run `kernel` ("native" or "reference") on one segment."""
    return KERNELS[kernel](**kwargs)
