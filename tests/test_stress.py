"""`tiermem stress`: argument errors, the plan, a verified small run on both backends,
its JSON, and verification catching a deliberately corrupted partition."""

from __future__ import annotations

import json

import pytest
import torch

from tiermem.tools import cli
from tiermem.config import load_config

from zygote import run_python
from tiermem.tools.stress import Mismatch, StressArgs, Verifier, run_stress


def _config(tmp_path, backend="io_uring", host="8MiB"):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"""
swap: {{paths: [{tmp_path / 'swap'}]}}
io: {{backend: {backend}}}
tiers: {{host: {{capacity: {host}}}}}
pipeline: {{partition_size: 4MiB, buffer_count: 3, prefetch_depth: 2}}
""")
    return path


def _run_cli(*args):
    # forked with torch imported (tests/zygote.py)
    return run_python("-m", "tiermem.tools.cli", "stress", "--no-progress", *args, timeout=300)


@pytest.mark.parametrize("args, needle", [
    (["--params", "1.5X"], "is not a count"),
    (["--params", "10M", "--dtype", "fp64"], "invalid choice"),
    (["--params", "10M", "--steps", "0"], "must be at least 1"),
    (["--layers", "2"], "give --params, or both --layers and --hidden"),
    (["--params", "5T", "--synthetic-grads"], "host memory overflows by"),
])
def test_argument_errors_are_one_line_and_exit_2(args, needle):
    """Bad sizes, unknown dtypes and plans that cannot fit: one line on stderr, exit 2."""
    proc = _run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_error_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipeline: {buffer_count: 1}\n")
    proc = _run_cli("--config", str(bad), "--params", "1M")
    assert proc.returncode == 2 and "pipeline.buffer_count" in proc.stderr


def _assert_documented_shape(result):
    """The --json file has the keys and types docs/guide/stress.md lists."""
    plan_keys = {"params", "dtype", "weights", "grads", "state", "state_per_param", "tiers",
                 "pinned", "swap", "activations", "host_need", "host_available", "disk_free"}
    step_keys = {"step", "seconds", "step_seconds", "update_seconds", "transfer_seconds",
                 "stall_seconds", "io_seconds", "read_bytes", "write_bytes", "read_gbps",
                 "write_gbps", "overlap", "partitions", "reads_skipped", "writes_deferred"}
    assert plan_keys <= set(result["plan"]) and set(result["plan"]["tiers"]) == {"gpu", "host",
                                                                                "nvme"}
    assert set(result["shape"]) == {"layers", "hidden", "embed_rows", "extra"}
    assert {"state_bytes", "pinned_bytes", "swap_bytes", "swap_dirs",
            "partitions"} <= set(result["tiermem_plan"])
    for s in result["steps"]:
        assert step_keys <= set(s), step_keys - set(s)
        assert all(isinstance(v, int) for v in s["read_bytes"].values())
    assert isinstance(result["peak_rss"], int)
    assert set(result["verify"]) == {"ok", "partitions_checked", "mismatches"}


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_small_verified_run(tmp_path, backend):
    """A 20M-parameter model, 3 steps, forward/backward, --verify: passes, JSON complete."""
    out = tmp_path / "out.json"
    proc = _run_cli("--config", str(_config(tmp_path, backend)), "--params", "20M",
                    "--steps", "3", "--verify", "--json", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "verified" in proc.stdout
    result = json.loads(out.read_text())
    _assert_documented_shape(result)
    assert result["plan"]["params"] == 20_000_000
    assert result["tiermem_plan"]["state_bytes"]["nvme"] > 0
    assert [s["step"] for s in result["steps"]] == [1, 2, 3]
    for s in result["steps"][1:]:
        assert s["read_bytes"]["nvme"] > 0 and s["write_bytes"]["nvme"] > 0
        assert s["io_seconds"] > 0
    assert result["verify"]["ok"] and result["verify"]["partitions_checked"] >= 3
    assert not (tmp_path / "swap" / "tiermem-stress").exists()  # removed at the end


def test_layers_and_hidden_and_bf16_with_accumulation(tmp_path):
    settings = load_config(_config(tmp_path))
    result = run_stress(StressArgs(settings=settings, layers=2, hidden=256, dtype="bf16",
                                   steps=2, grad_accum=2, verify=True, progress=False),
                        out=lambda *_: None)
    assert result["shape"]["layers"] == 2 and result["verify"]["ok"]


def _corrupt_after(monkeypatch, method: str, copies: str, tier: str) -> dict:
    """Once the verifier's `method` has run at step 2, add 1 to the first 16 moments of
    one partition on `tier` among those it holds in `copies` (through the tiers, as an
    update would): the record no longer matches the copy. Returns {step, partition},
    filled when it happened."""
    original = getattr(Verifier, method)
    hit = {}

    def then_corrupt(self, step):
        original(self, step)
        if step == 2 and not hit:
            part = next(p for p, _ in getattr(self, copies) if p.tier == tier)
            with self.tm.offloaded.tiers.record(part, write=True) as (views, _):
                views["exp_avg"][:16] += 1.0
            hit.update(step=step, partition=part.id)

    monkeypatch.setattr(Verifier, method, then_corrupt)
    return hit


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_verification_catches_a_corrupted_partition(tmp_path, monkeypatch, tier):
    """Corrupt one sampled partition's record after the reference copy was taken: the
    run reports a mismatch naming that partition, its tier and the step."""
    settings = load_config(_config(tmp_path))
    hit = _corrupt_after(monkeypatch, "before", "_pending", tier)
    result = run_stress(StressArgs(settings=settings, params=5_000_000, steps=3, verify=True,
                                   synthetic_grads=True, progress=False), out=lambda *_: None)
    assert not result["verify"]["ok"]
    first = result["verify"]["mismatches"][0]
    assert f"step {hit['step']}: partition {hit['partition']} ({tier} tier)" in first


def test_cli_exits_1_on_verification_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Verifier, "_check", lambda self, step, part, name, got, want:
                        self.mismatches.append(Mismatch(
                            step, part.id, part.tier, name, 1.0)))
    rc = cli.main(["stress", "--config", str(_config(tmp_path)), "--params", "2M", "--steps",
                   "1", "--synthetic-grads", "--verify", "--no-progress"])
    assert rc == 1
    assert "verification failed: step 1: partition" in capsys.readouterr().err


def test_synthetic_model_size_is_exact():
    from tiermem.tools.synthetic import build_model, choose_shape
    for n in (1, 1000, 123_457, 5_000_000):
        assert choose_shape(n).params == n
    m = build_model(300_001)
    assert sum(p.numel() for p in m.parameters()) == 300_001
    loss = m(torch.randint(0, 100, (2, 8)))
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_trace_and_plot_files(tmp_path):
    """--trace writes a valid Chrome trace with NVMe, optimizer and stall tracks; --plot a PNG."""
    pytest.importorskip("matplotlib")
    from tiermem.telemetry.trace import validate_chrome_trace

    trace, png = tmp_path / "t.json", tmp_path / "p.png"
    proc = _run_cli("--config", str(_config(tmp_path)), "--params", "5M", "--steps", "3",
                    "--synthetic-grads", "--trace", str(trace), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(trace.read_text())
    validate_chrome_trace(doc)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"nvme read", "nvme write", "host optimizer", "stall"} <= names
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_verified_run_with_bf16_state(tmp_path, dtype, rounding):
    """optimizer.state_dtype bf16: the plan counts 2-byte moments and the verifier
    recomputes with the pipeline's rounding and seeds (bitwise equal)."""
    cfg = load_config(_config(tmp_path, backend="threads", host="1MiB"))
    settings = load_config({**_as_dict(cfg), "optimizer": {"state_dtype": "bf16",
                                                          "state_rounding": rounding}})
    result = run_stress(StressArgs(settings=settings, params=3_000_000, dtype=dtype, steps=3,
                                   verify=True, progress=False), out=lambda *_: None)
    assert result["plan"]["state_per_param"] == (4 if dtype == "fp32" else 8)
    assert result["verify"]["ok"] and result["verify"]["partitions_checked"] >= 3


def _as_dict(settings) -> dict:
    import dataclasses

    d = dataclasses.asdict(settings)
    d.pop("optimizer")
    return d


def _overlap_settings(tmp_path, backend: str, **extra):
    cfg = _as_dict(load_config(_config(tmp_path, backend)))
    cfg["pipeline"]["overlap_backward"] = True
    cfg.update(extra)
    return load_config(cfg)


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_verified_run_with_updates_during_backward(tmp_path, backend, optimizer):
    """pipeline.overlap_backward: true runs each partition's update during backward, so
    --verify copies the sampled records before backward and recomputes them from the
    gradients backward left: bitwise equal on the host and NVMe tiers. (With the copies
    taken after backward, as without overlap, the updates already ran: every step but
    the first reported mismatches.) The plan holds the copies beside the activations."""
    settings = _overlap_settings(tmp_path, backend)
    result = run_stress(StressArgs(settings=settings, params=10_000_000, steps=3, verify=True,
                                   optimizer=optimizer, progress=False), out=lambda *_: None)
    assert result["verify"]["ok"], result["verify"]["mismatches"][:3]
    assert result["verify"]["partitions_checked"] >= 6
    placed = result["tiermem_plan"]["state_bytes"]
    assert placed["host"] > 0 and placed["nvme"] > 0
    plan = result["plan"]
    assert plan["verify_in_backward"] and plan["verify"] > 0
    assert any(k.endswith("verify copies") for k in result["peak_rss_after"])


def test_verification_catches_a_corruption_during_backward(tmp_path, monkeypatch):
    """With updates during backward: a record corrupted after the verifier's copy and
    before backward updates it is reported, naming the partition."""
    settings = _overlap_settings(tmp_path, "threads")
    hit = _corrupt_after(monkeypatch, "take", "_taken", "nvme")
    result = run_stress(StressArgs(settings=settings, params=10_000_000, steps=3, verify=True,
                                   progress=False), out=lambda *_: None)
    assert not result["verify"]["ok"]
    assert any(f"step 2: partition {hit['partition']} (nvme tier)" in m
               for m in result["verify"]["mismatches"])


def test_verify_refuses_updates_during_backward_with_weights_in_the_tiers(tmp_path):
    """With parameters.offload the overlapped updates drop the gradients they used: --verify
    refuses the configuration by name before building anything (--synthetic-grads, whose
    updates run at opt.step(), is verified)."""
    from tiermem.errors import TierMemError

    settings = _overlap_settings(tmp_path, "threads",
                                 parameters={"offload": "nvme", "window": "64MiB"})
    args = dict(settings=settings, params=2_000_000, steps=2, verify=True, progress=False)
    with pytest.raises(TierMemError, match="--verify cannot check pipeline.overlap_backward: "
                                           "true with parameters.offload: nvme"):
        run_stress(StressArgs(**args), out=lambda *_: None)
    result = run_stress(StressArgs(**args, synthetic_grads=True), out=lambda *_: None)
    assert result["verify"]["ok"] and result["verify"]["partitions_checked"] >= 2


def test_verifier_never_touches_the_pipeline_under_the_overlap_worker(tmp_path, monkeypatch):
    """With updates during backward, step() leaves the next step's run-ahead reads to the
    overlap's worker, which reassigns the pipeline's buffers as it goes. --verify's copies
    and comparisons go through the same pipeline, so they must wait for the worker first
    (a race here compared buffers the worker was refilling: mismatches on the partitions
    backward finished last, at 200M parameters and more). The run-ahead is slowed down so
    that a verifier that does not wait meets it every step."""
    import time

    from tiermem.optim.overlap import BackwardOverlap
    from tiermem.tiers.pipeline import StepPipeline

    run_ahead = BackwardOverlap._run_ahead

    def slow_run_ahead(self):
        time.sleep(0.05)
        run_ahead(self)

    overlaps = []
    init = BackwardOverlap.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        overlaps.append(self)

    record = StepPipeline.record
    busy = []

    def checked_record(self, part, *, write):
        if any(o._queue.unfinished_tasks for o in overlaps):
            busy.append(part.id)
        return record(self, part, write=write)

    monkeypatch.setattr(BackwardOverlap, "_run_ahead", slow_run_ahead)
    monkeypatch.setattr(BackwardOverlap, "__init__", remember)
    monkeypatch.setattr(StepPipeline, "record", checked_record)
    settings = _overlap_settings(tmp_path, "threads")
    result = run_stress(StressArgs(settings=settings, params=10_000_000, steps=3, verify=True,
                                   progress=False), out=lambda *_: None)
    assert overlaps and result["verify"]["ok"]
    assert busy == [], f"the verifier read records {busy} while the worker was busy"
