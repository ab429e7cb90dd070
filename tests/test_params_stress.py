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
    assert nvme.host_need == base.host_need - weights_and_grads + 2 * (64 << 20)
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
