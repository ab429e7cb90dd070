"""`tiermem plan`'s update measurement: it times the kernel the config picks (the one the
pipeline runs), in each configuration plan can describe, and the estimate's arithmetic."""

from __future__ import annotations

import pytest

from tiermem.config import load_config
from tiermem.tools.estimate import (UpdateCost, estimate_step, kernel_for,
                                    measure_plain_update, measure_update)
from tiermem.tools.stress import make_plan


@pytest.mark.parametrize("optimizer,dtype,kernel", [
    ({"kernel": "fused"}, "fp32", "fused"),
    ({"kernel": "match"}, "fp32", "single_tensor"),
    ({"kernel": "native"}, "fp32", "native"),
    ({"kernel": "native"}, "bf16", "native"),
    ({"kernel": "fused", "state_dtype": "bf16"}, "fp32", "native"),
    ({"kernel": "fused"}, "fp16", "fused"),
])
def test_measure_update_runs_the_configured_kernel(optimizer, dtype, kernel):
    settings = load_config({"optimizer": optimizer})
    assert kernel_for(settings) == kernel
    cost = measure_update(settings, dtype, numel=1 << 16, repeats=1)
    assert cost.kernel == kernel and cost.ns_per_param > 0
    assert "measured here on 65536 elements" in cost.source


@pytest.mark.parametrize("spec, name", [("sgd", "SGD"), ("adafactor", "Adafactor"),
                                        ("torch.optim.RMSprop(centered=True)", "RMSprop")])
def test_measure_plain_update_times_the_optimizers_own_step(spec, name, monkeypatch):
    """Every optimizer but Adam steps per partition as its plain self does: the plan times
    that step on a small matrix (each step counted, the first one left out)."""
    import tiermem.tools.estimate as estimate

    clock = iter(range(100))
    monkeypatch.setattr(estimate.time, "perf_counter", lambda: float(next(clock)))
    cost = measure_plain_update(spec, numel=64 * 64, repeats=2)
    # each step reads the clock twice: 1 s a step, over 4096 elements
    assert cost.ns_per_param == pytest.approx(1e9 / 4096)
    assert cost.kernel == f"{name}'s own step" and "on a 64 x 64 matrix" in cost.source


def _plan(tmp_path, **cfg):
    swap = tmp_path / "swap"
    swap.mkdir(mode=0o700, exist_ok=True)
    settings = load_config({"swap": {"paths": [str(swap)]}, **cfg})
    return settings, make_plan(10**9, "fp32", settings, synthetic_grads=True, hidden=1024,
                               layers=1)


def test_host_tier_counts_for_the_update_not_for_nvme(tmp_path):
    settings, plan = _plan(tmp_path, tiers={"host": {"capacity": "4GB"}},
                           pipeline={"zigzag": False})
    lines = estimate_step(plan, settings, read_gbps=1.0, write_gbps=1.0,
                          update=UpdateCost(1.0, "fused", "given"), drives=1)
    text = "\n".join(lines)
    # 8 GB of state, 4 GB on the host tier: 4 GB read and written; every element updated
    assert "NVMe floor: 8 s" in text
    assert "update floor: 1 s (1,000,000,000 parameters" in text
    assert "~8 s: NVMe-bound (8x the update floor" in text


def test_step_device_leaves_the_update_out(tmp_path):
    settings, plan = _plan(tmp_path, tiers={"host": {"capacity": 0}},
                           optimizer={"step_device": "device"})
    lines = estimate_step(plan, settings, read_gbps=2.0, write_gbps=2.0,
                          update=UpdateCost(1.0, "fused", "given"), drives=2)
    text = "\n".join(lines)
    assert "update floor: not estimated" in text
    assert "NVMe-bound (the only floor estimated" in text


def test_no_update_figure_says_what_to_give(tmp_path):
    settings, plan = _plan(tmp_path, tiers={"host": {"capacity": 0}})
    text = "\n".join(estimate_step(plan, settings, read_gbps=2.0, write_gbps=2.0,
                                   update=None, drives=1))
    assert "update floor: not measured" in text and "--update-ns" in text
    assert "NVMe-bound (the only floor estimated" in text


@pytest.mark.parametrize("cfg, written_all", [
    ({}, False),  # deferred write-back: the buffered records are neither read nor written
    ({"pipeline": {"write_back": "immediate"}}, True),
    ({"swap": {"durability": "crash_consistent"}}, True),
    ({"pipeline": {"overlap_backward": True}}, True),  # the gradients' order: no deferral
], ids=["deferred", "immediate", "crash-consistent", "overlap-backward"])
def test_nvme_bytes_follow_write_back(tmp_path, cfg, written_all):
    pipeline = {"buffer_count": 4, "partition_size": "64MiB", **cfg.pop("pipeline", {})}
    swap = cfg.pop("swap", {})
    settings, plan = _plan(tmp_path, tiers={"host": {"capacity": 0}}, pipeline=pipeline,
                           **({"swap": {"paths": [str(tmp_path / "swap")], **swap}}
                              if swap else {}))
    text = "\n".join(estimate_step(plan, settings, read_gbps=1.0, write_gbps=1.0,
                                   update=UpdateCost(1.0, "fused", "given"), drives=1))
    nvme = plan.tiers["nvme"]
    reads = nvme - 4 * (64 << 20)
    writes = nvme if written_all else reads
    assert f"NVMe floor: {(reads + writes) / 1e9:.3g} s" in text, text


@pytest.mark.parametrize("names,shared", [(["a"], False), (["a", "b"], True)])
def test_swap_paths_on_one_device_are_named(tmp_path, names, shared):
    """Two swap directories on one file system stripe over one drive: the plan counts one
    drive for the floor and says which paths share it (as `tiermem validate` does)."""
    paths = [tmp_path / n for n in names]
    for p in paths:
        p.mkdir(mode=0o700)
    settings = load_config({"swap": {"paths": [str(p) for p in paths]},
                            "tiers": {"host": {"capacity": 0}}})
    plan = make_plan(10**9, "fp32", settings, synthetic_grads=True, hidden=1024, layers=1)
    lines = estimate_step(plan, settings, read_gbps=1.0, write_gbps=1.0,
                          update=UpdateCost(1.0, "fused", "given"))
    assert any(line.endswith("over 1 drive(s)") for line in lines)
    warned = [line for line in lines if line.startswith("warning: ")]
    if shared:
        assert len(warned) == 1
        assert all(str(p) in warned[0] for p in paths) and "one device" in warned[0]
    else:
        assert warned == []
