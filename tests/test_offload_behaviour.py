"""Under tiermem.offload the optimizer keeps behaving as a torch optimizer, and the handle
reports what moved where (stats) and how the state was laid out (plan)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import tiermem
from tiermem.swap.integrity import FOOTER_BYTES
from tiermem.optim.rules import UnsupportedOptimizer
from tiermem.partition import build_partitions

from offload_helpers import (Synthetic, assert_same_tensor, backend_params, compare_runs,
                             config, listdir, make_batches, swap_dir, train, twin)

OPT_KW = dict(lr=1e-2, weight_decay=0.05)


def plain_class_step(opt) -> bool:
    """The optimizer's step is its class's again (no tiermem hook left on the instance)."""
    return "step" not in opt.__dict__ and not hasattr(opt, "_tiermem") and all(
        name not in opt.__dict__ for name in ("state_dict", "load_state_dict",
                                              "add_param_group"))


# -- config forms ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["dict", "yaml-str", "yaml-pathlike", "settings"])
def test_config_forms_accepted(tmp_path, form):
    swap = tmp_path / "swap"
    cfg = config(swap, host=0)
    if form == "dict":
        source = cfg
    elif form in ("yaml-str", "yaml-pathlike"):
        path = tmp_path / "tiermem.yaml"
        path.write_text(yaml.safe_dump(cfg))
        source = str(path) if form == "yaml-str" else path
    else:
        source = tiermem.load_config(cfg)
        assert isinstance(source, tiermem.Settings)
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    batches = make_batches(model, 3)
    with tiermem.offload(opt, source) as tm:
        assert tm.plan()["state_bytes"]["nvme"] > 0  # the config was really used
        assert tm.plan()["swap_dirs"] == [str(swap_dir(swap))]
        train(model, opt, batches)
    train(ref_model, ref_opt, batches)
    compare_runs(model, opt, ref_model, ref_opt)


def test_config_none_is_defaults(tmp_path, monkeypatch):
    """No config: the defaults (2 GiB host tier) keep a small model's state resident."""
    monkeypatch.setenv("HOME", str(tmp_path))  # the default swap path is under ~
    model, ref_model = twin(Synthetic)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    batches = make_batches(model, 2)
    with tiermem.offload(opt) as tm:
        plan = tm.plan()
        assert plan["state_bytes"]["nvme"] == 0 and plan["swap_dirs"] == []
        train(model, opt, batches)
    train(ref_model, ref_opt, batches)
    # the default kernel (auto: native on the CPU) is close to the unfused reference
    compare_runs(model, opt, ref_model, ref_opt, exact=False)


# -- step, closure, grads ------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params())
def test_step_with_closure_returns_its_loss(tmp_path, backend):
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    (tokens, target), = make_batches(model, 1)[0]
    calls = []

    def closure():
        opt.zero_grad()
        loss = (model(tokens, False) - target).square().mean()
        loss.backward()
        calls.append(torch.is_grad_enabled())
        return loss

    with tiermem.offload(opt, config(tmp_path, backend=backend, host=0)):
        with torch.no_grad():  # step enables grad for the closure, like torch's
            out = opt.step(closure)
        assert isinstance(out, torch.Tensor) and out.requires_grad
        assert calls == [True]
        sentinel = object()
        assert opt.step(lambda: sentinel) is sentinel
        assert opt.step() is None


def test_params_without_grad_are_skipped(tmp_path):
    """A param whose grad is None is not updated and its step count does not advance, like
    torch; a param that never had a grad has no state after the block."""
    a = torch.nn.Parameter(torch.randn(3000))
    b = torch.nn.Parameter(torch.randn(5000))
    c = torch.nn.Parameter(torch.randn(700))
    ref = [torch.nn.Parameter(t.detach().clone()) for t in (a, b, c)]
    opt = torch.optim.AdamW([a, b, c], lr=1e-2, weight_decay=0.1)  # decay would move it
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    c_before = c.detach().clone()
    pattern = [(1, 1, 0), (1, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.numel(), generator=g) if on else None
              for p, on in zip((a, b, c), row)] for row in pattern]
    with tiermem.offload(opt, config(tmp_path, host=0, partition_size="64KiB")):
        for row in grads:
            for p, gr in zip((a, b, c), row):
                p.grad = gr
            opt.step()
            opt.zero_grad()
    for row in grads:
        for p, gr in zip(ref, row):
            p.grad = gr
        ref_opt.step()
        ref_opt.zero_grad()
    assert float(opt.state[a]["step"]) == 4.0
    assert float(opt.state[b]["step"]) == 3.0
    assert not opt.state.get(c)
    assert_same_tensor(c.detach(), c_before, "never-stepped param")
    for p, q, n in zip((a, b), ref[:2], "ab"):
        assert_same_tensor(p.detach(), q.detach(), n)
        for k in ("exp_avg", "exp_avg_sq"):
            assert_same_tensor(opt.state[p][k], ref_opt.state[q][k], f"{n} {k}")


def test_zero_grad_and_param_groups_untouched(tmp_path):
    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    groups_before = opt.param_groups
    with tiermem.offload(opt, config(tmp_path, host=0)):
        assert isinstance(opt, torch.optim.AdamW)
        assert opt.param_groups is groups_before
        train(model, opt, make_batches(model, 1))
        assert all(p.grad is None for p in model.parameters())  # zero_grad set them to None
        model(*make_batches(model, 1)[0][0][:1], True).sum().backward()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert plain_class_step(opt)


def test_step_hooks_still_run(tmp_path):
    """Step pre/post hooks registered on the optimizer (before or inside the block) run
    around every step, as they do for a plain torch optimizer."""
    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kw: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kw: calls.append(("post", o is opt)))
    with tiermem.offload(opt, config(tmp_path, host=0)):
        train(model, opt, make_batches(model, 2))
        handle = opt.register_step_post_hook(lambda o, args, kw: calls.append(("inside", True)))
        train(model, opt, make_batches(model, 1), start=2)
        handle.remove()
    assert calls == [("pre", True), ("post", True)] * 2 + [("pre", True), ("post", True),
                                                          ("inside", True)]


# -- add_param_group --------------------------------------------------------------------------


def _add_group_run(tmp_path, host, first, second, backend="threads"):
    """Train `first` params, add `second` as a new group, train both; against torch."""
    torch.manual_seed(0)
    init = [torch.randn(n) for n in first + second]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    qs = [torch.nn.Parameter(t.clone()) for t in init]
    k = len(first)
    opt = torch.optim.AdamW(ps[:k], lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(qs[:k], lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(t.numel(), generator=g) for t in init] for _ in range(5)]

    def run(params, o, steps):
        for s in steps:
            for p, gr in zip(params, grads[s]):
                p.grad = gr.clone()
            o.step()
            o.zero_grad()

    with tiermem.offload(opt, config(tmp_path, backend=backend, host=host)) as tm:
        run(ps[:k], opt, [0, 1])
        opt.add_param_group({"params": ps[k:], "lr": 3e-2, "amsgrad": True})
        assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 3e-2
        run(ps, opt, [2, 3, 4])
        plan = tm.plan()
    run(qs[:k], ref, [0, 1])
    ref.add_param_group({"params": qs[k:], "lr": 3e-2, "amsgrad": True})
    run(qs, ref, [2, 3, 4])
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert_same_tensor(p.detach(), q.detach(), f"param {i}")
        for key, v in ref.state[q].items():
            if key != "step":
                assert_same_tensor(opt.state[p][key], v, f"param {i} {key}")
            else:
                assert float(opt.state[p][key]) == float(v)
    assert listdir(tmp_path) == []
    return plan


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("host", [0, "64MiB", "96KiB"], ids=["nvme", "host", "mixed"])
def test_add_param_group_inside_block(tmp_path, backend, host):
    plan = _add_group_run(tmp_path, host, [9000, 4000, 300], [7000, 2500], backend)
    assert plan["partitions"] >= 4


def test_add_param_group_with_larger_params_than_the_first_group(tmp_path):
    """The first group's params are tiny (one small NVMe record); the added group's are
    large. Both groups use the same pipeline.partition_size, so this is legitimate: the
    added partitions are within partition_size. (Exposes pipeline buffers sized by the
    first group's largest record instead of partition_size.)"""
    _add_group_run(tmp_path, 0, [10], [20000, 3000])


def test_add_param_group_first_nvme_state(tmp_path):
    """The first group fits the host tier; the added group is the first NVMe state."""
    plan = _add_group_run(tmp_path, "64KiB", [3000], [9000, 9000])
    assert plan["state_bytes"]["nvme"] > 0 and plan["state_bytes"]["host"] > 0


def test_a_refused_param_group_is_not_added(tmp_path):
    """A group tiermem refuses (here: differentiable=True) must not stay in the optimizer:
    it would never be updated. The block goes on training the first group, bitwise."""
    torch.manual_seed(0)
    init = [torch.randn(5000), torch.randn(300)]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    qs = [torch.nn.Parameter(t.clone()) for t in init]
    extra = torch.nn.Parameter(torch.randn(700))
    opt = torch.optim.AdamW(ps, lr=1e-2)
    ref = torch.optim.AdamW(qs, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(t.numel(), generator=g) for t in init] for _ in range(3)]
    with tiermem.offload(opt, config(tmp_path, host="8KiB")):
        for step, gr in enumerate(grads):
            for p, q, x in zip(ps, qs, gr):
                p.grad, q.grad = x.clone(), x.clone()
            opt.step()
            ref.step()
            if step == 0:
                with pytest.raises(UnsupportedOptimizer, match="differentiable"):
                    opt.add_param_group({"params": [extra], "differentiable": True})
                assert len(opt.param_groups) == 1
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert_same_tensor(p.detach(), q.detach(), f"param {i}")
        assert_same_tensor(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], f"{i}")


# -- lr schedulers -------------------------------------------------------------------------------


SCHEDS = {
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s),
}


@pytest.mark.parametrize("when", ["before", "inside"])
@pytest.mark.parametrize("kind", list(SCHEDS))
def test_scheduler_no_order_warning(tmp_path, kind, when):
    """optimizer.step() then scheduler.step(), with the scheduler made before entering or
    inside the block: torch's "lr_scheduler.step() before optimizer.step()" / "optimizer.step()
    has been overridden" warnings must not appear, and the lr follows the schedule."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    batches = make_batches(model, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = SCHEDS[kind](opt) if when == "before" else None
        with tiermem.offload(opt, config(tmp_path, host=0)):
            if sched is None:
                sched = SCHEDS[kind](opt)
            train(model, opt, batches[:3], sched=sched)
        train(model, opt, batches[3:], start=3, sched=sched)  # and after the block
    ref_sched = SCHEDS[kind](ref_opt)
    train(ref_model, ref_opt, batches, sched=ref_sched)
    order = [str(w.message) for w in caught
             if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]
    assert order == []
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    compare_runs(model, opt, ref_model, ref_opt, exact=False)


# -- exceptions ----------------------------------------------------------------------------------


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("backend", backend_params())
def test_exception_in_block_returns_state(tmp_path, backend, exc):
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    batches = make_batches(model, 3)
    raised = exc("inside")
    with pytest.raises(exc) as info:
        with tiermem.offload(opt, config(tmp_path, backend=backend, host="96KiB")) as tm:
            train(model, opt, batches)
            assert Path(tm.plan()["swap_dirs"][0]).is_dir()
            raise raised
    assert info.value is raised
    train(ref_model, ref_opt, batches)
    compare_runs(model, opt, ref_model, ref_opt)
    assert listdir(tmp_path) == []
    assert plain_class_step(opt)


def test_exception_in_closure_mid_training(tmp_path):
    """A closure raising inside step(): the exception leaves the block, the state of the
    steps before is returned intact."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    batches = make_batches(model, 2)

    def bad():
        raise Boom("closure")

    with pytest.raises(Boom):
        with tiermem.offload(opt, config(tmp_path, host=0)):
            train(model, opt, batches)
            opt.step(bad)
    train(ref_model, ref_opt, batches)
    compare_runs(model, opt, ref_model, ref_opt)
    assert listdir(tmp_path) == []


def test_exception_before_any_step(tmp_path):
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(Boom):
        with tiermem.offload(opt, config(tmp_path, host=0)):
            raise Boom()
    assert not any(opt.state.values())
    for k, v in model.state_dict().items():
        assert_same_tensor(v, before[k], k)
    assert listdir(tmp_path) == [] and plain_class_step(opt)


# -- stats and plan --------------------------------------------------------------------------------

STAT_KEYS = {"step", "read_bytes", "write_bytes", "read_gbps", "write_gbps", "update_seconds",
             "transfer_seconds", "stall_seconds", "io_seconds", "overlap", "partitions",
             "reads_skipped"}


def _stats_run(tmp_path, backend, steps=4, **cfg):
    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    expected = build_partitions(opt.param_groups, {}, tiermem.load_config(
        config(tmp_path, **cfg)).pipeline.partition_size)
    with tiermem.offload(opt, config(tmp_path, backend=backend, **cfg)) as tm:
        batches = make_batches(model, steps)
        # every parameter gets a grad in every step: use the side branch always
        for i, micro in enumerate(batches):
            for tokens, target in micro:
                (model(tokens, True) - target).square().mean().backward()
            opt.step()
            opt.zero_grad()
        plan, stats = tm.plan(), tm.stats()
        dirs = [Path(d) for d in plan["swap_dirs"]]
        existed = [d.is_dir() for d in dirs]
    return plan, stats, expected, dirs, existed


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("write_back", ["immediate", "deferred"])
def test_stats_and_plan_nvme(tmp_path, backend, write_back):
    plan, stats, expected, dirs, existed = _stats_run(tmp_path, backend, host=0,
                                                      buffer_count=3, prefetch_depth=2,
                                                      write_back=write_back)
    nvme = plan["state_bytes"]["nvme"]
    assert plan["state_bytes"] == {"gpu": 0, "host": 0,
                                   "nvme": sum(p.record_bytes for p in expected)}
    assert plan["partitions"] == len(expected) > 3
    # each NVMe record is followed by its checksum footer (swap.checksums defaults on)
    assert plan["swap_bytes"] == nvme + FOOTER_BYTES * len(expected)
    assert dirs == [swap_dir(tmp_path)] and existed == [True]
    assert not dirs[0].exists()
    assert plan["pinned_bytes"] >= 3 * max(p.record_bytes for p in expected)
    assert [s["step"] for s in stats] == [1, 2, 3, 4]
    for i, s in enumerate(stats):
        assert STAT_KEYS <= set(s), STAT_KEYS - set(s)
        assert s["partitions"] == {"nvme": len(expected)}
        if write_back == "immediate":
            # every record (and its checksum footer) written back once per step
            assert s["write_bytes"] == {"nvme": plan["swap_bytes"]}
            assert s["writes_deferred"] == 0
        else:
            # all but the (up to 3) records the step left unwritten in the buffers, which
            # the next step updates again before anything else
            assert 0 < s["write_bytes"]["nvme"] < plan["swap_bytes"]
            assert s["writes_deferred"] == (0 if i == 0 else s["reads_skipped"])
        assert s["update_seconds"] > 0 and s["stall_seconds"] >= 0 and s["io_seconds"] > 0
        assert s["write_gbps"] > 0 and 0.0 <= s["overlap"] <= 1.0
        if i == 0:  # nothing on disk yet: records are built in the buffers, not read
            assert sum(s["read_bytes"].values()) == 0 and s["reads_skipped"] == 0
        else:
            # zig-zag: the partitions still in the 3 buffers are not read again
            assert 1 <= s["reads_skipped"] <= 3
            assert 0 < s["read_bytes"]["nvme"] < plan["swap_bytes"]
            assert s["read_gbps"] > 0


def test_stats_without_zigzag_read_everything(tmp_path):
    plan, stats, expected, _, _ = _stats_run(tmp_path, "threads", host=0, buffer_count=2,
                                             prefetch_depth=1, zigzag=False)
    for s in stats[1:]:
        assert s["reads_skipped"] == 0
        assert s["read_bytes"] == {"nvme": plan["swap_bytes"]}


def test_stats_and_plan_host_only(tmp_path):
    plan, stats, expected, dirs, _ = _stats_run(tmp_path, "threads", host="64MiB")
    assert plan["state_bytes"] == {"gpu": 0, "nvme": 0,
                                   "host": sum(p.record_bytes for p in expected)}
    assert plan["swap_bytes"] == 0 and plan["swap_dirs"] == [] and dirs == []
    assert plan["pinned_bytes"] >= plan["state_bytes"]["host"]
    assert listdir(tmp_path) == []  # no swap directory was ever made
    for s in stats:
        assert STAT_KEYS <= set(s)
        assert sum(s["read_bytes"].values()) == 0 and sum(s["write_bytes"].values()) == 0
        assert s["partitions"] == {"host": len(expected)}
        assert s["reads_skipped"] == 0 and s["io_seconds"] == 0


def test_plan_mixed_respects_host_capacity(tmp_path):
    cap = 200 << 10
    # every NVMe record written every step, so the bytes below are exact
    plan, stats, expected, _, _ = _stats_run(tmp_path, "threads", host=cap,
                                             write_back="immediate")
    sb = plan["state_bytes"]
    assert 0 < sb["host"] <= cap and sb["nvme"] > 0
    assert sb["host"] + sb["nvme"] == sum(p.record_bytes for p in expected)
    n_nvme = plan["partitions"] - stats[0]["partitions"]["host"]
    assert plan["swap_bytes"] == sb["nvme"] + FOOTER_BYTES * n_nvme
    for s in stats:
        assert s["partitions"]["host"] + s["partitions"]["nvme"] == len(expected)
        assert s["write_bytes"] == {"nvme": plan["swap_bytes"]}


def test_swap_dir_is_named_and_concurrent_names_coexist(tmp_path):
    m1, m2 = Synthetic(seed=1), Synthetic(seed=2)
    o1 = torch.optim.Adam(m1.parameters(), lr=1e-2)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
    q1 = torch.optim.Adam(r1.parameters(), lr=1e-2)
    q2 = torch.optim.Adam(r2.parameters(), lr=1e-2)
    b1, b2 = make_batches(m1, 3, seed=5), make_batches(m2, 3, seed=6)
    with tiermem.offload(o1, config(tmp_path, host=0), name="first") as t1:
        with tiermem.offload(o2, config(tmp_path, host=0), name="second") as t2:
            assert listdir(tmp_path) == ["tiermem-first", "tiermem-second"]
            assert t1.plan()["swap_dirs"] == [str(tmp_path / "tiermem-first")]
            assert t2.plan()["swap_dirs"] == [str(tmp_path / "tiermem-second")]
            for i in range(3):  # interleaved steps of the two runs
                train(m1, o1, b1[i:i + 1], start=i)
                train(m2, o2, b2[i:i + 1], start=i)
        assert listdir(tmp_path) == ["tiermem-first"]
    assert listdir(tmp_path) == []
    train(r1, q1, b1)
    train(r2, q2, b2)
    compare_runs(m1, o1, r1, q1)
    compare_runs(m2, o2, r2, q2)


def test_state_dict_inside_block_does_not_disturb_training(tmp_path):
    """state_dict() between steps reads every record (evicting buffered ones); training
    then continues bitwise like the reference."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    batches = make_batches(model, 5)
    with tiermem.offload(opt, config(tmp_path, host=0, buffer_count=4, prefetch_depth=2)):
        train(model, opt, batches, after_step=lambda i: opt.state_dict())
    train(ref_model, ref_opt, batches)
    compare_runs(model, opt, ref_model, ref_opt)
