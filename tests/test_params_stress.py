"""`tiermem stress --offload-params` and the plan with parameters.offload."""

from __future__ import annotations

import dataclasses

import pytest

from tiermem.config import load_config
from tiermem.tools.stress import PlanError, StressArgs, check_plan, make_plan, run_stress


def settings_for(tmp_path, offload: str, *, window: str = "32MiB", backend: str = "threads"):
    return load_config({
        "swap": {"paths": [str(tmp_path / "swap")]},
        "io": {"backend": backend},
        "tiers": {"host": {"capacity": "2MiB"}},
        "pipeline": {"partition_size": "1MiB", "buffer_count": 3, "prefetch_depth": 2},
        "optimizer": {"kernel": "match"},
        "parameters": {"offload": offload, "prefetch": 2, "window": window},
    })


@pytest.mark.parametrize("offload, dtype", [("host", "fp32"), ("nvme", "fp32"),
                                            ("nvme", "bf16")])
@pytest.mark.parametrize("synthetic", [False, True], ids=["backward", "synthetic-grads"])
def test_verified_stress_run(tmp_path, offload, synthetic, dtype):
    """Sampled partitions, recomputed in memory from the weights and grads in the
    parameter tier, are bitwise equal to what the offloaded step wrote (bf16: the master
    in the record, built from the weights in the tier)."""
    result = run_stress(StressArgs(settings=settings_for(tmp_path, offload), layers=2,
                                   hidden=128, steps=3, verify=True, grad_accum=2, dtype=dtype,
                                   synthetic_grads=synthetic, progress=False),
                        out=lambda *_: None)
    assert result["verify"]["ok"], result["verify"]["mismatches"]
    assert result["verify"]["partitions_checked"] >= 3
    stats = result["param_stats"]
    assert stats["grads_stored"] > 0 and stats["fetches"] > 0
    plan = result["plan"]
    assert plan["weights_tier"] == offload
    if offload == "nvme":
        assert plan["swap"] >= plan["weights"] + plan["grads"]
    assert not (tmp_path / "swap" / "tiermem-stress.params").exists()


def test_plan_counts_weights_and_grads_per_tier(tmp_path):
    base = make_plan(100_000_000, "bf16", settings_for(tmp_path, "none"),
                     synthetic_grads=True, hidden=1024, layers=8)
    nvme = make_plan(100_000_000, "bf16", settings_for(tmp_path, "nvme", window="64MiB"),
                     synthetic_grads=True, hidden=1024, layers=8)
    host = make_plan(100_000_000, "bf16", settings_for(tmp_path, "host", window="64MiB"),
                     synthetic_grads=True, hidden=1024, layers=8)
    weights_and_grads = 2 * 100_000_000 * 2
    assert nvme.swap == base.swap + weights_and_grads
    assert (nvme.host_need - nvme.baseline
            == base.host_need - base.baseline - weights_and_grads + 2 * (64 << 20))
    assert host.pinned == base.pinned + weights_and_grads
    assert host.swap == base.swap
    assert any("nvme tier" in line for line in nvme.lines())


def test_plan_refuses_a_window_below_one_module(tmp_path):
    plan = make_plan(100_000_000, "bf16", settings_for(tmp_path, "nvme", window="1MiB"),
                     synthetic_grads=True, hidden=1024, layers=8)
    with pytest.raises(PlanError, match="parameters.window"):
        check_plan(plan)
    ok = dataclasses.replace(plan, window=plan.window_need)
    check_plan(ok)


def test_plan_counts_this_process_and_the_verify_copies(tmp_path):
    """The host figure includes what the process holds at plan time (measured, not a
    constant) and, with --verify, the copies of the sampled partitions (held across the
    step, after backward freed the activations: the larger of the two counts)."""
    settings = settings_for(tmp_path, "nvme", window="64MiB")
    kw = dict(synthetic_grads=True, hidden=1024, layers=8)
    plain = make_plan(100_000_000, "bf16", settings, **kw)
    checked = make_plan(100_000_000, "bf16", settings, verify=True, **kw)
    assert plain.baseline > 0 and plain.verify == 0
    # 4 sampled 1 MiB records and their weights, plus the largest parameter's weights and
    # gradient whole (4h x h bf16) while its reference is computed
    assert checked.verify >= 4 * (1 << 20) + 2 * 4 * 1024 * 1024 * 2
    assert (checked.host_need - checked.baseline
            == plain.host_need - plain.baseline + checked.verify)
    with_activations = make_plan(100_000_000, "bf16", settings, verify=True,
                                 synthetic_grads=False, hidden=1024, layers=8)
    assert (with_activations.host_need - with_activations.baseline
            == plain.host_need - plain.baseline
            + max(with_activations.activations, with_activations.verify))


@pytest.mark.parametrize("synthetic", [False, True], ids=["backward", "synthetic-grads"])
def test_peak_rss_within_the_plan(tmp_path, synthetic):
    """A fresh process training a model whose weights and grads (160 MB) are several times
    its window: its peak RSS stays within 1.1x the plan's host figure, which would not
    hold if any phase (build, backward, step, verify) held the whole model (+160 MB on a
    ~500 MB figure; 1.05x measured). 40M parameters, not 100M: a bf16 backward on a CPU
    without AVX-512 BF16 took 84 s of the suite at 100M."""
    import json
    import os
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"swap: {{paths: [{tmp_path / 'swap'}]}}\n"
                   "tiers: {host: {capacity: 0}}\n"
                   "pipeline: {partition_size: 16MiB, buffer_count: 3, prefetch_depth: 2}\n"
                   "parameters: {offload: nvme, window: 32MiB, prefetch: 2}\n")
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "tiermem", "stress", "--config", str(cfg), "--params", "40M",
         "--layers", "4", "--dtype", "bf16", "--steps", "1", "--verify", "--no-progress",
         "--json", str(out)] + (["--synthetic-grads"] if synthetic else []),
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    plan = result["plan"]
    assert plan["weights"] + plan["grads"] > 4 * plan["window"]
    assert result["verify"]["ok"]
    assert result["peak_rss"] <= 1.1 * plan["host_need"], (result["peak_rss"], plan,
                                                          result["peak_rss_after"])


def test_peak_rss_is_this_processes_own():
    """A process started by a big one (a test suite) reports its own peak: Linux keeps
    getrusage's ru_maxrss across execve, which once made this file's RSS check fail
    inside the whole suite only."""
    import subprocess
    import sys

    import torch

    big = torch.ones(512 << 20, dtype=torch.uint8)  # touched: 512 MiB resident here
    out = subprocess.run([sys.executable, "-c", "from tiermem.tools.stress import peak_rss; "
                          "print(peak_rss())"], capture_output=True, text=True, check=True)
    del big
    assert int(out.stdout) < 400 << 20, out.stdout
