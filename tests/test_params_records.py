"""The parameter tier's records: what is written (or accumulated) is what is read back, on
both tiers and both I/O backends; a damaged NVMe record is an error, never a weight."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiermem.config import load_config
from tiermem.params.records import GRAD, WEIGHT, Meta, Records
from tiermem.swap.integrity import IntegrityError

from conftest import BACKEND_PARAMS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make(tmp_path, tier: str, backend: str, metas) -> Records:
    settings = load_config({"swap": {"paths": [str(tmp_path / "swap")]},
                            "io": {"backend": backend, "block_size": "16KiB"}})
    return Records(metas, tier, settings, "records-test")


shapes = st.lists(st.tuples(st.integers(1, 3000), st.sampled_from(DTYPES)), min_size=1,
                  max_size=4)
# per operation: (parameter number, kind, accumulate?)
ops = st.lists(st.tuples(st.integers(0, 3), st.sampled_from([WEIGHT, GRAD]), st.booleans()),
               min_size=1, max_size=12)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("tier", ["host", "nvme"])
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec=shapes, program=ops, seed=st.integers(0, 2**16))
def test_records_read_back_what_was_written(tmp_path, backend, tier, spec, program, seed):
    metas = [Meta(torch.Size([n]), dt) for n, dt in spec]
    gen = torch.Generator().manual_seed(seed)
    rec = make(tmp_path, tier, backend, metas)
    try:
        want: dict[tuple[str, int], torch.Tensor] = {}
        for i, m in enumerate(metas):  # every record starts written
            for kind in (WEIGHT, GRAD):
                v = torch.randn(m.shape, generator=gen).to(m.dtype)
                rec.write(kind, i, v) if kind == WEIGHT else rec.accumulate(i, v, add=False)
                want[kind, i] = v
        for i, kind, add in program:
            i %= len(metas)
            m = metas[i]
            v = torch.randn(m.shape, generator=gen).to(m.dtype)
            if kind == GRAD:
                stored = rec.accumulate(i, v, add=add)
                want[GRAD, i] = want[GRAD, i] + v if add else v
                assert torch.equal(stored, want[GRAD, i])
            else:
                rec.write(WEIGHT, i, v)
                want[WEIGHT, i] = v
            got = rec.fetch(kind, i).wait()  # at once: the write may still be in flight
            assert torch.equal(got, want[kind, i])
        rec.drain()
        for (kind, i), v in want.items():
            assert torch.equal(rec.fetch(kind, i).wait(), v)
    finally:
        rec.close()
    assert not (tmp_path / "swap" / "tiermem-records-test").exists()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_damaged_weight_record_is_an_error(tmp_path, backend):
    metas = [Meta(torch.Size([1000]), torch.float32)]
    rec = make(tmp_path, "nvme", backend, metas)
    try:
        rec.write(WEIGHT, 0, torch.ones(1000))
        rec.drain()
        path = rec.store.files[0].path
        slot = rec.store.slots[rec.part(WEIGHT, 0).id]
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"\x7f" * 8, slot.offset + 100)
        finally:
            os.close(fd)
        with pytest.raises(IntegrityError, match="checksum"):
            rec.fetch(WEIGHT, 0).wait()
    finally:
        rec.close()
