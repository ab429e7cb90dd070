"""parameters.offload on a device model: weights reach the device through pinned buffers
on a copy stream, gradients come back the same way (tiermem/params/device.py).

Without a GPU the device path runs on the emulated streams: `tiermem.offload(...,
streams=DeferredBackend())` makes the CPU model a device model whose streams run their
work only when something waits for it, as late as a GPU may, and whose fresh device
buffers and gradient staging hold NaN until their copy ran. So a missing wait gives a
wrong number, and the bitwise comparisons with plain training catch it
(test_dropped_wait_is_caught shows they do). The tests marked needs_cuda run the same
scenarios on a real GPU (and bench/gpu_check.py's parameter-tier section).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.config import ConfigError
from tiermem.device.lanes import DeferredBackend
from tiermem.errors import TierMemError
from tiermem.params.device import DeviceSide

from offload_helpers import backend_params
from test_params_parity import (STEPS, Block, Checkpointed, Net, assert_same_model, batches,
                                cfg, loss_of, make_opt, plain_run, twins)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def dcfg(swap, *, offload: str, backend: str = "threads", state_host: bool = True,
         window: str = "256KiB", prefetch: int = 2) -> dict:
    # The records of a device model keep an fp32 master (as on a GPU), so a 64 KiB
    # partition holds more parameters than a CPU model's: a window of 256 KiB holds one
    # partition's weights and grads, and is still below the model's weights and grads.
    return cfg(swap, offload=offload, backend=backend, state_host=state_host, window=window,
               prefetch=prefetch)


def device_run(model: torch.nn.Module, data, config: dict, *, streams=None, micro: int = 1,
               clip: float | None = None, detour_at: int | None = None):
    """Train under the parameter tier on the (emulated) device; returns the losses, the
    clip norms, tm.param_stats() and the plan's parameters section."""
    opt = make_opt(model)
    losses, norms = [], []
    with tiermem.offload(opt, config, model=model,
                         streams=DeferredBackend() if streams is None else streams) as tm:
        for step in range(len(data) // micro):
            model.detour = step == detour_at
            with tm.accumulating():
                for t, y in data[step * micro:(step + 1) * micro]:
                    loss = loss_of(model, *on_model(model, t, y))
                    loss.backward()
                    losses.append(loss.item())
                    # the gradients went to their records, not p.grad
                    assert all(p.grad is None for p in model.parameters())
            if clip is not None:
                norms.append(tm.clip_grad_norm_(clip))
            opt.step()
            opt.zero_grad()
        stats, plan = tm.param_stats(), tm.plan()["parameters"]
    return losses, norms, stats, plan


def on_model(model: torch.nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    return [t.to(device) for t in tensors]


# -- parity on the emulated streams -----------------------------------------------------


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("offload", ["host", "nvme"])
@pytest.mark.parametrize("state_host", [True, False], ids=["state-host", "state-nvme"])
def test_device_model_matches_plain(tmp_path, offload, backend, state_host):
    """Losses and weights bitwise equal to plain training; every weight crossed the h2d
    lane and every gradient the d2h lane; the window was smaller than the model."""
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats, plan = device_run(model, data, dcfg(tmp_path, offload=offload,
                                                       backend=backend,
                                                       state_host=state_host))
    assert got == want
    assert_same_model(ref, model)
    assert model.head.weight is model.emb.weight  # the tied weight, still one parameter
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert stats["h2d_bytes"] >= STEPS * weights  # every weight at least once a step
    # each gradient once per backward (the tied one, accumulated on the device, once)
    assert stats["d2h_bytes"] == STEPS * weights
    assert stats["evictions"] > 0 and stats["prefetched"] > 0 and stats["out_of_order"] == 0
    assert plan["device_window"] == plan["window"] < 2 * weights
    # the window bounds device memory: materialised weights, reads ahead copied over, and
    # released buffers kept until the compute work reading them ran
    assert 0 < stats["peak_device_bytes"] <= plan["device_window"]
    assert plan["staging_bytes"] > 0 and plan["device"] == "cpu"
    assert not list(tmp_path.iterdir()) or all(not any(d.iterdir()) for d in tmp_path.iterdir())


class Deep(Net):
    """Net with six more blocks: its weights (about 550 KiB) are twice the window."""

    def __init__(self) -> None:
        super().__init__()
        self.more = torch.nn.ModuleList(Block(64) for _ in range(6))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.b1(self.emb(t))
        for blk in self.more:
            x = blk(x)
        return self.head(self.ln(self.b2(x)))


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_device_memory_stays_within_the_window(tmp_path, offload):
    """A model twice the window: weights go to the device and leave it module by module,
    the device never holds more than the window, and the numbers are plain training's."""
    torch.manual_seed(0)
    ref = Deep()
    model = copy.deepcopy(ref)
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats, plan = device_run(model, data, dcfg(tmp_path, offload=offload))
    assert got == want
    assert_same_model(ref, model)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert plan["device_window"] < weights / 2
    assert weights / 4 < stats["peak_device_bytes"] <= plan["device_window"]
    assert stats["h2d_bytes"] >= 2 * STEPS * weights * 0.9  # forward and backward, mostly


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_micro_batches_and_clipping(tmp_path, offload):
    """Gradients of three micro-batches land and add up in their records in backward's
    order; the clip norm and the weights are torch's, bitwise."""
    ref, model = twins()
    data = batches(STEPS * 3, seed=2)
    want, want_norms = plain_run(ref, data, micro=3, clip=0.5)
    got, got_norms, _, _ = device_run(model, data, dcfg(tmp_path, offload=offload),
                                      micro=3, clip=0.5)
    assert got == want
    assert [n.item() for n in got_norms] == [n.item() for n in want_norms]
    assert want_norms[0] > 0.5  # the clip really scaled the first step
    assert_same_model(ref, model)


def test_out_of_order_module_is_fetched_on_demand(tmp_path):
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data, detour_at=2)
    got, _, stats, _ = device_run(model, data, dcfg(tmp_path, offload="nvme"), detour_at=2)
    assert got == want
    assert_same_model(ref, model)
    assert stats["out_of_order"] > 0


def test_activation_checkpointing(tmp_path):
    """Backward runs the checkpointed blocks' forward again: their weights go to the device
    again, and the compute stream waits them again."""
    torch.manual_seed(0)
    ref = Checkpointed()
    model = copy.deepcopy(ref)
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats, _ = device_run(model, data, dcfg(tmp_path, offload="nvme"))
    assert got == want
    assert_same_model(ref, model)
    assert stats["evictions"] > 0


@pytest.mark.parametrize("window, prefetch", [("256KiB", 0), ("1MiB", 4)])
def test_window_and_prefetch_do_not_change_numbers(tmp_path, window, prefetch):
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats, _ = device_run(model, data, dcfg(tmp_path, offload="nvme", window=window,
                                                    prefetch=prefetch))
    assert got == want
    assert_same_model(ref, model)
    if prefetch == 0:
        assert stats["prefetched"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_matches_the_cpu_path(tmp_path, dtype):
    """A bf16/fp16 device model: gradients staged in its dtype, added across micro-batches
    in it, the fp32 master updated on the host; bitwise what the parameter tier gives the
    same model on the CPU."""
    torch.manual_seed(0)
    a = Net().to(dtype)
    b = copy.deepcopy(a)
    data = batches(STEPS * 2, seed=3)

    def run(model, streams, swap):
        opt = make_opt(model)
        losses = []
        with tiermem.offload(opt, dcfg(swap, offload="nvme"), model=model,
                             streams=streams) as tm:
            for step in range(STEPS):
                for t, y in data[2 * step: 2 * step + 2]:
                    loss = loss_of(model, t, y)
                    loss.backward()
                    losses.append(loss.item())
                tm.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
        return losses

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got = run(a, DeferredBackend(), tmp_path / "a")
    want = run(b, None, tmp_path / "b")
    assert got == want
    assert_same_model(b, a)


def test_state_dict_load_and_grads_left_without_a_step(tmp_path):
    """model.state_dict() inside the block is the trained weights; load_state_dict() goes
    to the records and the next forward uses the loaded weights on the device; a backward
    without a step leaves its gradients in p.grad at exit, as torch would."""
    ref, model = twins()
    data = batches(3)
    plain_run(ref, data[:2])
    opt = make_opt(model)
    with tiermem.offload(opt, dcfg(tmp_path, offload="nvme"), model=model,
                         streams=DeferredBackend()):
        for t, y in data[:2]:
            loss_of(model, t, y).backward()
            opt.step()
            opt.zero_grad()
        sd, want = model.state_dict(), ref.state_dict()
        assert sd.keys() == want.keys()
        for k in want:
            assert torch.equal(sd[k], want[k]), k
        fresh = Net()
        model.load_state_dict(fresh.state_dict())
        assert loss_of(model, *data[2]).item() == loss_of(fresh, *data[2]).item()
        model.load_state_dict(want)
        loss_of(model, *data[2]).backward()
    loss_of(ref, *data[2]).backward()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad), n


def test_gradient_node_dropped_by_a_device_change_is_hooked_again(tmp_path, monkeypatch):
    """On a GPU the step's host weights change p.data's device, and torch then drops the
    parameter's gradient node (set_data): the next backward makes a new one, which the
    tier hooks again when the weights go back to the device. The emulation never changes
    device, so the drop is made here the way torch makes it (a change of type)."""
    from tiermem.params.tier import ParamTier

    install = ParamTier._install_weight

    def install_dropping_the_node(self, i, value, buf):
        install(self, i, value, buf)
        if buf is not None and self.dev is not None:  # host weights of a device model
            p = self.params[i]
            d = p.data
            p.data = d.double()  # type_equal fails: autograd forgets the gradient node
            p.data = d

    monkeypatch.setattr(ParamTier, "_install_weight", install_dropping_the_node)
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, _, _ = device_run(model, data, dcfg(tmp_path, offload="nvme"))
    assert got == want
    assert_same_model(ref, model)
    # every gradient node the next backward runs is one the tier hooked
    opt = make_opt(model)
    with tiermem.offload(opt, dcfg(tmp_path, offload="host"), model=model,
                         streams=DeferredBackend()) as tm:
        for t, y in data[:2]:
            loss_of(model, t, y).backward()
            opt.step()
            opt.zero_grad()
        tier = tm.offloaded.weights
        loss = loss_of(model, *data[2])
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if hasattr(node, "variable"):
                assert node is tier._accumulators[tier.index[id(node.variable)]]
            todo.extend(n for n, _ in node.next_functions)
        assert sum(hasattr(n, "variable") for n in seen) == len(list(model.parameters()))
        loss.backward()


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_crash_consistent_commits_and_resumes(tmp_path, monkeypatch, offload):
    """swap.durability crash_consistent on a device model: it trains as plain torch does,
    and a copy of the run directory taken after a commit resumes into a fresh (zeroed)
    device model and goes on bitwise."""
    from test_params_parity import committed_and_resumed

    offload_on_cpu = tiermem.offload
    monkeypatch.setattr(tiermem, "offload", lambda *a, **k: offload_on_cpu(
        *a, streams=DeferredBackend(), **k))
    ref, model = twins()
    data = batches(STEPS * 2, seed=3)
    want, want_norms = plain_run(ref, data, micro=2, clip=0.5)
    c = dcfg(tmp_path / "a", offload=offload)
    c["swap"]["durability"] = "crash_consistent"
    got, got_norms, resumed, again = committed_and_resumed(model, data, c, micro=2, clip=0.5)
    assert got == want
    assert got_norms == [n.item() for n in want_norms]
    assert_same_model(ref, model)
    assert resumed == want[STEPS // 2 * 2:]
    assert_same_model(ref, again)


# -- the waits matter ---------------------------------------------------------------------


def _no_compute_wait(self, i, t):
    """compute_waits without its wait: the compute stream reads the weights unordered."""
    self.backend.used_by(t, self.backend.current_stream())


@pytest.mark.parametrize("dropped", ["compute waits the weights h2d",
                                     "host waits the grads d2h"])
def test_dropped_wait_is_caught(tmp_path, monkeypatch, dropped):
    """Each wait the device path relies on, dropped, gives wrong numbers on the emulation:
    the parity tests above would fail, not pass by luck."""
    if dropped.startswith("compute"):
        monkeypatch.setattr(DeviceSide, "compute_waits", _no_compute_wait)
    else:
        monkeypatch.setattr(DeviceSide, "grad_landed", lambda self, event: None)
    ref, model = twins()
    data = batches(2)
    want, _ = plain_run(ref, data)
    try:
        got, _, _, _ = device_run(model, data, dcfg(tmp_path, offload="host"))
    except TierMemError:
        return  # caught as an error (a queued copy nothing waited for): as good
    same = got == want and all(torch.equal(p, q) for p, q in zip(ref.parameters(),
                                                                 model.parameters()))
    assert not same, "a dropped wait went unnoticed"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.booleans()),
                min_size=1, max_size=24),
       st.integers(4, 2048))
def test_copies_deliver_every_value_in_order(ops, limit):
    """DeviceSide on the emulated streams, any sequence of weights up and gradients down
    under any staging limit: each device buffer the compute stream waited for holds its
    weights, each gradient lands intact, in the order backward made them, and nothing is
    left queued."""
    from tiermem.params.tier import ParamStats

    side = DeviceSide(DeferredBackend(), staging_limit=limit, stats=ParamStats())
    g = torch.Generator().manual_seed(len(ops) * 7919 + limit)
    sent, landed = [], []
    for i, n, weights in ops:
        value = torch.randn(n, generator=g)
        if weights:
            dev = side.upload(i, value.clone(), None)
            side.compute_waits(i, dev)
            side.compute_runs()
            assert torch.equal(dev, value)
            side.release(i, dev)
        else:
            sent.append((i, value.clone()))
            side.grad_out(i, value)
            side.land(lambda k, h: landed.append((k, h.clone())), every=False)
            assert side.landing_bytes <= limit or len(side.landing) == 1
    side.land(lambda k, h: landed.append((k, h.clone())), every=True)
    assert [k for k, _ in landed] == [k for k, _ in sent]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(landed, sent))
    assert side.stats.d2h_bytes == sum(v.numel() * 4 for _, v in sent)
    side.bound(0)
    assert side.retiring_bytes == 0
    side.close()
    assert side.h2d.done == side.h2d.issued and side.d2h.done == side.d2h.issued


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value, match", [
    ("step_device", "device", "optimizer.step_device"),
    ("overlap_backward", True, "pipeline.overlap_backward"),
])
def test_what_is_not_built_is_refused(tmp_path, key, value, match):
    model = Net()
    before = [p.detach().clone() for p in model.parameters()]
    c = dcfg(tmp_path, offload="host")
    if key == "step_device":
        c["optimizer"]["step_device"] = value
    else:
        c["pipeline"]["overlap_backward"] = value
    with pytest.raises(ConfigError, match=match):
        with tiermem.offload(make_opt(model), c, model=model, streams=DeferredBackend()):
            pass
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


# -- on a real GPU ----------------------------------------------------------------------------


def _cuda_twins(factory=Net) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    a = factory().cuda()
    return a, copy.deepcopy(a)


def _cuda_plain(model, data, *, micro=1, clip=None, detour_at=None):
    opt = make_opt(model)
    losses, norms = [], []
    for step in range(len(data) // micro):
        model.detour = step == detour_at
        for t, y in data[step * micro:(step + 1) * micro]:
            loss = loss_of(model, t.cuda(), y.cuda())
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def _assert_close_models(a, b):
    # The step runs on the host (torch's CPU kernels) against the plain run's CUDA ones:
    # the same arithmetic up to rounding, not bitwise.
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert q.device.type == "cuda", n
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=n)


@needs_cuda
@pytest.mark.parametrize("offload", ["host", "nvme"])
@pytest.mark.parametrize("state_host", [True, False], ids=["state-host", "state-nvme"])
def test_cuda_matches_plain(tmp_path, offload, state_host):
    ref, model = _cuda_twins()
    data = batches(STEPS)
    want, _ = _cuda_plain(ref, data, detour_at=2)  # one step runs a module out of order
    got, _, stats, plan = device_run(model, data, dcfg(tmp_path, offload=offload,
                                                       state_host=state_host),
                                     streams=_cuda_streams(model), detour_at=2)
    assert got == pytest.approx(want, rel=1e-4)
    _assert_close_models(ref, model)
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
    assert plan["device"].startswith("cuda")


def _cuda_streams(model):
    from tiermem.device.lanes import CudaBackend
    return CudaBackend(next(model.parameters()).device)


@needs_cuda
def test_cuda_micro_batches_clipping_checkpointing(tmp_path):
    torch.manual_seed(0)
    ref = Checkpointed().cuda()
    model = copy.deepcopy(ref)
    data = batches(STEPS * 2, seed=2)
    want, want_norms = _cuda_plain(ref, data, micro=2, clip=0.5)
    got, got_norms, stats, _ = device_run(model, data, dcfg(tmp_path, offload="nvme"),
                                          streams=_cuda_streams(model), micro=2, clip=0.5)
    assert got == pytest.approx(want, rel=1e-4)
    assert [n.item() for n in got_norms] == pytest.approx(want_norms, rel=1e-4)
    _assert_close_models(ref, model)


@needs_cuda
def test_cuda_model_found_without_streams(tmp_path):
    """No streams= given: CUDA parameters pick CUDA streams themselves."""
    ref, model = _cuda_twins()
    data = batches(2)
    want, _ = _cuda_plain(ref, data)
    opt = make_opt(model)
    with tiermem.offload(opt, dcfg(tmp_path, offload="host"), model=model) as tm:
        got = []
        for t, y in data:
            loss = loss_of(model, t.cuda(), y.cuda())
            loss.backward()
            got.append(loss.item())
            opt.step()
            opt.zero_grad()
        assert tm.plan()["parameters"]["device"].startswith("cuda")
    assert got == pytest.approx(want, rel=1e-4)
    _assert_close_models(ref, model)


# -- bench/gpu_check.py's parameter-tier section ------------------------------------------


@pytest.mark.long  # a bench script at a toy size: the full tier (docs/dev/testing.md)
def test_gpu_check_param_tier_smoke(tmp_path):
    """Section (e) of the GPU check, on the CPU emulation at tiny sizes: it runs, the
    tiered transformer tracks plain training, and weights and grads crossed the lanes."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--smoke",
                           "--only-params", "--swap-dir", str(tmp_path / "swap"), "--out",
                           str(out)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["param_tier"]
    assert r["status"] == "ok" and r["max_rel_err"] < 1e-3
    assert r["h2d_bytes"] >= r["weight_bytes"] and r["d2h_bytes"] > 0
    assert r["device_window"] == r["window"] < 2 * r["weight_bytes"]
    assert not any((tmp_path / "swap").iterdir())


# -- the plan ---------------------------------------------------------------------------------


def test_plan_of_a_gpu_model(tmp_path):
    """`tiermem plan --on-gpu`: a GPU model's weights, grads and activations are not in
    host memory; with parameters.offload the window is GPU memory and its copies go
    through pinned staging (three times the window), which the host figure counts; the
    records keep an fp32 master (4 B/param more)."""
    from tiermem.config import load_config
    from tiermem.tools.stress import make_plan

    def plan(offload: str, on_gpu: bool):
        settings = load_config({"swap": {"paths": [str(tmp_path)]},
                                "tiers": {"host": {"capacity": 0}},
                                "parameters": {"offload": offload, "window": "64MiB"}})
        return make_plan(100_000_000, "fp32", settings, synthetic_grads=False, hidden=1024,
                         layers=8, on_gpu=on_gpu)

    cpu, gpu = plan("nvme", False), plan("nvme", True)
    window = 64 << 20
    assert gpu.state - cpu.state == 100_000_000 * 4  # the master
    assert gpu.staging == 3 * window and cpu.staging == 0
    assert gpu.pinned - cpu.pinned == 3 * window
    # host: no activations, the staging instead of the window and its write buffers (the
    # process's own size is measured again by each plan: a few KiB apart)
    grew = gpu.host_need - cpu.host_need - (gpu.baseline - cpu.baseline)
    assert grew == 3 * window - 2 * window - cpu.activations
    assert "GPU window of 64 MiB" in "\n".join(gpu.lines())
    assert "pinned host buffers" in "\n".join(gpu.lines())
    plain_gpu, plain_cpu = plan("none", True), plan("none", False)
    # without the parameter tier a GPU model's weights, grads and activations stay off host
    assert plain_gpu.host_need - plain_gpu.baseline == \
        plain_cpu.host_need - plain_cpu.baseline - 800_000_000 - plain_cpu.activations
