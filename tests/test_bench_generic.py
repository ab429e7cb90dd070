"""bench/generic.py at tiny sizes: every optimizer whose package is installed gets its
three setups timed in every round, its ratios paired, and its NVMe bytes; the others are
named as skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zygote import run_python

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.long  # a bench script at a toy size: the full tier (docs/dev/testing.md)
def test_generic_bench_smoke(tmp_path):
    out = tmp_path / "generic.json"
    proc = run_python(
        *[str(REPO / "bench" / "generic.py"), "--quick",
         "--optimizers", "soap,lion,torchao_adamw8bit", "--backend", "threads",
         "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert set(result["results"]) | set(result["skipped"]) == {"soap", "lion",
                                                                "torchao_adamw8bit"}
    if not result["results"]:
        pytest.skip(f"none of the optimizers' packages is installed: {result['skipped']}")
    for name, r in result["results"].items():
        assert name in proc.stdout
        for setup in ("plain", "host", "nvme"):
            assert len(r[setup]["steps"]) == 2 and all(t > 0 for t in r[setup]["steps"])
        for setup in ("host", "nvme"):
            paired = sorted(a / b for a, b in zip(r[setup]["steps"], r["plain"]["steps"]))
            assert r[setup]["ratio"] == pytest.approx(sum(paired) / 2)
        assert r["nvme_bytes_per_param"] > 0
    assert not list((tmp_path / "swap").iterdir())  # every run's swap files removed
