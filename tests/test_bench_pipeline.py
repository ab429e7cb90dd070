"""bench/pipeline.py at tiny sizes: the table and JSON come out, the fio floor included.

One case reads records back each step; in the other every record stays in the
buffers, so the step reads nothing and the floor has no read job (fio refuses
--size=0: the bench used to fail there).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from zygote import run_python

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    shutil.which("fio") is None or os.geteuid() != 0,
    reason="the fio floor needs fio, and root for its huge-page buffers")


@pytest.mark.parametrize("params, reads", [
    pytest.param("6M", True, id="records-read-back"),
    pytest.param("2M", False, marks=pytest.mark.long, id="all-in-buffers")])
def test_pipeline_bench_smoke(tmp_path, params, reads):
    out = tmp_path / "pipeline.json"
    proc = run_python(
        *[str(REPO / "bench" / "pipeline.py"), "--params", params,
         "--steps", "3", "--partition-size", "4MiB", "--buffers", "4", "--prefetch", "2",
         "--queue-depth", "4", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step / max(floors)" in proc.stdout
    result = json.loads(out.read_text())
    tm, fio = result["tiermem"], result["fio"]
    # Every record in the buffers: with deferred write-back (the default) a steady step
    # updates them where they are and moves nothing.
    assert (tm["read_bytes"] > 0) == reads and (tm["write_bytes"] > 0) == reads
    # The floor moved exactly the directions the step moved.
    assert (fio.get("read_gbps", 0) > 0) == reads and (fio.get("write_gbps", 0) > 0) == reads
    assert set(fio.get("per_job_seconds", {})) == ({"read", "write"} if reads else set())
    if reads:  # the floor's variant names the jobs that ran
        assert fio["variant"].startswith("2 jobs x depth"), fio["variant"]
    assert result["ratio"] > 0


@pytest.mark.parametrize("read, write, names", [
    (1, 1, {"2 jobs x depth": 8, "2 jobs x depth/2": 4}),
    (0, 1, {"1 job x depth": 8, "1 job x depth/2": 4}),  # a step that reads nothing
    (1, 0, {"1 job x depth": 8, "1 job x depth/2": 4}),
])
def test_fio_variants_name_the_jobs_that_run(read, write, names):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from pipeline import fio_variants
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert fio_variants(read, write, 8) == names
    assert fio_variants(read, write, 1) == {k: 1 for k in names}
