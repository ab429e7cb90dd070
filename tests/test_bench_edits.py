"""bench/edits.py at tiny sizes: every setup timed in every round, its ratio to the no-edit
step paired, and the parameters each step took for edited: none without an edit, every
one after a write of every weight (the pass ran), every one after a change of some."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zygote import run_python

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.long  # a bench script at a toy size: the full tier (docs/dev/testing.md)
def test_edits_bench_smoke(tmp_path, dtype):
    out = tmp_path / "edits.json"
    proc = run_python(
        *[str(REPO / "bench" / "edits.py"), "--quick", "--params", "3M",
         "--dtype", dtype, "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["results"]
    setups = ("no edit", "every weight written", "1 in 1000 changed",
              "torch fused, same model")
    for s in setups:
        assert s in proc.stdout
        assert len(r[s]["steps"]) == 2 and all(t > 0 for t in r[s]["steps"])
        paired = sorted(a / b for a, b in zip(r[s]["steps"], r["no edit"]["steps"]))
        assert r[s]["ratio"] == pytest.approx(sum(paired) / 2)
    assert r["no edit"]["parameters_taken_per_step"] == 0
    assert r["every weight written"]["parameters_taken_per_step"] == 1  # one 3M tensor
    assert r["1 in 1000 changed"]["parameters_taken_per_step"] == 1
    swap = tmp_path / "swap"
    assert not swap.exists() or not list(swap.iterdir())  # every run's swap files removed
