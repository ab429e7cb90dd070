"""CRC32C in C (tiermem/checksum.py, native/crc32c.c) and the CRCs the native Adam kernel
returns for the arrays it wrote (native_adam.adam_fused_mixed(checksums=...))."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tiermem.kernels import native_adam as na
from tiermem.kernels.checksum import (RecordDigest, combine, crc32c, crc32c_clmul, crc32c_portable,
                                      crc32c_sse42, crc_path, has_clmul, has_fold, has_sse42)

from adam_helpers import on_another_thread, on_team_and_pool


def test_check_value_of_the_standard():
    # CRC-32C/ISCSI check value, and the empty string
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c_portable(b"123456789") == 0xE3069283
    assert crc32c_sse42(b"123456789") == 0xE3069283
    assert crc32c(b"123456789" * 200) == crc32c_portable(b"123456789" * 200)
    assert crc32c(b"") == 0
    assert crc32c(b"\0" * 32) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40000), st.binary(max_size=40000))
def test_combine_equals_the_crc_of_the_concatenation(a, b):
    assert combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    assert crc32c(b, crc32c(a)) == crc32c(a + b)  # continuing a CRC


@pytest.mark.skipif(not has_sse42(), reason="no SSE4.2 on this CPU")
def test_sse42_path_equals_the_table_path_at_every_length_and_alignment():
    data = os.urandom(3 * 4096 * 3 + 64)
    for start in range(8):
        for n in list(range(0, 300)) + [3 * 4096 - 1, 3 * 4096, 3 * 4096 + 7, 2 * 3 * 4096 + 13,
                                        len(data) - start]:
            piece = data[start: start + n]
            assert crc32c_sse42(piece) == crc32c_portable(piece), (start, n)


@pytest.mark.skipif(not has_fold(), reason="no AVX-512 VPCLMULQDQ on this CPU")
def test_fold_path_equals_the_table_path_at_every_length_and_alignment():
    # crc32c() takes the folding path here (has_fold) for 1 KiB and more.
    # Around the thresholds: 1 KiB (fold at all), 256-byte rounds, and tails of 0..255.
    data = os.urandom(8192 + 64)
    for start in range(0, 64, 5):
        for n in [*range(1000, 1300), 2047, 2048, 2049, 4096 + 255, 8192, len(data) - start]:
            piece = data[start: start + n]
            assert crc32c(piece) == crc32c_portable(piece), (start, n)
            assert crc32c(piece, 0xDEADBEEF) == crc32c_portable(piece, 0xDEADBEEF)


@pytest.mark.skipif(not has_fold(), reason="no AVX-512 VPCLMULQDQ on this CPU")
@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1024, max_size=70000), st.integers(0, 2**32 - 1))
def test_fold_path_equals_the_table_path_on_any_bytes(data, crc):
    assert crc32c(data, crc) == crc32c_portable(data, crc)


@pytest.mark.skipif(not has_clmul(), reason="no PCLMULQDQ on this CPU")
def test_clmul_path_equals_the_table_path_at_every_length_and_alignment():
    # Around its thresholds: 256 bytes (fold at all), 64-byte rounds, tails of 0..63.
    data = os.urandom(4096 + 64)
    for start in range(0, 64, 3):
        for n in [*range(0, 700), 1023, 1024, 1025, 4096 - 1, len(data) - start]:
            piece = data[start: start + n]
            assert crc32c_clmul(piece) == crc32c_portable(piece), (start, n)
            assert crc32c_clmul(piece, 0xDEADBEEF) == crc32c_portable(piece, 0xDEADBEEF)


@pytest.mark.skipif(not has_clmul(), reason="no PCLMULQDQ on this CPU")
@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=200, max_size=70000), st.integers(0, 2**32 - 1))
def test_clmul_path_equals_the_table_path_on_any_bytes(data, crc):
    assert crc32c_clmul(data, crc) == crc32c_portable(data, crc)


def test_the_picked_path_is_one_this_cpu_has():
    # crc32c() answers through it; a path the CPU lacks would fault, not differ.
    has = {"table": True, "sse4.2 3-way": has_sse42(), "pclmul fold": has_clmul(),
           "vpclmul fold": has_fold()}
    assert has[crc_path()]
    if has_fold():
        assert crc_path() == "vpclmul fold"
    data = os.urandom(100000)
    assert crc32c(data, 7) == crc32c_portable(data, 7)


def test_threaded_hash_equals_one_thread():
    """Pieces hashed at once (OpenMP's team from the main thread, threads of the call from
    another thread or with set_threads("pool")) combine to the one-thread value."""
    t = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(1))
    one = crc32c_portable(t.numpy().tobytes())
    short = crc32c_portable(t[: (24 << 20) - 5].numpy().tobytes())

    def hashes():
        return [(crc32c(t[: (24 << 20) - 5], threads=k), crc32c(t, threads=k))
                for k in (1, 2, 3, 16)]

    team, pool = on_team_and_pool(hashes)
    assert team == pool == on_another_thread(hashes) == [(short, one)] * 4


def test_record_digest_assembles_pieces_in_order():
    rec = torch.randint(0, 256, (10000,), dtype=torch.uint8)
    d = RecordDigest(rec)
    d.hash_to(100)
    d.add(crc32c(rec[100:5000]), 4900)
    d.hash_to(5000)  # already there: nothing to hash
    assert d.finish(10000) == crc32c_portable(rec.numpy().tobytes())
    with pytest.raises(ValueError, match="back to byte 10"):
        d.hash_to(10)


# -- CRCs from the Adam kernel -----------------------------------------------------------

ARRAYS = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _inputs(n, state, grad, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(master=torch.randn(n, generator=g),
                grad=torch.randn(n, generator=g).to(grad),
                exp_avg=torch.randn(n, generator=g).to(state),
                exp_avg_sq=torch.rand(n, generator=g).to(state),
                max_exp_avg_sq=torch.rand(n, generator=g).to(state))


@pytest.mark.parametrize("isa", na.supported_isas())
@pytest.mark.parametrize("n", [1, 1000, 64 * 1024 + 17, 600_000])
@pytest.mark.parametrize("state, rounding", [(torch.float32, "nearest"),
                                             (torch.bfloat16, "nearest"),
                                             (torch.bfloat16, "stochastic")])
@pytest.mark.parametrize("grad", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_crcs_are_the_crcs_of_what_it_wrote(isa, n, state, rounding, grad):
    na.set_isa(isa)
    try:
        hashed = _inputs(n, state, grad)
        plain = {k: v.clone() for k, v in hashed.items()}
        out_h = torch.empty(n, dtype=torch.bfloat16)
        out_p = torch.empty(n, dtype=torch.bfloat16)
        kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  amsgrad=True, rounding=rounding, seed=5, offset=7, num_threads=2)
        crcs = na.adam_fused_mixed(**hashed, weight_out=out_h, checksums=ARRAYS, **kw)
        none = na.adam_fused_mixed(**plain, weight_out=out_p, **kw)
    finally:
        na.set_isa("auto")
    assert none == {}
    # hashing touched no arithmetic: bitwise the same results
    for k in hashed:
        assert torch.equal(hashed[k].view(torch.uint8) if hashed[k].dtype != torch.float32
                           else hashed[k].view(torch.int32),
                           plain[k].view(torch.uint8) if plain[k].dtype != torch.float32
                           else plain[k].view(torch.int32)), k
    assert torch.equal(out_h.view(torch.int16), out_p.view(torch.int16))
    assert set(crcs) == set(ARRAYS)
    for k in ARRAYS:
        assert crcs[k] == crc32c_portable(hashed[k].view(torch.uint8).numpy().tobytes()), k


def test_kernel_crcs_across_a_stochastic_rounding_window():
    """A call that crosses a 2^32-element stream window runs once per window: the CRCs of
    the windows are combined too."""
    t = _inputs(300_000, torch.bfloat16, torch.float32)
    crcs = na.adam_fused_mixed(**t, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                               amsgrad=True, rounding="stochastic", seed=1,
                               offset=(1 << 32) - 100_001, num_threads=2,
                               checksums=("exp_avg", "exp_avg_sq"))
    assert set(crcs) == {"exp_avg", "exp_avg_sq"}
    for k in crcs:
        assert crcs[k] == crc32c(t[k])


def test_kernel_checksums_reject_unknown_names():
    t = _inputs(10, torch.float32, torch.float32)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(ValueError, match="unknown array 'weights'"):
        na.adam_fused_mixed(**t, checksums=("weights",), **kw)
    with pytest.raises(ValueError, match="only written with amsgrad"):
        na.adam_fused_mixed(**t, checksums=("max_exp_avg_sq",), **kw)
