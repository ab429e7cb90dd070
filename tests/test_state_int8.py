"""optimizer.state_dtype: int8 — blockwise 8-bit moments — and optimizer.master_weights
(kahan / none, with int8, fp32 or bf16 moments: table-driven over MOMENTS).

1. the native kernel (native/adam_lowbit.c) equals the plain-torch reference
   (tiermem.kernels.lowbit.adam_lowbit_reference) bit for bit on every path this CPU
   has (AVX-512, AVX2, scalar), over hypothesis-drawn lengths (tails), offsets, seeds,
   thread counts and values (zeros, huge and tiny magnitudes, NaN and inf gradients); the
   code itself:
   round trips, bounds, unbiased stochastic rounding, NaN policy;
2. tiermem.offload with int8 state on both I/O backends, host and NVMe partitions: the
   model and its state equal the reference run segment by segment;
3. state_dict() / load_state_dict(), resume, recover, config errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from tiermem.kernels import lowbit as lb
from tiermem.kernels import native_adam as na

from adam_helpers import assert_bitwise, isa, on_team_and_pool

ISAS = na.supported_isas()
# optimizer.state_dtype -> the moments' tensor dtype in kernels.lowbit (int8: codes + scales)
MOMENTS = {"int8": torch.uint8, "fp32": torch.float32, "bf16": torch.bfloat16}


def _moments(n: int, moments: str = "int8") -> dict:
    """Zero moments of n elements in `moments`' format (int8: codes and block scales)."""
    dt = MOMENTS[moments]
    int8 = moments == "int8"
    return {"exp_avg": torch.zeros(n, dtype=dt), "exp_avg_sq": torch.zeros(n, dtype=dt),
            "exp_avg_scale": torch.zeros(lb.blocks(n)) if int8 else None,
            "exp_avg_sq_scale": torch.zeros(lb.blocks(n)) if int8 else None}


def _state(n: int, master: str, gen: torch.Generator, scale: float = 1.0,
           moments: str = "int8", weights: torch.dtype = torch.bfloat16):
    """weights: the dtype of a master-less model's weights (and Kahan term)."""
    p = torch.randn(n, generator=gen) * scale
    return {
        "param": p if master == "fp32" else p.to(weights),
        **_moments(n, moments),
        "kahan": torch.zeros(n, dtype=weights) if master == "kahan" else None,
    }


def _clone(s):
    return {k: (v.clone() if v is not None else None) for k, v in s.items()}


def _grads(n, steps, gen, dtype, spread, specials):
    out = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * torch.logspace(-spread, spread, max(n, 1))[:n]
        if n:
            g[:: 7] = 0.0
            if specials:
                g[n // 2] = math.nan
                g[n // 3] = math.inf
                g[-1] = 3e38
        out.append(g.to(dtype))
    return out


def _run(kernel, state, grads, *, master, rounding, out_dtype=None, seed0=7, offset=0,
         threads=None, **hp):
    out = torch.zeros(state["param"].numel(), dtype=out_dtype) if out_dtype else None
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    kw.update(hp)
    for s, g in enumerate(grads, 1):
        lb.lowbit_update(kernel=kernel, grad=g, weight_out=out, master=master, step=s,
                         rounding=rounding, seed=seed0 + s, offset=offset, num_threads=threads,
                         **state, **kw)
    return out


def _assert_same(a, b, what):
    """Bitwise, except that an fp32 NaN is any NaN: which operand's NaN an IEEE operation
    passes on (and its sign) depends on operand order, which the C compiler may swap;
    every stored low-precision NaN is canonical (bf16 0x7FC0, the code 1)."""
    for k in a:
        if a[k] is None:
            continue
        x, y = a[k], b[k]
        if x.dtype == torch.float32:
            nan = torch.isnan(x)
            assert torch.equal(nan, torch.isnan(y)), f"{what}: {k}: NaNs differ"
            x, y = x.masked_fill(nan, 0.0), y.masked_fill(nan, 0.0)
        assert_bitwise(x, y, f"{what}: {k}")


# -- 1. kernel == reference -------------------------------------------------------------

@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("master,gdt,out", [
    ("fp32", torch.float32, None), ("fp32", torch.bfloat16, torch.bfloat16),
    ("fp32", torch.float16, torch.float16), ("kahan", torch.bfloat16, None),
    ("none", torch.bfloat16, None), ("none", torch.float32, None)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("moments", list(MOMENTS))
def test_kernel_matches_reference(name, master, gdt, out, rounding, moments):
    gen = torch.Generator().manual_seed(3)
    n = 3 * 256 + 77  # a short tail block
    state = _state(n, master, gen, moments=moments)
    ref = _clone(state)
    grads = _grads(n, 4, gen, gdt, 4, specials=False)
    with isa(name):
        o1 = _run("native", state, grads, master=master, rounding=rounding, out_dtype=out)
    o2 = _run("reference", ref, grads, master=master, rounding=rounding, out_dtype=out)
    _assert_same(state, ref, f"{name} {master} {rounding} {moments}")
    if out is not None:
        assert_bitwise(o1, o2, "weight_out")


@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("master,gdt", [("fp32", torch.float32), ("kahan", torch.bfloat16),
                                        ("none", torch.bfloat16)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("spread", [0, 2, 6])
@pytest.mark.parametrize("moments", list(MOMENTS))
def test_kernel_matches_reference_on_dense_grads(name, master, gdt, rounding, spread,
                                                 moments):
    """Gradients without zeros: most blocks have every moment finite and within the codes'
    range, where the AVX-512 pass codes them without the checks (a short cut); one block
    with a zero, a NaN and an infinity, and the short tail, take the full path."""
    gen = torch.Generator().manual_seed(11 + spread)
    n = 40 * 256 + 77
    state = _state(n, master, gen, moments=moments)
    ref = _clone(state)
    grads = []
    for _ in range(5):
        g = torch.randn(n, generator=gen) * torch.logspace(-spread, spread, n)[torch.randperm(
            n, generator=gen)]
        g[3 * 256 + 5] = 0.0
        g[9 * 256 + 1] = math.nan
        g[17 * 256 + 8] = math.inf
        grads.append(g.to(gdt))
    with isa(name):
        _run("native", state, grads, master=master, rounding=rounding, threads=2)
    _run("reference", ref, grads, master=master, rounding=rounding)
    _assert_same(state, ref, f"{name} {master} {rounding} {moments} dense grads")


# the exponent fields of block scales around the AVX-512 short cuts' limits: exp_avg's code
# values stay normal times 2^k from field 15 up (fast encode), exp_avg_sq's from 31 up (fast
# encode and decode); 254 is the largest finite, 1 and 0x7F800000 >> 23 the ends
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("master", ["kahan", "none"])
@pytest.mark.parametrize("moments", list(MOMENTS))
@pytest.mark.parametrize("scale,lr", [(1.0, 1e-2), (3e-5, 1e-6), (2e4, 3e3)])
def test_fp16_weights_match_reference(name, master, moments, scale, lr):
    """fp16 weights without a master, native == reference bit for bit: ordinary values,
    weights in fp16's subnormals (below 2^-14 = 6.1e-5), and weights stepped past 65504
    (overflow to inf; a Kahan term then 0)."""
    gen = torch.Generator().manual_seed(5)
    n = 5 * 256 + 33
    state = _state(n, master, gen, scale, moments, torch.float16)
    ref = _clone(state)
    grads = _grads(n, 4, gen, torch.float16, 3, specials=True)
    hp = dict(lr=lr, weight_decay=0.01 if lr < 1 else 0.0)  # decay 1 - lr * wd stays > 0
    with isa(name):
        _run("native", state, grads, master=master, rounding="stochastic", threads=2, **hp)
    _run("reference", ref, grads, master=master, rounding="stochastic", **hp)
    _assert_same(state, ref, f"{name} fp16 {master} {moments} x{scale}")
    if scale > 1:
        w = state["param"].float()
        assert torch.isinf(w).any() and torch.isfinite(w).any()
        if master == "kahan":
            assert (state["kahan"][torch.isinf(w)] == 0).all()


def test_fp16_stochastic_rounding():
    """f16_stochastic: fp16 values stay, every result is one of the two fp16 neighbours,
    the mean over all 2^16 random draws is the value (to 2^-15 of a spacing), subnormals
    included; between 65504 and 65536 inf with the fraction's probability, from 65536 on
    inf, NaN canonical; the native pass rounds alike."""
    vals = [0.0, -0.0, 1.0, 65504.0, -65504.0, 2.0 ** -24, 2.0 ** -14, 3 * 2.0 ** -24,
            1.5 * 2.0 ** -24, 0.3 * 2.0 ** -24, -1e-10, 0.1, -3.3e-6, 1e-3, 65519.0, 65535.0,
            65536.0, 1e6, math.inf, -math.inf, math.nan]
    r = torch.arange(1 << 16, dtype=torch.int64)
    for v in vals:
        x = torch.full((1 << 16,), v)
        v = x[0].item()  # as fp32 holds it
        h = lb.f16_stochastic(x, r)
        if math.isnan(v):
            assert (h.view(torch.int16) == 0x7E00).all()
            continue
        if abs(v) >= 65536:
            assert torch.isinf(h).all() and bool((h > 0).all()) == (v > 0)
            continue
        if torch.tensor(v).half().float().item() == v:  # an fp16 value stays
            assert (h.float() == v).all(), v
            continue
        got = sorted(set(h.float().tolist()))
        assert len(got) == 2, (v, got)
        a, b = got
        assert a < v < b and torch.nextafter(torch.tensor(a).half(),
                                             torch.tensor(b).half()).item() == b
        if math.isinf(b):  # (65504, 65536): up is inf, as often as the fraction says
            frac = (h.float() == b).double().mean().item()
            assert frac == pytest.approx((v - 65504) / 32, abs=2 ** -15)
            continue
        mean = h.double().mean().item()
        assert mean == pytest.approx(v, abs=(b - a) * 2 ** -15), v
    # the native pass rounds alike: "none" on subnormal weights with tiny steps
    n = 4096
    x = (torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-5).half()
    for name in ISAS:
        st = {"param": x.clone(), **_moments(n, "fp32"), "kahan": None}
        ref = _clone(st)
        g = torch.full((n,), 1e-3)
        with isa(name):
            _run("native", st, [g], master="none", rounding="stochastic", lr=1e-7)
        _run("reference", ref, [g], master="none", rounding="stochastic", lr=1e-7)
        _assert_same(st, ref, f"{name} fp16 subnormals")
        assert not torch.equal(st["param"], x)  # the steps moved some weights


@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("master,weights", [("fp32", torch.float32), ("kahan", torch.bfloat16),
                                            ("none", torch.bfloat16),
                                            ("kahan", torch.float16)])
@pytest.mark.parametrize("moments", ["fp32", "bf16"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_amsgrad_with_dense_moments_matches_reference(name, master, weights, moments,
                                                      rounding):
    """amsgrad (max_exp_avg_sq in the moments' format) with fp32 / bf16 moments, native ==
    reference bit for bit, NaN and inf gradients included; a bf16 max is rounded with
    exp_avg_sq's bits, so it stays >= exp_avg_sq."""
    gen = torch.Generator().manual_seed(9)
    n = 3 * 256 + 77 + (40_000 if name == "avx512" else 0)
    state = _state(n, master, gen, moments=moments, weights=weights)
    state["max_exp_avg_sq"] = torch.zeros(n, dtype=MOMENTS[moments])
    ref = _clone(state)
    grads = _grads(n, 5, gen, torch.bfloat16, 4, specials=True)
    with isa(name):
        _run("native", state, grads, master=master, rounding=rounding, threads=2)
    _run("reference", ref, grads, master=master, rounding=rounding)
    _assert_same(state, ref, f"{name} amsgrad {master} {moments} {rounding}")
    v, vmax = state["exp_avg_sq"].float(), state["max_exp_avg_sq"].float()
    ok = ~torch.isnan(v) & ~torch.isnan(vmax)
    assert (vmax[ok] >= v[ok]).all()
    with pytest.raises(ValueError, match="max_exp_avg_sq"):  # int8 codes keep no max
        lb.adam_lowbit_native(grad=grads[0], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                              eps=1e-8, **{**_state(n, "fp32", gen),
                                           "max_exp_avg_sq": torch.zeros(n, dtype=torch.uint8)})


SCALE_FIELDS = (13, 14, 15, 16, 17, 29, 30, 31, 32, 33, 1, 60, 127, 200, 252, 253, 254)


@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_kernel_matches_reference_at_scale_edges(name, rounding):
    """Made-up states whose codes are all numbers, with block scales around the exponents
    where the AVX-512 short cuts fold a power-of-two scale into the exponent (only exact
    while every value is normal), some scales not powers of two, and gradients of each
    block's own magnitude, so the new scales land around the same edges: every block
    either takes a short cut that gives the full path's bits or the full path."""
    gen = torch.Generator().manual_seed(5)
    nb = 4 * len(SCALE_FIELDS)
    n = nb * 256
    mag = torch.randint(8, 128, (n,), generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32) * 128
    exp_avg = (mag | sign).to(torch.uint8)
    exp_avg_sq = torch.randint(8, 256, (n,), generator=gen, dtype=torch.int32).to(torch.uint8)
    fields = torch.tensor(SCALE_FIELDS * 4, dtype=torch.int32)
    mbits, vbits = fields << 23, fields.roll(3) << 23
    mbits[nb // 2::5] |= 0x400000  # not a power of two
    vbits[nb // 3::4] |= 0x400000
    ms, vs = mbits.view(torch.float32), vbits.view(torch.float32)
    grads = [torch.randn(n, generator=gen) * ms.repeat_interleave(256) * s for s in (1.0, 0.3)]
    state = {"param": torch.randn(n, generator=gen), "exp_avg": exp_avg,
             "exp_avg_sq": exp_avg_sq, "exp_avg_scale": ms.clone(),
             "exp_avg_sq_scale": vs.clone(), "kahan": None}
    ref = _clone(state)
    with isa(name):
        _run("native", state, grads, master="fp32", rounding=rounding, threads=1)
    _run("reference", ref, grads, master="fp32", rounding=rounding)
    _assert_same(state, ref, f"{name} {rounding} scale edges")


@settings(max_examples=80, deadline=None)
@given(n=hs.integers(0, 2100), master=hs.sampled_from(["fp32", "kahan", "none"]),
       rounding=hs.sampled_from(["nearest", "stochastic"]),
       offset=hs.sampled_from([0, 1000, 2 ** 32 - 5000, 5 * 2 ** 32 + 17]),
       seed=hs.integers(0, 2 ** 64 - 1), spread=hs.sampled_from([0, 3, 12, 30]),
       scale=hs.sampled_from([1.0, 1e-30, 1e30]), specials=hs.booleans(),
       threads=hs.sampled_from([1, 2]), maximize=hs.booleans(),
       decoupled=hs.booleans(), wd=hs.sampled_from([0.0, 0.1]),
       beta1=hs.sampled_from([0.0, 0.9, 0.6]), isa_name=hs.sampled_from(ISAS),
       moments=hs.sampled_from(list(MOMENTS)),
       weights=hs.sampled_from([torch.bfloat16, torch.float16]), amsgrad=hs.booleans())
def test_hypothesis_kernel_matches_reference(n, master, rounding, offset, seed, spread, scale,
                                             specials, threads, maximize, decoupled, wd,
                                             beta1, isa_name, moments, weights, amsgrad):
    gen = torch.Generator().manual_seed(seed % 1000)
    state = _state(n, master, gen, scale, moments, weights)
    if amsgrad and moments != "int8":  # int8 codes keep no max_exp_avg_sq
        state["max_exp_avg_sq"] = torch.zeros(n, dtype=MOMENTS[moments])
    ref = _clone(state)
    grads = [g * scale for g in _grads(n, 3, gen, torch.float32, spread, specials)]
    hp = dict(maximize=maximize, decoupled_weight_decay=decoupled, weight_decay=wd,
              beta1=beta1)
    seed0 = seed % (2 ** 63)
    with isa(isa_name):
        _run("native", state, grads, master=master, rounding=rounding, offset=offset,
             seed0=seed0, threads=threads, **hp)
    _run("reference", ref, grads, master=master, rounding=rounding, offset=offset,
         seed0=seed0, **hp)
    _assert_same(state, ref, "hypothesis")


# one 64K-element piece a chunk; chunks of several pieces, each hashed after its update
@pytest.mark.parametrize("n", [300_000 + 123, 3 * (1 << 20) + 123])
@pytest.mark.parametrize("master,moments", [("fp32", "int8"), ("kahan", "fp32"),
                                            ("none", "bf16")])
def test_threads_and_checksums_agree(master, moments, n):
    """A threaded call (several chunks) equals a one-thread call, and the CRCs it returns
    are those of the arrays it left."""
    from tiermem.kernels.checksum import crc32c
    gen = torch.Generator().manual_seed(1)
    a = _state(n, master, gen, moments=moments)
    b = _clone(a)
    grads = _grads(n, 2, gen, torch.float32, 3, specials=False)
    _run("native", a, grads, master=master, rounding="stochastic", threads=1)
    _run("native", b, grads, master=master, rounding="stochastic", threads=2)
    _assert_same(a, b, "threads")
    arrays = {"master": "param", **{k: k for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq",
                                                   "exp_avg_sq_scale", "kahan")}}
    want = {name: a[k] for name, k in arrays.items() if a[k] is not None}
    crcs = lb.adam_lowbit_native(
        grad=grads[0], step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, num_threads=2,
        master=master, checksums=tuple(want), **a)
    for k, t in want.items():
        assert crcs[k] == crc32c(t), k
    if moments != "int8":
        with pytest.raises(ValueError, match="no exp_avg_scale"):
            lb.adam_lowbit_native(grad=grads[0], step=4, lr=1e-3, beta1=0.9, beta2=0.999,
                                  eps=1e-8, master=master, checksums=("exp_avg_scale",), **a)


@pytest.mark.parametrize("master,moments", [("fp32", "int8"), ("none", "int8"),
                                            ("kahan", "fp32"), ("none", "bf16")])
def test_segment_across_a_stream_window(master, moments):
    """A segment crossing a 2^32-element window of its stream (the kernels' counter) runs
    as one call per window (the kernel alone refuses it), native and reference agree; with
    int8 codes a start off a block boundary, which such a cut would split, is refused
    (dense moments have no blocks: it runs)."""
    from tiermem.optim.rules.adam import WINDOW, int8_segment
    gen = torch.Generator().manual_seed(3)
    n, start = 4 * 256, WINDOW - 3 * 256  # the window ends after the third block
    a = _state(n, master, gen, moments=moments)
    b, c = _clone(a), _clone(a)
    g = _grads(n, 1, gen, torch.float32, 2, specials=False)[0]
    kw = dict(grad=g, master=master, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01, rounding="stochastic", param_index=5)
    got = int8_segment(kernel="native", start=start, checksums=("exp_avg",), **a, **kw)
    assert got == {}  # split: the store hashes the record
    int8_segment(kernel="reference", start=start, **b, **kw)
    _assert_same(a, b, "native vs reference")
    with pytest.raises(ValueError, match="2\\^32"):  # the kernel alone refuses the crossing
        lb.lowbit_update(kernel="native", seed=na.state_seed(step=1, partition=5),
                         offset=start, **c, **{k: v for k, v in kw.items()
                                              if k not in ("param_index",)})
    if moments == "int8":
        with pytest.raises(TierMemError, match="block boundary"):
            int8_segment(kernel="native", start=start + 1, **_clone(a), **kw)
    else:
        d, e = _clone(a), _clone(a)
        int8_segment(kernel="native", start=start + 1, **d, **kw)
        int8_segment(kernel="reference", start=start + 1, **e, **kw)
        _assert_same(d, e, "off a block boundary")


def test_relative_error_bound():
    """Inside a code's range (down to 2^-14 of the block's largest for exp_avg, 2^-30 for
    exp_avg_sq) nearest rounding keeps every value within 1/16 relative (3 mantissa
    bits)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256 * 64, generator=gen) * torch.logspace(-3, 0, 256 * 64)
    for signed, xx in ((True, x), (False, x.square())):
        q, s = lb.quantize(xx, signed=signed)
        y = lb.dequantize(q, s, signed=signed)
        big = xx.abs() > xx.abs().view(-1, 256).amax(1).repeat_interleave(256) * 1e-4
        rel = ((y - xx).abs() / xx.abs())[big]
        assert 0 < rel.max().item() <= 1 / 16 + 1e-6


def test_codes_keep_their_values():
    """Encoding the decoded value of each code gives the code back, in a block whose
    largest value is the largest code (scale 1)."""
    for signed, top in ((True, 0x7F), (False, 0xFF)):
        codes = torch.tensor([c for c in range(256) if (c & (0x7F if signed else 0xFF)) >= 8
                              or c == 0], dtype=torch.uint8)  # -0 (0x80) comes back +0
        codes = torch.cat([codes, torch.tensor([top], dtype=torch.uint8)])
        vals = lb.dequantize(codes, torch.ones(lb.blocks(codes.numel())), signed=signed)
        # blocks of 256: scale per block is its absmax / 1.875, the top code 1.875 -> 1
        q, s = lb.quantize(vals, signed=signed)
        back = lb.dequantize(q, s, signed=signed)
        assert_bitwise(back, vals, f"signed={signed}")


def test_dequantised_blocks_quantise_back_to_themselves():
    """Power-of-two scales make dequantising exact: what state_dict() exports loads back
    to the same values, in blocks of any magnitude (a block whose largest value rounded
    down to 0.9375 may come back as the same values under half the scale)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256 * 40 + 100, generator=gen) * torch.logspace(-30, 30, 256 * 40 + 100)
    for signed, xx in ((True, x), (False, x.square())):
        q, s = lb.quantize(xx, signed=signed, rounding="stochastic", seed=9)
        y = lb.dequantize(q, s, signed=signed)
        q2, s2 = lb.quantize(y, signed=signed)
        assert_bitwise(lb.dequantize(q2, s2, signed=signed), y, "values")


def test_stochastic_rounding_is_unbiased():
    """The mean of many stochastic encodings of one value is the value."""
    n = 256 * 400
    x = torch.full((n,), 0.3)
    x[::256] = 1.875  # block max: scale 1
    q, s = lb.quantize(x, signed=True, rounding="stochastic", seed=5)
    y = lb.dequantize(q, s, signed=True)
    mask = torch.ones(n, dtype=torch.bool)
    mask[::256] = False
    assert y[mask].mean().item() == pytest.approx(0.3, rel=2e-3)
    qn, sn = lb.quantize(x, signed=True)
    assert lb.dequantize(qn, sn, signed=True)[mask].unique().numel() == 1


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_stochastic_rounding_is_unbiased_per_element_over_steps(signed):
    """Each element on its own rounds without bias over the steps (fresh keys per step):
    the codes' bits are a lattice within one step (docs/guide/numerics.md), so the mean
    over a block's elements alone would not show bits that stay fixed per element."""
    x = torch.full((256,), 0.3)
    x[0] = 1.875  # block max: scale 1; 0.3 lies 0.6 of the way from 0.28125 to 0.3125
    steps = 1000
    total = torch.zeros(256, dtype=torch.float64)
    for step in range(steps):
        q, s = lb.quantize(x, signed=signed, rounding="stochastic", seed=step,
                           offset=(1 << 20) + 3, high=not signed)
        total += lb.dequantize(q, s, signed=signed).double()
    mean = (total / steps)[1:]
    sd = 0.03125 * math.sqrt(0.6 * 0.4 / steps)  # one element's mean over the steps
    assert (mean - 0.3).abs().max().item() < 6 * sd, (mean.min(), mean.max())


def test_code_bits_of_the_two_moments_are_independent():
    """Over fresh keys, an element's exp_avg and exp_avg_sq bits are uniform and
    uncorrelated (exp_avg_sq's come from x + k1, not from x)."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.randint(0, 1 << 32, (2000, 2), generator=gen, dtype=torch.int64)
    for idx in (0, 1, 12345, (1 << 32) - 1):
        r = torch.stack([lb.code_bits(torch.tensor([idx]), int(k0), int(k1))[0]
                         for k0, k1 in keys.tolist()])
        lo, hi = (r & 0xFFFF).double() / 65536, (r >> 16).double() / 65536
        for u in (lo, hi):
            assert abs(u.mean().item() - 0.5) < 0.03
        assert abs(torch.corrcoef(torch.stack([lo, hi]))[0, 1].item()) < 0.1


def test_second_moment_never_rounds_to_zero():
    """A positive exp_avg_sq far below its block's largest comes back as the smallest
    code, never 0 (a zero denominator would make a huge step)."""
    x = torch.tensor([1.0, 1e-20, 0.0, 1e-12] + [0.5] * 252)
    for rounding in ("nearest", "stochastic"):
        q, s = lb.quantize(x, signed=False, rounding=rounding, seed=3)
        y = lb.dequantize(q, s, signed=False)
        assert y[1] > 0 and y[3] > 0 and y[2] == 0


def test_nan_policy():
    """A non-finite moment is stored as NaN in its own element only: the block's scale
    comes from the finite ones, and the neighbours keep their values."""
    x = torch.linspace(-1, 1, 256)
    x[10], x[20] = math.nan, math.inf
    q, s = lb.quantize(x, signed=True)
    assert torch.isfinite(s).all() and s[0] == 1.0
    y = lb.dequantize(q, s, signed=True)
    assert torch.isnan(y[10]) and torch.isnan(y[20])
    ok = torch.ones(256, dtype=torch.bool)
    ok[[10, 20]] = False
    assert torch.isfinite(y[ok]).all()


def test_refuses_bad_arguments():
    n = 300
    s = _state(n, "fp32", torch.Generator().manual_seed(0))
    g = torch.zeros(n)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1)
    with pytest.raises(ValueError, match="window"):
        lb.adam_lowbit_native(grad=g, offset=2 ** 32 - 10, **s, **kw)
    with pytest.raises(TypeError, match="bf16 or fp16 weights"):
        lb.adam_lowbit_native(grad=g, master="none", **{**s, "kahan": None}, **kw)
    bad = dict(s, exp_avg_scale=torch.zeros(1))
    with pytest.raises(ValueError, match="exp_avg_scale"):
        lb.adam_lowbit_native(grad=g, **bad, **kw)
    with pytest.raises(ValueError, match="rounding"):
        lb.adam_lowbit_native(grad=g, rounding="up", **s, **kw)
    dense = _state(n, "kahan", torch.Generator().manual_seed(0), moments="fp32")
    for fn in (lb.adam_lowbit_native, lb.adam_lowbit_reference):
        with pytest.raises(ValueError, match="take neither"):  # dense moments have no scales
            fn(grad=g, master="kahan", **{**dense, "exp_avg_scale": torch.zeros(2)}, **kw)
        with pytest.raises(ValueError, match="need both"):  # codes without their scales
            fn(grad=g, **{**s, "exp_avg_sq_scale": None}, **kw)
        with pytest.raises(TypeError, match="exp_avg, exp_avg_sq"):  # mixed formats
            fn(grad=g, master="kahan",
               **{**dense, "exp_avg_sq": torch.zeros(n, dtype=torch.bfloat16)}, **kw)


# -- 2. through tiermem.offload, against the reference --------------------------------------

import copy  # noqa: E402

import tiermem  # noqa: E402
from tiermem.config import ConfigError  # noqa: E402
from tiermem.errors import TierMemError  # noqa: E402
from tiermem.partition import build_partitions  # noqa: E402

from offload_helpers import (Synthetic, backend_params, config, make_batches,  # noqa: E402
                             side_used, loss_of)


class ReferenceInt8Adam:
    """The reference kernel as an optimizer on whole parameters: blocks at multiples of
    BLOCK of each parameter, parameter k's element e rounded with the bits of stream (step,
    k) at index e. tiermem cuts parameters into partitions (and ranks' shares) on
    CUT_ALIGN, so its run equals this one whatever the cut. The weights are an fp32
    master (the param itself for fp32 models), bf16 weights with a Kahan term, or the bf16
    weights alone."""

    def __init__(self, params, hp: dict, *, rounding: str, master_weights: str = "fp32",
                 first: int = 0, moments: str = "int8", amsgrad: bool = False):
        """first: the index of params[0] in the optimizer's flattened parameters (a later
        parameter group's reference); moments: their format (int8, or fp32 / bf16 with
        master_weights kahan/none on bf16 parameters)."""
        self.first = first
        self.params = list(params)
        self.hp, self.rounding, self.mw = hp, rounding, master_weights
        self.steps = [0] * len(self.params)
        self.master = [p.detach().float().clone().reshape(-1) for p in self.params]
        self.segments = [[{
            "start": 0, **_moments(p.numel(), moments),
            "max_exp_avg_sq": torch.zeros(p.numel(), dtype=MOMENTS[moments]) if amsgrad
            else None,
            "kahan": torch.zeros(p.numel(), dtype=p.dtype)
            if master_weights == "kahan" and p.dtype != torch.float32 else None}]
            for p in self.params]

    def step(self):
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            self.steps[i] += 1
            grad = p.grad.reshape(-1)
            low = p.dtype != torch.float32 and self.mw != "fp32"
            for seg in self.segments[i]:
                n = seg["exp_avg"].numel()
                sl = slice(seg["start"], seg["start"] + n)
                weights = p.detach().view(-1)[sl] if low else self.master[i][sl]
                lb.adam_lowbit_reference(
                    param=weights, grad=grad[sl], master=self.mw if low else "fp32",
                    step=self.steps[i], rounding=self.rounding,
                    seed=na.state_seed(step=self.steps[i], partition=self.first + i),
                    offset=seg["start"], **{k: seg[k] for k in (
                        "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale",
                        "kahan", "max_exp_avg_sq")}, **self.hp)
            if not low:
                with torch.no_grad():
                    p.copy_(self.master[i].view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def moments(self, i: int) -> dict[str, torch.Tensor]:
        out = {}
        for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            out[k] = torch.cat([lb.dequantize(seg[k], seg[k + "_scale"], signed=signed)
                                if seg[k + "_scale"] is not None else seg[k].float()
                                for seg in self.segments[i]])
        if self.segments[i][0]["max_exp_avg_sq"] is not None:
            out["max_exp_avg_sq"] = torch.cat([seg["max_exp_avg_sq"].float()
                                               for seg in self.segments[i]])
        return out


def train(model, opt, batches):
    for i, micro in enumerate(batches):
        for tokens, target in micro:
            loss_of(model, tokens, target, side_used(i)).backward()
        opt.step()
        opt.zero_grad()


def hyper(**kw):
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False,
              decoupled_weight_decay=True)
    hp.update(kw)
    return hp


E2E = {
    # name: (model dtype, master_weights, AdamW kwargs, config keywords[, state_dtype])
    "fp32-all-nvme": (torch.float32, "fp32", dict(lr=1e-2, weight_decay=0.05), dict(host=0)),
    "fp32-mixed": (torch.float32, "fp32", dict(lr=1e-2), dict(host="128KiB", buffer_count=4)),
    "bf16-master-nvme": (torch.bfloat16, "fp32", dict(lr=1e-2, weight_decay=0.1),
                         dict(host=0)),
    "bf16-kahan-mixed": (torch.bfloat16, "kahan", dict(lr=1e-2, maximize=True),
                         dict(host="128KiB", buffer_count=4)),
    "bf16-none-nvme": (torch.bfloat16, "none", dict(lr=1e-2), dict(host=0)),
    # master_weights kahan/none with dense moments: the same weight arithmetic
    "bf16-kahan-fp32-mixed": (torch.bfloat16, "kahan", dict(lr=1e-2, weight_decay=0.1),
                              dict(host="128KiB", buffer_count=4), "fp32"),
    "bf16-none-fp32-nvme": (torch.bfloat16, "none", dict(lr=1e-2, maximize=True),
                            dict(host=0), "fp32"),
    "bf16-kahan-bf16-nvme": (torch.bfloat16, "kahan", dict(lr=1e-2), dict(host=0), "bf16"),
    "bf16-none-bf16-mixed": (torch.bfloat16, "none", dict(lr=1e-2, weight_decay=0.1),
                             dict(host="128KiB", buffer_count=4), "bf16"),
    # fp16 models: an fp16 Kahan term, stochastic rounding to fp16
    "fp16-kahan-fp32-mixed": (torch.float16, "kahan", dict(lr=1e-2, weight_decay=0.1),
                              dict(host="128KiB", buffer_count=4), "fp32"),
    "fp16-none-int8-nvme": (torch.float16, "none", dict(lr=1e-2), dict(host=0), "int8"),
    "fp16-kahan-int8-nvme": (torch.float16, "kahan", dict(lr=1e-2, maximize=True),
                             dict(host=0), "int8"),
    "fp16-none-bf16-mixed": (torch.float16, "none", dict(lr=1e-2),
                             dict(host="128KiB", buffer_count=4), "bf16"),
    # amsgrad with dense moments: max_exp_avg_sq in their format
    "bf16-kahan-fp32-amsgrad-mixed": (torch.bfloat16, "kahan", dict(lr=1e-2, amsgrad=True),
                                      dict(host="128KiB", buffer_count=4), "fp32"),
    "bf16-none-bf16-amsgrad-nvme": (torch.bfloat16, "none", dict(lr=1e-2, amsgrad=True),
                                    dict(host=0), "bf16"),
}


def _int8_cfg(path, master_weights="fp32", rounding="stochastic", state_dtype="int8", **kw):
    cfg = config(path, kernel="fused", **kw)
    cfg["optimizer"].update(state_dtype=state_dtype, state_rounding=rounding,
                            master_weights=master_weights)
    return cfg


@pytest.mark.parametrize("case", list(E2E))
@pytest.mark.parametrize("backend", backend_params())
def test_offload_matches_reference(tmp_path, backend, case):
    dtype, mw, kw, cfg_kw, *rest = E2E[case]
    moments = rest[0] if rest else "int8"
    model = Synthetic().to(dtype)
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    hp = hyper(lr=kw["lr"], weight_decay=kw.get("weight_decay", 0.01),
               maximize=kw.get("maximize", False))
    ref = ReferenceInt8Adam(ref_model.parameters(), hp, rounding="stochastic",
                            master_weights=mw, moments=moments,
                            amsgrad=kw.get("amsgrad", False))
    cfg = _int8_cfg(tmp_path, mw, state_dtype=moments, backend=backend, **cfg_kw)
    batches = make_batches(model, 5)
    with tiermem.offload(opt, cfg) as tm:
        train(model, opt, batches)
        plan = tm.plan()
        sd = opt.state_dict()
    train(ref_model, ref, batches)
    assert plan["state_bytes"]["nvme"] > 0 and plan["partitions"] >= 3
    if "mixed" in case:
        assert plan["state_bytes"]["host"] > 0
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        assert_bitwise(p.detach(), q.detach(), f"param {i}")
        if ref.steps[i] == 0:
            assert i not in sd["state"]
            continue
        st = sd["state"][i]
        assert float(st["step"]) == ref.steps[i]
        for k, t in ref.moments(i).items():
            assert st[k].dtype == torch.float32
            assert_bitwise(st[k].reshape(-1), t, f"param {i} {k}")
        if dtype != torch.float32 and mw == "fp32":
            assert_bitwise(st["master_param"].reshape(-1), ref.master[i], f"param {i} master")
        if mw == "kahan":
            want = p.detach().float().reshape(-1) + torch.cat(
                [seg["kahan"].float() for seg in ref.segments[i]])
            assert_bitwise(st["master_param"].reshape(-1), want, f"param {i} p + kahan")


# -- 3. torch format, resume, recover, bytes, errors ----------------------------------------

def _native_cfg(path, state_dtype="int8", **kw):
    cfg = config(path, kernel="native", host="128KiB", buffer_count=4)
    cfg["optimizer"].update(state_dtype=state_dtype, **kw)
    return cfg


@pytest.mark.parametrize("dtype,mw,moments", [
    (torch.float32, "fp32", "int8"), (torch.bfloat16, "fp32", "int8"),
    (torch.bfloat16, "kahan", "int8"), (torch.bfloat16, "kahan", "fp32"),
    (torch.bfloat16, "none", "fp32"), (torch.bfloat16, "kahan", "bf16"),
    (torch.float16, "kahan", "fp32"), (torch.float16, "none", "int8")])
def test_state_dict_round_trip(tmp_path, dtype, mw, moments):
    """state_dict() widens the moments exactly (int8: dequantises); loading it into a fresh
    optimizer with the same state format and going on is bitwise the same as going on
    with the original (a Kahan term comes back from master_param - weight)."""
    model = Synthetic().to(dtype)
    twin_model = copy.deepcopy(model)
    batches = make_batches(model, 6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, _native_cfg(tmp_path / "a", moments, master_weights=mw)):
        train(model, opt, batches[:3])
        sd = copy.deepcopy(opt.state_dict())
        twin_model.load_state_dict(model.state_dict())
        for st in sd["state"].values():
            for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                assert st[k].dtype == torch.float32
                x = st[k].reshape(-1)[:256]
                if moments == "int8":
                    q, s = lb.quantize(x, signed=signed)
                    assert_bitwise(lb.dequantize(q, s, signed=signed), x, k)
                elif moments == "bf16":
                    assert_bitwise(x.bfloat16().float(), x, k)
        train(model, opt, batches[3:])
    twin_opt = torch.optim.AdamW(twin_model.parameters(), lr=1e-2)
    with tiermem.offload(twin_opt, _native_cfg(tmp_path / "b", moments, master_weights=mw)):
        twin_opt.load_state_dict(sd)
        got = twin_opt.state_dict()
        for i, st in sd["state"].items():
            for k in st:
                assert_bitwise(got["state"][i][k], st[k], f"reloaded {i} {k}")
        train(twin_model, twin_opt, batches[3:])
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert_bitwise(q.detach(), p.detach(), "after reload")


def test_fp32_checkpoint_is_quantised_to_nearest_on_import(tmp_path):
    model = Synthetic()
    batches = make_batches(model, 2)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, plain, batches)
    sd = copy.deepcopy(plain.state_dict())
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(fresh, _native_cfg(tmp_path)):
        fresh.load_state_dict(sd)
        got = fresh.state_dict()
    # blocks start at each segment's element 0; these parameters are each one segment
    for i, st in sd["state"].items():
        for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            x = st[k].reshape(-1)
            want = lb.dequantize(*lb.quantize(x, signed=signed), signed=signed)
            assert_bitwise(got["state"][i][k].reshape(-1), want, f"{i} {k}")


# Each combination on both backends, one with updates during backward and one without
# (the whole cross took 20 runs of ~4.5 s; these two pairs cover both of each).
@pytest.mark.parametrize("backend,overlap", [
    pytest.param(b.values[0], b.values[0] == "threads", marks=b.marks,
                 id=f"{b.values[0]}-{'overlap' if b.values[0] == 'threads' else 'after'}")
    for b in backend_params()])
@pytest.mark.parametrize("dtype,moments,master", [("fp32", "int8", "fp32"),
                                                  ("bf16", "fp32", "kahan"),
                                                  ("bf16", "bf16", "none"),
                                                  ("fp16", "fp32", "kahan"),
                                                  ("fp16", "int8", "none")])
def test_crash_consistent_commit_resume_and_recover(tmp_path, backend, overlap, dtype, moments,
                                                    master):
    """A run killed after its step 2 (crash_run.py: int8 state, or a bf16 / fp16 model
    without a master and fp32 / bf16 / int8 moments; overlap_backward on or off):
    `tiermem recover` writes
    the fp32 moments and the weights of the commit, a resume continues bitwise where an
    uninterrupted run goes, and a resume with another state_dtype is refused by name."""
    from crash_run import (backward_grads, crash_config, make_model, make_optimizer,
                           run_killed, set_grads)
    from tiermem.swap.recover import gather

    grads = backward_grads if overlap else set_grads
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    swap = tmp_path / "swap"
    run_killed(swap, backend, "after-step:2", 4, dtype, moments,
               "overlap" if overlap else "synthetic", master)
    cfg = crash_config(str(swap), backend, moments, master)
    cfg["pipeline"]["overlap_backward"] = overlap
    twin = make_model(torch_dtype)
    twin_opt = make_optimizer(twin)
    twin_cfg = crash_config(str(tmp_path / "twin"), backend, moments, master)
    twin_cfg["pipeline"]["overlap_backward"] = overlap
    with tiermem.offload(twin_opt, twin_cfg, model=twin) as tm:
        for k in (1, 2):
            grads(twin, k)
            twin_opt.step()
        at2 = copy.deepcopy(twin_opt.state_dict())
        w2 = [p.detach().clone() for p in twin.parameters()]
        grads(twin, 3)
        twin_opt.step()
        tm.discard()
    ckpt = gather(str(swap / "tiermem-default"))
    assert ckpt["step"] == 2
    for i, st in ckpt["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert_bitwise(st[k], at2["state"][i][k], f"recovered {i} {k}")
    for (name, _), w in zip(twin.named_parameters(), w2):
        assert_bitwise(ckpt["model"][name], w.float(), name)
    other = "fp32" if moments == "bf16" else "bf16"
    stored = {"int8": "int8", "fp32": "fp32", "bf16": "bf16"}[moments]
    with pytest.raises(TierMemError, match=f"stored as {stored}, this config says "
                                           f"optimizer.state_dtype {other}"):
        with tiermem.offload(make_optimizer(make_model(torch_dtype)),
                             crash_config(str(swap), backend, other, master), resume=True):
            pass
    model = make_model(torch_dtype)
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 2
        grads(model, 3)
        opt.step()
        tm.discard()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_bitwise(p.detach(), q.detach(), "step 3 after resume")


def test_bytes_per_parameter(tmp_path):
    """Record bytes per element: fp32 model 8 -> 2.03 with int8; bf16 model 12 -> 6.03
    (fp32 master), 4.03 (kahan), 2.03 (none) with int8 moments; kahan / none with fp32
    moments 10 / 8, with bf16 moments 6 / 4."""
    want = {(torch.float32, "fp32", "fp32"): 8, (torch.float32, "int8", "fp32"): 2 + 8 / 256,
            (torch.bfloat16, "fp32", "fp32"): 12,
            (torch.bfloat16, "int8", "fp32"): 6 + 8 / 256,
            (torch.bfloat16, "int8", "kahan"): 4 + 8 / 256,
            (torch.bfloat16, "int8", "none"): 2 + 8 / 256,
            (torch.bfloat16, "fp32", "kahan"): 10, (torch.bfloat16, "fp32", "none"): 8,
            (torch.bfloat16, "bf16", "kahan"): 6, (torch.bfloat16, "bf16", "none"): 4}
    for (dtype, sd, mw), per in want.items():
        model = torch.nn.Linear(1024, 1024, bias=False).to(dtype)
        opt = torch.optim.AdamW(model.parameters())
        cfg = config(tmp_path / f"{dtype}-{sd}-{mw}", kernel="native", partition_size="1MiB")
        cfg["optimizer"].update(state_dtype=sd, master_weights=mw)
        with tiermem.offload(opt, cfg) as tm:
            got = tm.plan()["state_bytes"]["nvme"] / model.weight.numel()
            tm.discard()
        assert got == pytest.approx(per, rel=0.01), (dtype, sd, mw)


@pytest.mark.parametrize("doc,key,word", [
    ({"optimizer": {"state_dtype": "int4"}}, "optimizer.state_dtype", "'int8'"),
    ({"optimizer": {"state_dtype": "int8", "kernel": "match"}}, "optimizer.kernel",
     "bitwise parity"),
    ({"optimizer": {"state_dtype": "int8", "step_device": "device", "kernel": "native"}},
     "optimizer.kernel", "step_device"),
    ({"optimizer": {"master_weights": "kahan", "kernel": "match"}}, "optimizer.kernel",
     "master_weights kahan"),
    ({"optimizer": {"master_weights": "fp16"}}, "optimizer.master_weights", "'kahan'"),
])
def test_config_errors(doc, key, word):
    with pytest.raises(ConfigError) as info:
        tiermem.load_config(doc)
    assert info.value.key == key
    assert word in str(info.value)


def test_int8_loads_with_the_gpu_tier_and_the_device_step():
    """int8 records on the gpu tier or in the device slots run kernels.lowbit's torch
    reference there (tests/test_device_step.py checks it against the native pass)."""
    s = tiermem.load_config({"optimizer": {"state_dtype": "int8", "step_device": "device"},
                             "tiers": {"gpu": {"capacity": "1GiB"}}})
    assert s.optimizer.state_dtype == "int8" and s.tiers.gpu.capacity == 1 << 30


@pytest.mark.parametrize("dtype,kw,cfg,word", [
    (torch.float32, dict(amsgrad=True), {}, "amsgrad"),
    (torch.bfloat16, dict(amsgrad=True), dict(master_weights="kahan"), "amsgrad"),
    (torch.float64, {}, {}, "torch.float64"),
])
def test_refuses_what_the_kernel_cannot_run(tmp_path, dtype, kw, cfg, word):
    p = torch.nn.Parameter(torch.zeros(10, dtype=dtype))
    opt = torch.optim.AdamW([p], **kw)
    with pytest.raises(TierMemError, match=word):
        tiermem.offload(opt, _native_cfg(tmp_path, **cfg)).__enter__()
    assert list(tmp_path.iterdir()) == []


def test_master_weights_need_adam(tmp_path):
    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(TierMemError, match="Adam/AdamW only"):
        tiermem.offload(torch.optim.SGD([p], lr=0.1),
                        _native_cfg(tmp_path, master_weights="none")).__enter__()


# -- stress, plan -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,mw,per,moments", [
    ("fp32", "fp32", 2 + 8 / 256, "int8"), ("bf16", "fp32", 6 + 8 / 256, "int8"),
    ("bf16", "kahan", 4 + 8 / 256, "int8"), ("bf16", "none", 2 + 8 / 256, "int8"),
    ("bf16", "kahan", 10, "fp32"), ("bf16", "none", 4, "bf16"), ("fp16", "kahan", 10, "fp32"),
    ("fp16", "none", 2 + 8 / 256, "int8")])
@pytest.mark.parametrize("backend", backend_params())
def test_stress_verifies_int8_and_counts_bytes(tmp_path, backend, dtype, mw, per, moments):
    """`tiermem stress --state-dtype ... --master-weights ... --verify`: every sampled
    partition bitwise equal to the plain-torch reference; the plan and the per-step
    B/param say what the records hold."""
    from tiermem.tools import cli

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"swap: {{paths: [{tmp_path / 'swap'}]}}\nio: {{backend: {backend}}}\n"
                   "tiers: {host: {capacity: 0}}\n"
                   "pipeline: {partition_size: 1MiB, zigzag: false}\n")
    out = tmp_path / "r.json"
    rc = cli.main(["stress", "--config", str(cfg), "--params", "1M", "--steps", "2",
                   "--dtype", dtype, "--state-dtype", moments, "--master-weights", mw,
                   "--synthetic-grads", "--verify", "--no-progress", "--json", str(out)])
    assert rc == 0
    import json
    result = json.loads(out.read_text())
    assert result["plan"]["state_per_param"] == pytest.approx(per)
    assert result["verify"]["ok"] and result["verify"]["partitions_checked"] >= 2
    # every record is written each step (records still in a buffer are not read again):
    # the record bytes, with the footers and page padding of 1 MiB records on top
    step = result["steps"][1]
    written = sum(step["write_bytes"].values())
    assert written / result["plan"]["params"] == pytest.approx(per, rel=0.03)
    read = sum(step["read_bytes"].values())
    assert step["bytes_per_param"] == pytest.approx((read + written) / 1_000_000, rel=0.01)


def test_plan_flags(capsys, tmp_path):
    from tiermem.tools import cli

    for flags, per in ((["--dtype", "bf16"], "12 B/param"),
                       (["--dtype", "bf16", "--state-dtype", "int8", "--master-weights",
                         "none"], "2.031 B/param"),
                       (["--state-dtype", "int8"], "2.031 B/param"),
                       (["--dtype", "bf16", "--master-weights", "kahan"], "10 B/param"),
                       (["--dtype", "bf16", "--state-dtype", "bf16", "--master-weights",
                         "none"], "4 B/param")):
        assert cli.main(["plan", "--params", "1B", *flags]) == 0
        assert per in capsys.readouterr().out
    cfg = tmp_path / "match.yaml"
    cfg.write_text("optimizer: {kernel: match}\n")
    assert cli.main(["plan", "--params", "1B", "--master-weights", "kahan", "--config",
                     str(cfg)]) == 2
    assert "optimizer.kernel" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(sizes=hs.lists(hs.integers(1, 5000), min_size=1, max_size=40),
       pages=hs.integers(16, 40), master=hs.booleans())
def test_int8_records_fit_their_partition(sizes, pages, master):
    """However many short parameters a partition holds (each adds a part-empty block and
    its scales), its record fits partition_size less the footer's page, and every
    segment's blocks are counted: ceil(length / 256) scales per moment."""
    from tiermem.partition import RECORD_ALIGN, blocks as nblocks

    params = [torch.zeros(n, dtype=torch.bfloat16 if master else torch.float32)
              for n in sizes]
    size = pages * RECORD_ALIGN
    parts = build_partitions([{"params": params}], {}, size, state_dtype="int8",
                             keep_master=master)
    covered = [0] * len(params)
    for part in parts:
        assert part.record_bytes <= size - RECORD_ALIGN or len(part.segments) == 1
        for k in ("exp_avg_scale", "exp_avg_sq_scale"):
            assert part.sizes[k] == sum(nblocks(s.length) for s in part.segments)
        for s in part.segments:
            covered[s.index] += s.length
            assert s.start % 1024 == 0
    assert covered == sizes


def test_threads_team_and_pool_give_the_same_bits():
    """The int8 pass on OpenMP's team (a main-thread call, when built with it) and on
    threads of its own (`native_adam.set_threads("pool")`) writes the same codes, scales,
    weights and CRCs: the chunks are the same, only who takes them differs."""
    n = (1 << 20) + 4096 + 37  # threaded (above the cut-off), a short last chunk and block

    def run() -> tuple[dict[str, int], list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(21)
        p = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen) * 1e-2
        m = torch.zeros(n, dtype=torch.uint8)
        v = torch.zeros(n, dtype=torch.uint8)
        ms, vs = torch.zeros(lb.blocks(n)), torch.zeros(lb.blocks(n))
        crcs = {}
        for step in (1, 2):
            crcs = lb.adam_lowbit_native(
                param=p, grad=g, exp_avg=m, exp_avg_scale=ms, exp_avg_sq=v,
                exp_avg_sq_scale=vs, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.1, seed=5, num_threads=2,
                checksums=("master", "exp_avg", "exp_avg_sq"))
        return crcs, [p, m, v, ms, vs]

    team, pool = on_team_and_pool(run)
    assert team[0] == pool[0]
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "m scales", "v scales"),
                          team[1], pool[1]):
        assert_bitwise(a, b, f"team vs pool, {name}")
