"""optimizer.step_device and the host<->device lanes (tiermem/device_lanes.py).

On machines without a GPU the lanes run on their CPU emulation: `tiermem.offload(..., streams=DeferredBackend())` makes
CPU parameters cross the lanes as a CUDA model's would, and the emulated streams run their
work only when something waits for it, so a missing wait leaves a stale value and the
bitwise comparisons fail (test_dropped_wait_is_caught shows they do). The tests marked
`cuda` run the same on a GPU (and in bench/gpu_check.py).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.config import ConfigError
from tiermem.device.lanes import DeferredBackend, DeferredStream, DeviceLanes
from tiermem.errors import TierMemError
from tiermem.swap.integrity import IntegrityError

from conftest import REPO
from faults import inject
from offload_helpers import (Synthetic, assert_same_tensor, available_backends,
                             backend_params, compare_runs, compare_state_dicts, config,
                             listdir, loss_of,
                             lowp_step, make_batches, side_used, train, twin)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
STEPS = 4
MIXES = {"host": dict(host="64MiB"), "nvme": dict(host=0),
         "mixed": dict(host="256KiB", buffer_count=4)}


def lane_config(tmp_path, step_device, *, kernel="fused", **kw):
    cfg = config(tmp_path, kernel=kernel, **kw)
    cfg["optimizer"]["step_device"] = step_device
    return cfg


def fp32_pair(tmp_path, backend, step_device, mix, *, emulate=True, steps=STEPS):
    """Train Synthetic under tiermem (lanes emulated) and plain fused AdamW, same batches."""
    model, ref_model = twin(Synthetic)
    kw = dict(lr=1e-2, weight_decay=0.05, amsgrad=True)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
    batches = make_batches(model, steps)
    cfg = lane_config(tmp_path, step_device, backend=backend, **MIXES[mix])
    with tiermem.offload(opt, cfg, streams=DeferredBackend() if emulate else None) as tm:
        train(model, opt, batches)
        plan, stats = tm.plan(), tm.stats()
    train(ref_model, ref, batches)
    return model, opt, ref_model, ref, plan, stats


# -- parity ------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("step_device", ["cpu", "device"])
@pytest.mark.parametrize("backend", backend_params())
def test_fp32_parity(tmp_path, backend, step_device, mix):
    """Weights and moments bitwise equal to torch's fused AdamW, every tier mix, both step
    devices, both I/O backends; the copies really crossed the lanes."""
    model, opt, ref_model, ref, plan, stats = fp32_pair(tmp_path, backend, step_device, mix)
    compare_runs(model, opt, ref_model, ref)
    tiers = plan["state_bytes"]
    assert (tiers["host"] > 0) == (mix != "nvme") and (tiers["nvme"] > 0) == (mix != "host")
    for s in stats:
        assert s["h2d_bytes"] > 0 and s["d2h_bytes"] > 0
        if step_device == "device":  # every record went to the device and back
            assert s["h2d_bytes"] == s["d2h_bytes"]
    assert listdir(tmp_path) == []


@pytest.mark.parametrize("step_device", ["cpu", "device"])
def test_overlap_backward_through_the_lanes(tmp_path, step_device):
    """pipeline.overlap_backward: the worker thread updates partitions through the lanes
    during backward; still bitwise, and most partitions ran early."""
    model, ref_model = twin(Synthetic)
    kw = dict(lr=1e-2, weight_decay=0.05)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
    batches = make_batches(model, STEPS)
    cfg = lane_config(tmp_path, step_device, **MIXES["mixed"])
    cfg["pipeline"]["overlap_backward"] = True
    with tiermem.offload(opt, cfg, model=model, streams=DeferredBackend()) as tm:
        train(model, opt, batches)
        stats = tm.stats()
    train(ref_model, ref, batches)
    compare_runs(model, opt, ref_model, ref)
    assert all(s["h2d_bytes"] > 0 for s in stats)
    assert sum(s["early_partitions"] for s in stats) > 0


@pytest.mark.parametrize("backend", backend_params())
def test_device_step_on_a_cpu_model_without_emulation(tmp_path, backend):
    """step_device device on a CPU model: fp32 records hold no master (updated in place on
    the 'device', the CPU) and the result is still bitwise."""
    model, opt, ref_model, ref, plan, stats = fp32_pair(tmp_path, backend, "device", "mixed",
                                                        emulate=False)
    compare_runs(model, opt, ref_model, ref)
    assert all(s["h2d_bytes"] > 0 for s in stats)


@pytest.mark.parametrize("step_device", ["cpu", "device"])
@pytest.mark.parametrize("backend", backend_params())
def test_bf16_weights_each_step(tmp_path, backend, step_device):
    """A bf16 model: after every step its weights are the fp32 reference's rounded to bf16
    (master and moments fp32 in the records), and the exported moments match."""
    model = Synthetic().to(torch.bfloat16)
    ref_params = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    kw = dict(lr=1e-2, weight_decay=0.05)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref = torch.optim.AdamW(ref_params, fused=True, **kw)
    names = [n for n, _ in model.named_parameters()]
    cfg = lane_config(tmp_path, step_device, backend=backend, host="192KiB")
    with tiermem.offload(opt, cfg, streams=DeferredBackend()):
        for i, micro in enumerate(make_batches(model, STEPS)):
            lowp_step(model, opt, ref_params, ref, micro, i, names)
        sd = opt.state_dict()
    for i, r in enumerate(ref_params):
        if ref.state.get(r):
            assert_same_tensor(sd["state"][i]["master_param"], r.detach(), f"{names[i]} master")
            assert_same_tensor(sd["state"][i]["exp_avg_sq"], ref.state[r]["exp_avg_sq"],
                               f"{names[i]} exp_avg_sq")


def int8_run(tmp_path, backend, *, dtype, master, step_device=None, mix="mixed",
             moments="int8"):
    """Synthetic (in `dtype`) with int8 moments (or `moments`): through the emulated lanes
    (step_device given) or updated in place on the host (None: the native pass on host
    records). Returns the weights and the exported state after STEPS steps."""
    torch.manual_seed(0)
    model = Synthetic().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    cfg = lane_config(tmp_path, step_device or "cpu", kernel="auto", backend=backend,
                      **MIXES[mix])
    cfg["optimizer"].update(state_dtype=moments, master_weights=master)
    emulate = step_device is not None
    with tiermem.offload(opt, cfg, streams=DeferredBackend() if emulate else None) as tm:
        train(model, opt, make_batches(model, STEPS))
        weights = [p.detach().clone() for p in model.parameters()]
        sd, stats = opt.state_dict(), tm.stats()
        tm.discard()
    if emulate:
        assert all(s["h2d_bytes"] > 0 for s in stats)  # the records really crossed the lanes
    if step_device == "cpu":  # every gradient crossed the lanes, none was read in place
        side = {id(model.side.weight), id(model.side.bias)}
        for i, s in enumerate(stats):
            want = sum(p.numel() * p.element_size() for p in model.parameters()
                       if side_used(i) or id(p) not in side)
            assert s["d2h_bytes"] == want, (i, s["d2h_bytes"], want)
    return weights, sd


@pytest.mark.parametrize("dtype,master,step_device,moments", [(*row, "int8")[:4] for row in [
    (torch.float32, "fp32", "cpu"), (torch.float32, "fp32", "device"),
    (torch.bfloat16, "fp32", "cpu"), (torch.bfloat16, "fp32", "device"),
    (torch.bfloat16, "kahan", "device"), (torch.bfloat16, "none", "device"),
    # kahan/none with fp32 moments: kernels.lowbit too (bf16 moments run on the CPU only)
    (torch.bfloat16, "kahan", "device", "fp32"), (torch.bfloat16, "none", "device", "fp32"),
    (torch.float16, "kahan", "device", "fp32"), (torch.float16, "none", "device"),
    # bf16 moments run on the host only: step_device cpu brings the grads over the lanes
    (torch.float32, "fp32", "cpu", "bf16"), (torch.bfloat16, "fp32", "cpu", "bf16")]])
@pytest.mark.parametrize("backend", backend_params())
def test_int8_state_through_the_lanes(tmp_path, backend, dtype, master, step_device,
                                      moments):
    """optimizer.state_dtype int8 on a model off the CPU (emulated): the update runs where
    the lanes put the record (the host for step_device cpu, the device slot for device:
    kernels.lowbit's reference on a GPU) and equals, bit for bit, the native pass on host
    records (laid out differently: the lanes keep an fp32 model's master; the update does
    not depend on where partitions are cut)."""
    got = int8_run(tmp_path / "lanes", backend, dtype=dtype, master=master,
                   step_device=step_device, moments=moments)
    want = int8_run(tmp_path / "host", backend, dtype=dtype, master=master, moments=moments)
    for i, (w, r) in enumerate(zip(got[0], want[0])):
        assert_same_tensor(w, r, f"param {i}")
    compare_state_dicts(got[1], want[1])


class DotNormed(torch.optim.Optimizer):
    """A third-party-style step with a reduction over each gradient: torch's dot product
    adds its terms in an order that depends on where the gradient lies in memory."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.reshape(-1)
                st = self.state[p]
                st["sq"] = st.get("sq", torch.zeros(())) * 0.9 + torch.dot(g, g)
                p.add_(p.grad, alpha=-group["lr"] / float(st["sq"].sqrt() + 1e-8))


@pytest.mark.parametrize("backend", backend_params())
def test_a_reduction_over_the_lanes_grads_adds_as_over_the_parameters(tmp_path, backend):
    """step_device cpu hands the generic path the grads the lanes copied to a pinned slot:
    each lies there at its parameter's own alignment, so a step's dot product over it
    equals the plain run's bit for bit (packed back to back, one differed by an ulp)."""
    model, ref_model = twin(Synthetic)
    batches = make_batches(model, STEPS)
    opt, ref = DotNormed(model.parameters()), DotNormed(ref_model.parameters())
    with tiermem.offload(opt, lane_config(tmp_path, "cpu", kernel="auto", backend=backend,
                                          **MIXES["mixed"]),
                         streams=DeferredBackend()) as tm:
        train(model, opt, batches)
        sd = opt.state_dict()
        tm.discard()
    train(ref_model, ref, batches)
    for i, (w, r) in enumerate(zip(model.parameters(), ref_model.parameters())):
        assert_same_tensor(w, r, f"param {i}")
    compare_state_dicts(sd, ref.state_dict())


@pytest.mark.parametrize("master", ["kahan", "none"])
def test_master_less_weights_refuse_the_offload_route(tmp_path, master):
    """kahan/none update the model's bf16 weights where they live: with step_device cpu a
    model off the CPU would be updated on host grads away from them, so it is refused."""
    with pytest.raises(ConfigError, match="optimizer.step_device: device"):
        int8_run(tmp_path, "threads", dtype=torch.bfloat16, master=master, step_device="cpu")


@pytest.mark.parametrize("step_device", ["cpu", "device"])
def test_crash_consistent(tmp_path, step_device):
    """Both step devices run crash-consistent (host records written through once their
    update came back from the device): every step committed, results bitwise."""
    model, ref_model = twin(Synthetic)
    kw = dict(lr=1e-2, weight_decay=0.05)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
    batches = make_batches(model, STEPS)
    cfg = lane_config(tmp_path, step_device, host="256KiB")
    cfg["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, cfg, streams=DeferredBackend()) as tm:
        for i in range(STEPS):
            train(model, opt, batches[i: i + 1], start=i)
            assert tm.committed_step == i + 1
    train(ref_model, ref, batches)
    compare_runs(model, opt, ref_model, ref)


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("step_device", ["cpu", "device"])
@pytest.mark.parametrize("backend", backend_params())
def test_failed_transfer_rolls_back_through_the_lanes(tmp_path, backend, step_device, op):
    """A transfer failing for good in step 3 with the lanes in use: the step raises and is
    rolled back to committed step 2 (queued copies settled, nothing staged), and training
    goes on from there, bitwise against torch."""
    model, ref_model = twin(Synthetic)
    kw = dict(lr=1e-2, weight_decay=0.05)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
    batches = make_batches(model, 5)
    cfg = lane_config(tmp_path, step_device, backend=backend, host="256KiB")
    cfg["swap"]["durability"] = "crash_consistent"
    cfg["io"]["retries"] = 0
    with tiermem.offload(opt, cfg, streams=DeferredBackend()) as tm:
        train(model, opt, batches[:2])
        parts = tm.plan()["partitions"]
        inject(tm, op, 0 if op == "read" else parts // 2, times=10)
        # A write failing for good may first show as its buffer that cannot be reused.
        with pytest.raises(TierMemError) as info:
            train(model, opt, batches[2:3], start=2)
        assert "rolled back to committed step 2" in "".join(info.value.__notes__)
        opt.zero_grad()
        train(model, opt, batches[2:], start=2)  # the reopened engine has no fault
    train(ref_model, ref, batches)
    compare_runs(model, opt, ref_model, ref)


@pytest.mark.parametrize("step_device", ["cpu", "device"])
@pytest.mark.parametrize("backend", backend_params())
def test_transient_faults_through_the_lanes(tmp_path, backend, step_device):
    """A read and a write fail once each and are reissued (io.retries): nothing changes."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    batches = make_batches(model, 4)
    cfg = lane_config(tmp_path, step_device, backend=backend, host="128KiB")
    with tiermem.offload(opt, cfg, streams=DeferredBackend()) as tm:
        reads, writes = inject(tm, "read", 2), inject(tm, "write", 5)
        train(model, opt, batches)
        assert reads.injected == writes.injected == 1 and tm.faults_survived == 2
    train(ref_model, ref, batches)
    compare_runs(model, opt, ref_model, ref)


# -- ordering: the emulation catches a missing wait ---------------------------------------

# (step_device, the wait dropped): each of these waits is what keeps the result right
NEEDED = [("cpu", "the grads, before the host update reads them"),
          ("cpu", "the new weights, before the next forward"),
          ("device", "the H2D of the record"),
          ("device", "the update of the slot"),
          ("device", "the record, before its NVMe write-back is issued")]


@pytest.mark.parametrize("step_device,why", NEEDED)
def test_dropped_wait_is_caught(tmp_path, monkeypatch, step_device, why):
    """Without any one of the waits the run differs from torch's (or the emulation reports
    a copy nothing waited for): the parity tests above can fail."""
    order, host = DeviceLanes._order, DeviceLanes._host_waits
    monkeypatch.setattr(DeviceLanes, "_order", lambda self, stream, event, w:
                        None if w == why else order(self, stream, event, w))
    monkeypatch.setattr(DeviceLanes, "_host_waits", lambda self, event, w:
                        None if w == why else host(self, event, w))
    try:
        model, opt, ref_model, ref, *_ = fp32_pair(tmp_path, "threads", step_device, "mixed")
    except IntegrityError:
        # The record's checksum and the bytes written disagree: the D2H copy changed the
        # buffer after it was hashed, which the next read of the record caught (which
        # comes first, that or the end of the run, depends on the thread's timing).
        assert why == "the record, before its NVMe write-back is issued"
        return
    except TierMemError as exc:  # the emulation saw a copy nothing waited for
        assert "nothing waited for" in str(exc), exc
        return
    with pytest.raises(AssertionError):
        compare_runs(model, opt, ref_model, ref)


def test_grads_copy_waits_for_backward(tmp_path, monkeypatch):
    """Grads written by work still queued on the (emulated) compute stream, as a GPU
    backward is when step() is called: the D2H copies them only after it ran."""
    def run(drop: bool):
        order = DeviceLanes._order
        if drop:
            monkeypatch.setattr(DeviceLanes, "_order", lambda self, s, e, w: None if w.startswith(
                "backward") else order(self, s, e, w))
        model, ref_model = twin(Synthetic)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
        batches = make_batches(model, 3)
        with tiermem.offload(opt, lane_config(tmp_path, "cpu", host=0), streams=DeferredBackend()):
            compute = opt._tiermem.lanes.backend.current_stream()
            for i, micro in enumerate(batches):
                tokens, target = micro[0]
                loss_of(model, tokens, target, side_used(i)).backward()
                for p in model.parameters():  # the grads land only when the stream runs
                    if p.grad is not None:
                        final = p.grad.clone()
                        p.grad.zero_()
                        compute.enqueue(lambda g=p.grad, f=final: g.copy_(f))
                opt.step()
                opt.zero_grad()
        train(ref_model, ref, batches)
        compare_runs(model, opt, ref_model, ref)
        monkeypatch.undo()

    run(drop=False)
    with pytest.raises(AssertionError):
        run(drop=True)


def test_next_record_is_staged_before_the_current_update(tmp_path, monkeypatch):
    """Double buffering: from the second step on (records resident, not fresh) each
    partition's H2D is issued before the previous partition's update, into the other slot,
    and the two device slots are the same tensors every step (made once)."""
    log = []
    stage, update = DeviceLanes.stage, DeviceLanes.update_on_device

    def spy_stage(self, part, views):
        if part.id in self._staged:
            return stage(self, part, views)
        log.append(("stage", part.id))
        stage(self, part, views)
        log.append(("slot", part.id, self.dev.index(self._staged[part.id].slot)))

    def spy_update(self, part, views, kernel, stats):
        log.append(("update", part.id))
        update(self, part, views, kernel, stats)

    monkeypatch.setattr(DeviceLanes, "stage", spy_stage)
    monkeypatch.setattr(DeviceLanes, "update_on_device", spy_update)
    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = make_batches(model, 3)
    with tiermem.offload(opt, lane_config(tmp_path, "device", host="64MiB"),
                         streams=DeferredBackend()):
        lanes = opt._tiermem.lanes
        slots = [s.buf.data_ptr() for s in lanes.dev]
        for i, micro in enumerate(batches):
            log.clear()
            tokens, target = micro[0]
            loss_of(model, tokens, target, True).backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                continue
            updates = [e[1] for e in log if e[0] == "update"]
            assert len(updates) == len(opt._tiermem.parts)
            for prev, cur in zip(updates, updates[1:]):
                assert log.index(("stage", cur)) < log.index(("update", prev)), (prev, cur)
            slot_of = {e[1]: e[2] for e in log if e[0] == "slot"}
            used = [slot_of[p] for p in updates]
            assert all(a != b for a, b in zip(used, used[1:])), used  # alternating slots
        assert [s.buf.data_ptr() for s in lanes.dev] == slots


# -- the emulated streams themselves ------------------------------------------------------


def test_deferred_streams_run_late_and_in_order():
    b = DeferredBackend()
    s1, s2 = b.new_stream(), b.new_stream()
    out = []
    b.run(s1, lambda: out.append("a"))
    ev = b.record(s1)
    b.wait(s2, ev)
    b.run(s2, lambda: out.append("b"))
    b.run(s1, lambda: out.append("c"))
    assert out == []  # nothing waited yet
    b.synchronize(b.record(s2))
    assert out == ["a", "b"]  # s2 needed s1 up to ev, not beyond
    assert not b.record(s1).query()
    with pytest.raises(TierMemError, match="nothing waited"):
        b.check_idle([s1])
    b.host_sync(s1)
    assert out == ["a", "b", "c"]


def test_deferred_stream_cycle_is_an_error():
    """Streams waiting on each other's later work would hang a GPU: an error here."""
    b = DeferredBackend()
    s1, s2 = b.new_stream(), b.new_stream()
    e1 = b.record(s1)
    b.wait(s2, e1)
    e2 = b.record(s2)
    b.wait(s1, e2)  # s1 waits s2, which waits only s1's earlier work: fine
    b.synchronize(b.record(s1))
    s3, s4 = DeferredStream("s3"), DeferredStream("s4")
    s3.enqueue(lambda: s4.drain(2))  # s3's first op waits s4's second ...
    s3.enqueue(lambda: None)
    s4.enqueue(lambda: None)
    s4.enqueue(lambda: s3.drain(2))  # ... which waits s3's second: a cycle
    with pytest.raises(RuntimeError, match="its own later work"):
        s3.drain()


# -- property ------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=5),
       steps=st.integers(1, 4), step_device=st.sampled_from(["cpu", "device"]),
       host_fraction=st.floats(0, 1), bf16=st.booleans(),
       partition_pages=st.integers(16, 64), seed=st.integers(0, 2**16),
       backend=st.sampled_from(available_backends()))
def test_property_bitwise(tmp_path, sizes, steps, step_device, host_fraction, bf16,
                          partition_pages, seed, backend):
    """Any sizes, step counts and host/NVMe split: the weights after each step are the fp32
    fused reference's (rounded to bf16 for a bf16 model)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    state = sum(sizes) * 12
    swap = tempfile.mkdtemp(dir=tmp_path)
    cfg = lane_config(swap, step_device, backend=backend, host=int(host_fraction * state),
                      partition_size=partition_pages * 4096)
    with tiermem.offload(opt, cfg, streams=DeferredBackend()):
        for s in range(steps):
            for p, r in zip(params, ref_params):
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
                r.grad = p.grad.float()
            opt.step()
            ref.step()
            for i, (p, r) in enumerate(zip(params, ref_params)):
                assert_same_tensor(p.detach(), r.detach().to(dtype), f"step {s} param {i}")
    assert listdir(swap) == []


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [{"kernel": "native"}, {"state_dtype": "bf16"}])
def test_device_step_refuses_the_native_kernel_and_bf16_state(optimizer):
    with pytest.raises(ConfigError, match="optimizer.step_device device"):
        tiermem.load_config({"optimizer": {"step_device": "device", **optimizer}})


def test_step_device_is_validated():
    with pytest.raises(ConfigError, match="optimizer.step_device"):
        tiermem.load_config({"optimizer": {"step_device": "gpu"}})


# -- bench/gpu_check.py ---------------------------------------------------------------------


def test_gpu_check_smoke(tmp_path):
    """The GPU check's code paths, on the CPU emulation, at tiny sizes."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--smoke",
                           "--no-tests", "--swap-dir", str(tmp_path / "swap"), "--out",
                           str(out)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json
    result = json.loads(out.read_text())
    ran = [r for r in result["parity"] if r["status"] != "skipped"]
    assert ran and all(r["status"] == "ok" for r in ran)
    assert {r["overlap"] for r in ran} == {False, True}
    assert [r["step_device"] for r in result["big_model"]] == ["cpu", "device"]
    for r in result["big_model"]:
        assert r["h2d_gbps"] > 0 and r["d2h_gbps"] > 0 and r["nvme_write_gbps"] > 0
    loop = result["train_loop"]
    assert loop["returncode"] == 0 and loop["ratio"] > 0 and loop["batch"] >= 1, loop
    assert listdir(tmp_path / "swap") == []


@pytest.mark.long  # the bench script's time budget, not tiermem
def test_gpu_check_skips_the_big_model_without_time_for_it(tmp_path):
    """The big-model runs cannot be cut short once started (minutes each at 2B on a GPU):
    with less of --budget left than one needs they are skipped and said so, and the run
    still succeeds with what it measured."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--smoke",
                           "--no-tests", "--no-train-loop", "--budget", "1", "--swap-dir",
                           str(tmp_path / "swap"), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json
    result = json.loads(out.read_text())
    assert [(r["step_device"], r["status"]) for r in result["big_model"]] == [
        ("cpu", "skipped: out of time"), ("device", "skipped: out of time")]
    assert "skipped, under" in proc.stdout


def test_gpu_check_children_keep_the_callers_pythonpath(monkeypatch):
    """gpu_session.sh puts the carried cffi runtime on PYTHONPATH: the CUDA tests' child
    pytest must see it as well as this repository."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert gpu_check._child_env()["PYTHONPATH"].split(":") == [str(REPO), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert gpu_check._child_env()["PYTHONPATH"] == str(REPO)
    out = gpu_check._child([sys.executable, "-c", "import time; time.sleep(5)"], 0.5)
    assert out["returncode"] is None and out["timed_out"] and "timeout" in out["summary"]


@pytest.mark.skipif(CUDA, reason="checks the refusal without CUDA")
def test_gpu_check_refuses_without_cuda():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA" in proc.stderr


# -- on a GPU (skipped without one; bench/gpu_check.py runs them) ---------------------------


def cuda_run(tmp_path, *, mix, step_device, dtype, width=256, layers=4, steps=3,
             partition_size="64KiB", probe_after_step=False, overlap=False,
             side_stream=False):
    """A Linear stack on CUDA under tiermem against torch's fused AdamW on CUDA.
    overlap: pipeline.overlap_backward; side_stream: every iteration (forward, backward,
    step, the reference's step) runs on a stream other than the default one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]
                                ).cuda().to(dtype)
    ref_params = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.1, fused=True)
    state = sum(p.numel() for p in model.parameters()) * 12
    caps = {"gpu": (2 * state, 0), "host": (0, 2 * state), "nvme": (0, 0),
            "gpu+host+nvme": (state // 3, state // 3)}[mix]
    cfg = lane_config(tmp_path, step_device, host=caps[1], partition_size=partition_size,
                      buffer_count=4)
    cfg["tiers"]["gpu"]["capacity"] = caps[0]
    cfg["pipeline"]["overlap_backward"] = overlap
    x = torch.randn(32, width, device="cuda", dtype=dtype)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    torch.cuda.synchronize()  # x and the weights are ready before `stream` reads them
    with tiermem.offload(opt, cfg):
        for s in range(steps):
            with torch.cuda.stream(stream):
                model(x).float().square().mean().backward()
                for p, r in zip(model.parameters(), ref_params):
                    r.grad = p.grad.float()
                opt.step()
                if probe_after_step:
                    # Work queued on the stream right after step() reads the weights: it
                    # must see the updated ones (the stream waited the copies).
                    probe = [p.detach().float().sum() for p in model.parameters()]
                ref.step()
                opt.zero_grad()
            torch.cuda.synchronize()
            for i, (p, r) in enumerate(zip(model.parameters(), ref_params)):
                want = r.detach().to(dtype)
                if step_device == "device" or mix == "gpu":
                    assert_same_tensor(p.detach(), want, f"step {s} param {i}")
                else:  # fused CPU against fused CUDA arithmetic: a few ulps
                    torch.testing.assert_close(p.detach().float(), want.float(),
                                               rtol=1e-2 if dtype != torch.float32 else 1e-5,
                                               atol=1e-6)
                if probe_after_step:
                    assert float(probe[i]) == float(p.detach().float().sum()), (s, i)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("step_device", ["cpu", "device"])
@pytest.mark.parametrize("mix", ["gpu", "host", "nvme", "gpu+host+nvme"])
def test_cuda_parity(tmp_path, mix, step_device, dtype):
    cuda_run(tmp_path, mix=mix, step_device=step_device, dtype=dtype)


@needs_cuda
@pytest.mark.parametrize("step_device", ["cpu", "device"])
def test_cuda_transfer_bound_probe_after_step(tmp_path, step_device):
    """Large partitions (long copies) and a kernel on the default stream right after
    step(): a missing event wait shows up as the kernel reading old weights."""
    cuda_run(tmp_path, mix="nvme", step_device=step_device, dtype=torch.bfloat16,
             width=2048, layers=6, steps=3, partition_size="32MiB", probe_after_step=True)


@needs_cuda
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
@pytest.mark.parametrize("step_device", ["cpu", "device"])
@pytest.mark.parametrize("mix", ["nvme", "gpu+host+nvme"])
def test_cuda_overlap_backward(tmp_path, mix, step_device, side_stream):
    """pipeline.overlap_backward on a GPU: a hook fires when its gradient's kernels are
    queued, so the worker's copies and kernels must wait for them on the stream backward
    ran on. Long backward kernels (width 2048) give a missing wait time to show."""
    cuda_run(tmp_path, mix=mix, step_device=step_device, dtype=torch.bfloat16, width=2048,
             layers=6, steps=3, partition_size="8MiB", probe_after_step=True, overlap=True,
             side_stream=side_stream)


@needs_cuda
def test_cuda_crash_consistent_refuses_gpu_tier(tmp_path):
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    cfg = lane_config(tmp_path, "device", host=0)
    cfg["tiers"]["gpu"]["capacity"] = "1MiB"
    cfg["swap"]["durability"] = "crash_consistent"
    with pytest.raises(TierMemError, match="crash_consistent does not support the gpu tier"):
        with tiermem.offload(opt, cfg):
            pass


def seeded_stack(device: str, dtype: torch.dtype, cfg: dict) -> tuple[list, dict]:
    """Four 256 x 256 Linear layers on `device` trained 3 steps under tiermem with `cfg`, on
    gradients seeded alike on every device: the weights and the state_dict, on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]
                                ).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    with tiermem.offload(opt, cfg) as tm:
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(device=device, dtype=p.dtype)
            opt.step()
            opt.zero_grad()
        out = ([p.detach().cpu() for p in model.parameters()],
               torch.utils._pytree.tree_map(
                   lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, opt.state_dict()))
        tm.discard()
    return out


def assert_same_run(got: tuple[list, dict], want: tuple[list, dict]) -> None:
    for i, (w, r) in enumerate(zip(got[0], want[0])):
        assert_same_tensor(w, r, f"param {i}")
    compare_state_dicts(got[1], want[1])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["host", "nvme"])
def test_cuda_bf16_moments_on_the_host(tmp_path, mix, dtype):
    """bf16 moments of a CUDA model (step_device cpu): the native pass on the host, on
    the grads the lanes bring over, its weights sent back by them: bit for bit the same
    model trained on the CPU."""
    def cfg(swap):
        c = lane_config(swap, "cpu", kernel="auto", partition_size="64KiB", buffer_count=4,
                        **MIXES[mix])
        c["optimizer"].update(state_dtype="bf16")
        return c

    assert_same_run(seeded_stack("cuda", dtype, cfg(tmp_path / "cuda")),
                    seeded_stack("cpu", dtype, cfg(tmp_path / "cpu")))


@needs_cuda
def test_cuda_bf16_moments_refuse_the_gpu_tier(tmp_path):
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    cfg = lane_config(tmp_path, "cpu", kernel="auto", host=0)
    cfg["tiers"]["gpu"]["capacity"] = "1MiB"
    cfg["optimizer"]["state_dtype"] = "bf16"
    with pytest.raises(ConfigError, match="optimizer.state_dtype"):
        with tiermem.offload(opt, cfg):
            pass


@needs_cuda
@pytest.mark.parametrize("master,moments", [("fp32", "int8"), ("kahan", "int8"),
                                            ("none", "int8"), ("kahan", "fp32"),
                                            ("none", "fp32")])
@pytest.mark.parametrize("mix", ["gpu", "nvme", "gpu+host+nvme"])
def test_cuda_int8_state(tmp_path, mix, master, moments):
    """int8 moments (or fp32 ones with master_weights kahan/none) of a bf16 CUDA model on
    the gpu tier and through the device slots (step_device device): kernels.lowbit's
    reference on the GPU, bit for bit the native pass on the same model on the CPU (the
    same seeded gradients on both)."""
    def cfg(swap, device, gpu, host):
        c = lane_config(swap, "device" if device == "cuda" else "cpu", kernel="auto",
                        host=host, partition_size="64KiB", buffer_count=4)
        c["tiers"]["gpu"]["capacity"] = gpu
        c["optimizer"].update(state_dtype=moments, master_weights=master)
        return c

    state = 4 * 256 * 257 * 8
    gpu, host = {"gpu": (2 * state, 0), "nvme": (0, 0),
                 "gpu+host+nvme": (state // 3, state // 3)}[mix]
    assert_same_run(
        seeded_stack("cuda", torch.bfloat16, cfg(tmp_path / "cuda", "cuda", gpu, host)),
        seeded_stack("cpu", torch.bfloat16, cfg(tmp_path / "cpu", "cpu", 0, "64MiB")))
