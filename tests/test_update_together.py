"""Host-tier records updated together: OffloadedOptimizer hands the native Adam kernel the
records of a group's host partitions at once (TierManager.hold), and the kernel runs them
all in one call (tm_adam_step_runs), its threads going on from one partition to the next.
The result must be bitwise what one call per partition gives (OffloadedOptimizer._together
patched to 0), and within the native kernel's tolerance of the plain torch optimizer; the
calls are counted, so a tree that falls back to one call per partition fails here."""

from __future__ import annotations

import pytest
import torch

import tiermem
from tiermem.kernels import native_adam as na
from tiermem.optim.offloaded import OffloadedOptimizer

from offload_helpers import (Synthetic, assert_same_tensor, compare_runs, config,
                             make_batches, train, twin)

STEPS = 4


class Counting:
    """native_adam's `lib`, counting the calls of the Adam entries."""

    def __init__(self, lib):
        self._lib = lib
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not name.startswith("tm_adam_step"):
            return fn

        def counted(*a):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a)
        return counted


def groups_of(model, two: bool):
    if not two:
        return [{"params": list(model.parameters())}]
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.startswith(("emb", "fc1"))]},
            {"params": [p for n, p in named if not n.startswith(("emb", "fc1"))],
             "lr": 3e-3, "weight_decay": 0.0}]


def run(tmp_path, monkeypatch, *, dtype, amsgrad, two_groups, host, together=True):
    model, _ = twin(Synthetic)
    model.to(dtype)
    opt = torch.optim.AdamW(groups_of(model, two_groups), lr=1e-2, weight_decay=0.05,
                            amsgrad=amsgrad)
    na.torch_tail_width()  # measured once, before the C calls are counted
    counting = Counting(na.lib)
    monkeypatch.setattr(na, "lib", counting)
    joined = []  # per joined update: (partitions, C calls it made)
    if together:
        def spy(self, parts, stats):
            before = sum(counting.calls.values())
            run_together(self, parts, stats)
            joined.append((len(parts), sum(counting.calls.values()) - before))
        run_together = OffloadedOptimizer._update_together
        monkeypatch.setattr(OffloadedOptimizer, "_update_together", spy)
    else:
        monkeypatch.setattr(OffloadedOptimizer, "_together", lambda self, parts: 0)
    cfg = config(tmp_path / ("together" if together else "apart"), host=host, kernel="auto")
    with tiermem.offload(opt, cfg) as tm:
        train(model, opt, make_batches(model, STEPS))
        plan = tm.plan()
        parts = tm.offloaded.parts
    monkeypatch.undo()
    return model, opt, (counting.calls, joined), plan, parts


@pytest.mark.parametrize("two_groups", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host", ["64MiB", "256KiB"])  # all on the host; host and NVMe
def test_host_records_update_in_one_call(tmp_path, monkeypatch, dtype, amsgrad,
                                         two_groups, host):
    model, opt, calls, plan, parts = run(tmp_path, monkeypatch, dtype=dtype,
                                         amsgrad=amsgrad, two_groups=two_groups, host=host)
    apart, opt_apart, calls_apart, _, _ = run(tmp_path, monkeypatch, dtype=dtype,
                                              amsgrad=amsgrad, two_groups=two_groups,
                                              host=host, together=False)
    on_host = [p for p in parts if p.tier == "host"]
    assert len(on_host) >= 4, "the row must put several partitions on the host"
    if host != "64MiB":
        assert plan["state_bytes"]["nvme"] > 0
    # one joined update per step for each group's block of host records, each one C call
    # (NVMe records, checksummed as they are written, and a group's lone host record go
    # one by one)
    calls, joined = calls
    blocks = sum(1 for g in range(len(opt.param_groups))
                 if sum(p.group == g for p in on_host) > 1)
    assert len(joined) == STEPS * blocks
    assert all(n > 1 and c == 1 for n, c in joined), joined
    assert sum(calls_apart[0].values()) >= sum(calls.values()) + STEPS * blocks
    for (name, p), q in zip(model.named_parameters(), apart.parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
        for k, v in opt.state[p].items():
            assert_same_tensor(torch.as_tensor(v), torch.as_tensor(opt_apart.state[q][k]),
                               f"{name} state[{k!r}]")


def test_together_equals_plain_adamw(tmp_path, monkeypatch):
    """The joined call against torch's own fused AdamW (fp32 model, every record on the
    host): bit for bit where the native kernel knows torch's scalar tail, else within
    its tolerance."""
    model, ref = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    batches = make_batches(model, STEPS)
    na.torch_tail_width()  # measured once, before the C calls are counted
    counting = Counting(na.lib)
    monkeypatch.setattr(na, "lib", counting)
    with tiermem.offload(opt, config(tmp_path, host="64MiB", kernel="auto")):
        train(model, opt, batches)
    monkeypatch.undo()
    train(ref, ref_opt, batches)
    assert counting.calls == {"tm_adam_step_runs": STEPS}  # one call a step, all records
    compare_runs(model, opt, ref, ref_opt, exact=na.torch_tail_width() >= 0)


def test_a_failed_joined_call_fails_the_step(tmp_path, monkeypatch):
    """The kernel refusing the joined call fails the step with the kernel's error."""
    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, config(tmp_path, host="64MiB", kernel="auto")):
        train(model, opt, make_batches(model, 1))

        class Refusing(Counting):
            def __getattr__(self, name):
                if name == "tm_adam_step_runs":
                    return lambda *a: -22
                return super().__getattr__(name)
        monkeypatch.setattr(na, "lib", Refusing(na.lib))
        with pytest.raises(RuntimeError, match="tm_adam_step_runs failed: Invalid argument"):
            train(model, opt, make_batches(model, 1, seed=5))
        monkeypatch.undo()


def _moved_run(tmp_path, monkeypatch, *, dtype, change, together, crash=False):
    """STEPS steps of the Synthetic model with gradients the test sets itself, and between
    steps what a user may do to the memory a kept together-update points into: `change`
    "fresh": every gradient a new tensor while the last ones stay alive (other
    addresses); "strided": non-contiguous gradients; "data": each parameter's .data
    replaced by a copy after step 2 (the old memory stays alive too)."""
    model, _ = twin(Synthetic)
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    if not together:
        monkeypatch.setattr(OffloadedOptimizer, "_together", lambda self, parts: 0)
    g = torch.Generator().manual_seed(7)
    alive = []  # what the test keeps from being freed (so no address is reused)
    cfg = config(tmp_path / str(together), host="64MiB", kernel="auto")
    if crash:  # records keep an fp32 master, copied to the weights after the kernel
        cfg["swap"].update(durability="crash_consistent", checksums=False)
    joined = []
    if together:
        run_together = OffloadedOptimizer._update_together
        monkeypatch.setattr(OffloadedOptimizer, "_update_together",
                            lambda self, parts, stats: (joined.append(len(parts)),
                                                        run_together(self, parts, stats)))
    with tiermem.offload(opt, cfg):
        for step in range(STEPS):
            for p in model.parameters():
                grad = torch.randn(p.shape[::-1] if change == "strided" else p.shape,
                                   generator=g).to(dtype)
                p.grad = grad.t() if change == "strided" and p.dim() == 2 else grad
                alive.append(p.grad)
            opt.step()
            if change == "data" and step == 1:
                for p in model.parameters():
                    alive.append(p.data)
                    p.data = p.data.clone()
    monkeypatch.undo()
    assert len(joined) == (STEPS if together else 0) and all(n > 1 for n in joined)
    return model, opt


@pytest.mark.parametrize("crash", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("change", ["fresh", "strided", "data"])
def test_a_kept_together_update_follows_moved_memory(tmp_path, monkeypatch, dtype, change,
                                                     crash):
    """The together update is made ready once and kept (TogetherPlan); gradients at new
    addresses, strided gradients and parameters whose .data was replaced must reach the
    kernel as they are now: bitwise the run with one call per partition. crash: a
    crash-consistent run without checksums, whose records hold an fp32 master that the
    kept plan copies to the weights after the kernel."""
    model, opt = _moved_run(tmp_path, monkeypatch, dtype=dtype, change=change, together=True,
                            crash=crash)
    apart, opt_apart = _moved_run(tmp_path, monkeypatch, dtype=dtype, change=change,
                                  together=False, crash=crash)
    for (name, p), q in zip(model.named_parameters(), apart.parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
        for k, v in opt.state[p].items():
            assert_same_tensor(torch.as_tensor(v), torch.as_tensor(opt_apart.state[q][k]),
                               f"{name} state[{k!r}]")


def test_leaving_lets_the_records_go(tmp_path):
    """A kept together update holds views of the host records; leaving the block must not
    keep their memory alive through it (the records are often gigabytes of pinned memory),
    even while the user still holds the handle."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    model = Synthetic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, config(tmp_path, host="64MiB", kernel="auto")) as tm:
        train(model, opt, make_batches(model, 2))
        off = tm.offloaded
        assert off._plans, "the together update was not kept"
        records = [StorageWeakRef(r.untyped_storage()) for r in off.tiers.resident.values()]
    gc.collect()
    assert records and all(r.expired() for r in records), "a record outlived the block"
    assert not off._plans
