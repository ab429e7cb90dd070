"""What tiermem.offload refuses, and how: each error names what is wrong and leaves the
optimizer, its state and any existing swap directory as they were."""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import pytest
import torch

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer
from tiermem.swap.store import StaleSwapError

from offload_helpers import (Synthetic, assert_same_tensor, config, listdir, make_batches,
                             swap_dir, tmpfs, train)


def untouched(opt) -> bool:
    return "step" not in opt.__dict__ and not hasattr(opt, "_tiermem")


def entered(opt, cfg, **kw) -> list:
    """Try to enter the block; the list says whether its body ran."""
    ran = []
    with tiermem.offload(opt, cfg, **kw):
        ran.append(True)
    return ran


# -- optimizers --------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.LBFGS(ps),
    lambda ps: torch.optim.SparseAdam(ps),
], ids=["LBFGS", "SparseAdam"])
def test_unsupported_optimizer(tmp_path, make):
    """What no rule runs exactly is refused before anything is laid out or hooked."""
    opt = make(Synthetic().parameters())
    with pytest.raises(UnsupportedOptimizer) as info:
        entered(opt, config(tmp_path, host=0))
    assert isinstance(info.value, TypeError) and isinstance(info.value, tiermem.TierMemError)
    assert type(opt).__name__ in str(info.value)
    assert listdir(tmp_path) == [] and untouched(opt)


def test_adam_subclass_is_accepted(tmp_path):
    class MyAdam(torch.optim.AdamW):
        pass

    model = Synthetic()
    opt = MyAdam(model.parameters(), lr=1e-3)
    with tiermem.offload(opt, config(tmp_path, host=0)):
        train(model, opt, make_batches(model, 1))
    assert opt.state[model.fc1.weight]["exp_avg"].any()


@pytest.mark.parametrize("case", ["differentiable", "non-dense", "non-contiguous-adafactor",
                                  "complex", "float64-sgd", "float64-adam",
                                  "float64-adafactor"])
def test_unsupported_parameters_and_flags(tmp_path, case):
    """float64: the records keep fp32 state and masters, and each update of a float64
    parameter came back rounded to fp32 (every rule; the plain optimizer keeps float64)."""
    if case == "differentiable":
        opt = torch.optim.Adam(Synthetic().parameters(), differentiable=True)
        words = "differentiable"
    elif case == "non-dense":  # (a dense one, transposed or channels_last, is tiered)
        p = torch.nn.Parameter(torch.randn(40, 60)[:, ::2])
        opt = torch.optim.Adam([p])
        words = "not dense"
    elif case == "non-contiguous-adafactor":  # whole-parameter state: row-major only
        p = torch.nn.Parameter(torch.randn(40, 30).t())
        assert not p.is_contiguous()
        opt = torch.optim.Adafactor([p])
        words = "not contiguous"
    elif case.startswith("float64"):
        make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                "adam": torch.optim.Adam, "adafactor": torch.optim.Adafactor}[case[8:]]
        opt = make(Synthetic().double().parameters())
        words = "torch.float64 parameters are not supported"
    else:
        opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))])
        words = "complex64"
    with pytest.raises(UnsupportedOptimizer, match=words):
        entered(opt, config(tmp_path, host=0))
    assert listdir(tmp_path) == [] and untouched(opt)


def test_sparse_gradients_refused(tmp_path):
    emb = torch.nn.Embedding(100, 16, sparse=True)
    opt = torch.optim.Adam(emb.parameters())
    with pytest.raises(tiermem.TierMemError, match="sparse"):
        with tiermem.offload(opt, config(tmp_path, host=0)):
            emb(torch.tensor([1, 2, 3])).sum().backward()
            opt.step()
    assert listdir(tmp_path) == [] and untouched(opt)


def test_amsgrad_switched_inside_block(tmp_path):
    """Turning amsgrad on after the layout is refused at the next step; the refused step
    changes nothing: the state is that of the steps before it."""
    model = Synthetic()
    ref_model = Synthetic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    batches = make_batches(model, 2)
    with pytest.raises(tiermem.TierMemError, match="amsgrad"):
        with tiermem.offload(opt, config(tmp_path, host=0)):
            train(model, opt, batches[:1])
            opt.param_groups[0]["amsgrad"] = True
            train(model, opt, batches[1:], start=1)
    assert listdir(tmp_path) == [] and untouched(opt)
    train(ref_model, ref_opt, batches[:1])
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_same_tensor(p.detach(), q.detach(), n)
        if not ref_opt.state.get(q):  # the side branch is not used in the first step
            assert not opt.state.get(p), n
            continue
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"]) == 1.0, n
        for k in ("exp_avg", "exp_avg_sq"):
            assert_same_tensor(opt.state[p][k], ref_opt.state[q][k], f"{n} {k}")


def test_refused_sparse_step_changes_nothing(tmp_path):
    """A step refused for a sparse gradient leaves the other params' step counts alone."""
    dense = torch.nn.Parameter(torch.randn(3000))
    emb = torch.nn.Embedding(100, 16, sparse=True)
    opt = torch.optim.Adam([dense, emb.weight], lr=1e-2)
    with tiermem.offload(opt, config(tmp_path, host=0)):
        dense.grad = torch.ones(3000)
        opt.step()
        emb(torch.tensor([1, 2, 3])).sum().backward()
        dense.grad = torch.ones(3000)
        with pytest.raises(tiermem.TierMemError, match="sparse"):
            opt.step()
    assert float(opt.state[dense]["step"]) == 1.0


# -- swap directories --------------------------------------------------------------------------


def _stale(tmp_path, owner=None) -> tuple[Path, dict]:
    d = swap_dir(tmp_path)
    d.mkdir()
    (d / "state.swap").write_bytes(b"\x07" * 8192)
    (d / "notes.txt").write_text("from a crashed run")
    if owner is not None:
        (d / "owner.json").write_text(json.dumps(owner))
    snap = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}
    return d, snap


def _assert_same_dir(d: Path, snap: dict) -> None:
    assert d.is_dir()
    now = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}
    assert now == snap


@pytest.mark.parametrize("owner", [None, {"pid": 999999999, "host": "elsewhere",
                                          "started": "2020-01-01 00:00:00"}],
                         ids=["no-owner-file", "dead-owner"])
def test_stale_swap_dir(tmp_path, owner):
    d, snap = _stale(tmp_path, owner)
    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, make_batches(model, 1))  # existing state must survive the refusal
    state = {k: v.clone() for k, v in opt.state[model.fc1.weight].items()}
    with pytest.raises(StaleSwapError) as info:
        entered(opt, config(tmp_path, host=0))
    assert isinstance(info.value, tiermem.TierMemError)
    assert str(d) in str(info.value)
    _assert_same_dir(d, snap)
    assert listdir(tmp_path) == [d.name]
    assert untouched(opt)
    for k, v in state.items():
        assert_same_tensor(opt.state[model.fc1.weight][k], v, k)


def test_swap_dir_in_use_by_live_process(tmp_path):
    """A directory whose lock is held (here by another open file description, as another
    process would) is reported in use, naming the holder's pid from owner.json."""
    import fcntl

    d, snap = _stale(tmp_path, {"pid": 1, "host": socket.gethostname(), "started": "now"})
    holder = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        opt = torch.optim.Adam(Synthetic().parameters())
        with pytest.raises(StaleSwapError, match="in use by process 1") as info:
            entered(opt, config(tmp_path, host=0))
    finally:
        os.close(holder)
    assert str(d) in str(info.value)
    _assert_same_dir(d, snap)


def test_other_name_avoids_stale_dir(tmp_path):
    d, snap = _stale(tmp_path)
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters())
    with tiermem.offload(opt, config(tmp_path, host=0), name="fresh") as tm:
        assert tm.plan()["swap_dirs"] == [str(tmp_path / "tiermem-fresh")]
        train(model, opt, make_batches(model, 1))
    _assert_same_dir(d, snap)
    assert listdir(tmp_path) == [d.name]


def test_full_disk_fails_before_training(tmp_path):
    with tmpfs(tmp_path / "tiny", "1m") as small:
        model = Synthetic()
        opt = torch.optim.AdamW(model.parameters(), amsgrad=True)  # ~1.5 MiB of state
        with pytest.raises(tiermem.TierMemIOError) as info:
            entered(opt, config(small, host=0))
        err = info.value
        msg = str(err)
        assert str(small) in msg and "free" in msg
        assert err.errno == errno.ENOSPC and isinstance(err, OSError)
        assert listdir(small) == []
        assert untouched(opt) and not any(opt.state.values())


def test_host_tier_needs_no_disk(tmp_path):
    """State that fits the host tier never touches the swap path (here a full tmpfs)."""
    with tmpfs(tmp_path / "tiny", "1m") as small:
        model = Synthetic()
        opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
        with tiermem.offload(opt, config(small, host="64MiB")):
            train(model, opt, make_batches(model, 1))
        assert listdir(small) == []


# -- config and placement ----------------------------------------------------------------------


@pytest.mark.parametrize("bad, key", [
    ({"pipeline": {"partition_sise": "1MiB"}}, "pipeline.partition_sise"),
    ({"io": {"queue_depth": "32"}}, "io.queue_depth"),
    ({"pipeline": {"partition_size": "4KiB"}}, "pipeline.partition_size"),
    ({"pipeline": {"buffer_count": 2, "prefetch_depth": 2}}, "pipeline.buffer_count"),
    ({"placement": [{"match": "*", "tier": "disk"}]}, "placement[0].tier"),
])
def test_config_error_at_entry(tmp_path, bad, key):
    cfg = config(tmp_path, host=0)
    for section, values in bad.items():
        if isinstance(values, dict):
            cfg[section] = {**cfg[section], **values}
        else:
            cfg[section] = values
    opt = torch.optim.Adam(Synthetic().parameters())
    with pytest.raises(tiermem.ConfigError) as info:
        entered(opt, cfg)
    assert info.value.key == key and f"'{key}'" in str(info.value)
    assert listdir(tmp_path) == [] and untouched(opt)


def test_name_rules_need_model(tmp_path):
    opt = torch.optim.Adam(Synthetic().parameters())
    cfg = config(tmp_path, host=0, placement=[{"match": "fc1.*", "tier": "host"}])
    with pytest.raises(tiermem.TierMemError, match="model="):
        entered(opt, cfg)
    assert listdir(tmp_path) == [] and untouched(opt)


def test_catch_all_rule_needs_no_model(tmp_path):
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters())
    cfg = config(tmp_path, host="64MiB", placement=[{"match": "*", "tier": "nvme"}])
    with tiermem.offload(opt, cfg) as tm:
        assert tm.plan()["state_bytes"]["host"] == 0
        train(model, opt, make_batches(model, 1))


def test_rules_overfilling_host_tier(tmp_path):
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters())
    cfg = config(tmp_path, host="64KiB", placement=[{"match": "fc1.*", "tier": "host"}])
    with pytest.raises(ValueError, match=r"tiers\.host\.capacity"):
        entered(opt, cfg, model=model)
    assert listdir(tmp_path) == [] and untouched(opt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
@pytest.mark.parametrize("how", ["capacity", "rule"])
def test_gpu_tier_without_cuda(tmp_path, how):
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters())
    if how == "capacity":
        cfg = config(tmp_path, host=0)
        cfg["tiers"]["gpu"] = {"capacity": "1MiB"}
    else:
        cfg = config(tmp_path, host=0, placement=[{"match": "fc2.*", "tier": "gpu"}])
    with pytest.raises(tiermem.TierMemError, match="CUDA"):
        entered(opt, cfg, model=model)
    assert listdir(tmp_path) == [] and untouched(opt)
