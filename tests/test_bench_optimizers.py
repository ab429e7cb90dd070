"""bench/optimizers.py at tiny sizes (its rounds, table and JSON), and the fio floor's
refusal of a job that did not move its bytes (fio reports such a job as 0 ms, which made
bogus floors)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "bench"))  # after everything else: never shadows a module

import io_vs_fio as bench_io_vs_fio  # noqa: E402  (bench/io_vs_fio.py)
import pipeline as bench_pipeline  # noqa: E402  (bench/pipeline.py)
from zygote import run_python  # noqa: E402  (tests/zygote.py)

needs_fio = pytest.mark.skipif(
    shutil.which("fio") is None or os.geteuid() != 0,
    reason="the fio floor needs fio, and root for its huge-page buffers")


@needs_fio
# The full tier: the fio floors' path, which test_bench_pipeline.py's smoke also takes; #17's
# goal command (--stand-in) is the default tier's, below.
@pytest.mark.long
def test_optimizers_bench_smoke(tmp_path):
    out = tmp_path / "optimizers.json"
    proc = run_python(
        *[str(REPO / "bench" / "optimizers.py"), "--params", "6M",
         "--rounds", "2", "--steps", "2", "--memory-steps", "1", "--partition-size", "4MiB",
         "--buffers", "4", "--prefetch", "2", "--queue-depth", "4",
         "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step / max(floors)" in proc.stdout
    result = json.loads(out.read_text())
    for name in ("sgd", "adagrad"):
        res = result["results"][name]
        assert len(res["rounds"]) == 2 and len(res["ratios"]) == 2
        for r in res["rounds"]:
            # the floor moved the bytes of the steps it is the floor of, both ways
            assert r["fio"]["read_gbps"] > 0 and r["fio"]["write_gbps"] > 0
            assert r["read_bytes"] > 0 and r["write_bytes"] > 0
            assert r["ratio"] == pytest.approx(r["step"] / max(r["fio"]["seconds"],
                                                                 r["memory"]))
            # the paced floor: run exactly when the reads ended first, the same bytes
            jobs = r["fio"]["per_job_seconds"]
            paced = r["fio_paced"]
            assert paced["paced"] == (jobs["read"] < jobs["write"])
            assert paced["read_gbps"] > 0 and paced["write_gbps"] > 0
            assert r["ratio_paced"] == pytest.approx(r["step"] / max(paced["seconds"],
                                                                       r["memory"]))
            # the floor with the update beside it: the same bytes, the in-memory step run
            # while fio moved them
            beside = r["fio_beside"]
            assert beside["read_gbps"] > 0 and beside["write_gbps"] > 0
            assert beside["depth"] == r["fio"]["depth"] and beside["work_seconds"] > 0
            assert r["ratio_beside"] == pytest.approx(r["step"] / max(beside["seconds"],
                                                                        r["memory"]))
        assert result["ratios"][name] == res["median"]["ratio"]


@needs_fio
def test_optimizers_bench_stand_in(tmp_path):
    """--stand-in: per round, steps whose update only waits write every record as the real
    ones do and read records too (which ones stay buffered depends on timing), steps whose
    update takes no time are timed too, and the real steps of the next round still read
    good records after them."""
    out = tmp_path / "optimizers.json"
    proc = run_python(
        *[str(REPO / "bench" / "optimizers.py"), "--params", "6M",
         "--rounds", "2", "--steps", "2", "--memory-steps", "1", "--partition-size", "4MiB",
         "--buffers", "4", "--prefetch", "2", "--queue-depth", "4", "--optimizers", "sgd",
         "--stand-in", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step / stand-in step" in proc.stdout
    res = json.loads(out.read_text())["results"]["sgd"]
    for r in res["rounds"]:
        assert r["stand_in_partition_seconds"] > 0
        assert r["stand_in_ratio"] == pytest.approx(r["stand_in_step"] / r["fio"]["seconds"])
        assert [s["write_bytes"] for s in r["stand_in_stats"]] == [
            s["write_bytes"] for s in r["stats"]]
        assert all(s["read_bytes"]["nvme"] > 0 for s in r["stand_in_stats"])
        assert r["bare_ratio"] == pytest.approx(r["bare_step"] / r["fio"]["seconds"])
    assert res["median"]["update_cost"] > 0
    assert "step, no-time update" in proc.stdout


def _fio_output(read_io: int, error: int = 0) -> str:
    jobs = [{"jobname": "read", "error": error, "read": {"runtime": 0 if error else 500,
                                                        "io_bytes": read_io}},
            {"jobname": "write", "error": 0, "write": {"runtime": 700, "io_bytes": 8 << 20}}]
    return "fio: some note\n" + json.dumps({"jobs": jobs})


@pytest.mark.parametrize("read_io, error", [(0, 12), (4 << 20, 0)],
                         ids=["job-failed", "short"])
def test_a_fio_job_that_did_not_move_its_bytes_is_no_floor(monkeypatch, tmp_path, read_io,
                                                           error):
    monkeypatch.setattr(bench_pipeline.subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(
        stdout=_fio_output(read_io, error), stderr="io_u error: Bad address", returncode=0))
    with pytest.raises(subprocess.CalledProcessError) as got:
        bench_pipeline._fio_concurrent(tmp_path / "r", tmp_path / "w", 8 << 20, 8 << 20,
                                       1 << 20, 4)
    assert f"fio job read: error {error}, moved {read_io} of {8 << 20} bytes" in got.value.stderr


@needs_fio
def test_the_work_beside_fio_runs_while_its_transfers_do(tmp_path):
    """measure_beside starts the work only once fio's transfers have begun (not while fio
    starts up, which takes longer than its transfers at this size), and fio's figures are
    still whole."""
    nbytes = 256 << 20
    seen = {}
    disk = bench_io_vs_fio.DeviceCounters(tmp_path)
    if disk.read() is None:
        pytest.skip(f"no block device counters for {tmp_path}")

    def moved() -> int:  # sectors read and written by the device under tmp_path, in bytes
        c = disk.read()
        return (c[2] + c[6]) * 512

    def work():
        seen["moving"] = moved()
        time.sleep(0.05)
        seen["later"] = moved()
        return 0.05

    with bench_pipeline.FioFloor(tmp_path, 1 << 20, 4, nbytes, nbytes) as floor:
        free = floor.measure()
        got = floor.measure_beside(free, work)
    assert got["work_seconds"] == 0.05 and got["depth"] == free["depth"]
    assert got["read_gbps"] > 0 and got["write_gbps"] > 0
    assert seen["later"] > seen["moving"], "the work ran while nothing moved"


def test_fio_that_ends_before_moving_anything_is_not_waited_for(monkeypatch, tmp_path):
    """A fio that fails at once (no block ever moved) ends the wait for its transfers to
    begin: the work runs, and the failure is reported, rather than waited on for ever."""
    class Ended:
        pid, returncode = 2 ** 22 + 1, 1  # above pid_max's default: no /proc entry

        def __init__(self, cmd, **kw):
            assert cmd[1] == "--thread"

        def poll(self):
            return self.returncode

        def communicate(self):
            return _fio_output(0, error=5), "fio: io_u error"

    monkeypatch.setattr(bench_pipeline.subprocess, "Popen", Ended)
    waits = []

    def sleep(seconds):  # the wait's poll: bounded here, so a wait for ever fails
        waits.append(seconds)
        assert len(waits) < 1000, "still waiting for the transfers of a fio that ended"

    monkeypatch.setattr(bench_pipeline.time, "sleep", sleep)
    ran = []
    with pytest.raises(subprocess.CalledProcessError) as got:
        bench_pipeline._fio_concurrent(tmp_path / "r", tmp_path / "w", 8 << 20, 8 << 20,
                                       1 << 20, 4, beside=lambda: ran.append(1) or 0.0)
    assert ran == [1] and "fio job read: error 5" in got.value.stderr


def test_a_complete_fio_run_is_the_floor(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_pipeline.subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(
        stdout=_fio_output(8 << 20), stderr="", returncode=0))
    got = bench_pipeline._fio_concurrent(tmp_path / "r", tmp_path / "w", 8 << 20, 8 << 20,
                                         1 << 20, 4)
    assert got["seconds"] == 0.7 and got["per_job_seconds"] == {"read": 0.5, "write": 0.7}


@needs_fio
@pytest.mark.long  # a measurement bench (docs/dev/benchmarks.md), not an issue's goal
def test_disk_contention_bench_smoke(tmp_path):
    """bench/disk_contention.py at a tiny size: every load measured beside fio in every
    round, fio alone its own reference, the memory loads' rates measured."""
    out = tmp_path / "contention.json"
    proc = run_python(
        *[str(REPO / "bench" / "disk_contention.py"), "--quick", "--rounds", "2",
         "--gb", "0.1", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"none", "spin", "in cache", "read", "write", "triad"}
    assert res["none"]["ratios"] == [1.0, 1.0]
    for kind, r in res.items():
        assert len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"])
        assert r["ratios"] == [s / n for s, n in zip(r["seconds"], res["none"]["seconds"])]
        assert (r["load_bytes_per_second"] > 0) == (kind in ("read", "write", "triad"))
    assert "x fio alone" in proc.stdout
