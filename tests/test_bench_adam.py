"""bench/adam.py's memory floor (bench/_floor.py) moves what it claims: every array the
update reads is read and every one it writes is written, over every chunk the threads take
(a floor that skipped an array, or a chunk, would make every row look slow beside it); and
the script at a toy size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from zygote import run_python

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def floor_module():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import _floor
    finally:
        sys.path.remove(str(REPO / "bench"))
    return _floor


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("threads", [1, 2])
def test_floor_reads_and_writes_every_array(floor_module, monkeypatch, mixed, threads):
    n = 2 * floor_module.CHUNK + 37  # three chunks, the last one short
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(n, generator=gen)
    g32 = torch.rand(n, generator=gen) - 0.5
    g = g32.bfloat16() if mixed else g32
    m, v = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    out = torch.zeros(n, dtype=torch.bfloat16) if mixed else None
    want_m = m * 0.9 + g.float()
    want_v = v * 0.999 + g.float() * g.float()
    want_p = p + 1e-4 * want_m
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    floor_module.Floor(p, g, m, v, out)()
    for got, want in ((m, want_m), (v, want_v), (p, want_p)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if mixed:  # the bf16 weights: p's top 16 bits
        assert torch.equal(out.view(torch.int16), (p.view(torch.int32) >> 16).to(torch.int16))


@pytest.mark.long  # a bench script at a toy size: the full tier (docs/dev/testing.md)
def test_adam_bench_smoke(tmp_path):
    out = tmp_path / "adam.json"
    proc = run_python(str(REPO / "bench" / "adam.py"), "--params", "2M", "--reps", "2",
                      "--no-deepspeed", "--json", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    floors = [r for r in rows if r["implementation"] == "memory floor"]
    assert len(floors) == 2 and all(r["status"] == "measured" for r in floors)
    assert all(len(r["seconds"]) == 2 for r in floors)
    assert "the memory floor's speed, round by round" in proc.stdout
