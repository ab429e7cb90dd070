"""The NVMe pipeline's visiting order and read-ahead, end to end on both I/O backends.

A step starts with the records still in buffers (zig-zag), those whose write-back landed
or was issued first before the one the last step wrote last; reads run ahead past those
records into buffers as they free up. Neither may change a result: SGD-momentum and
Adagrad with every record on NVMe stay bitwise equal to the plain optimizer, and every
steady step reads exactly the records not left in buffers.
"""

from __future__ import annotations

import pytest
import torch

import tiermem
from offload_helpers import backend_params, config, twin_optimizers

N_PARAMS, NUMEL, BUFFERS = 6, 20_000, 3  # 80 KB each: two 64 KiB partitions per parameter


def make(cls, kw):
    return twin_optimizers(cls, kw, [NUMEL] * N_PARAMS)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)),
    (torch.optim.Adagrad, dict(lr=0.05, weight_decay=1e-3)),
], ids=["sgd", "adagrad"])
def test_order_and_read_ahead_keep_results_and_reuse(tmp_path, backend, cls, kw):
    ps, opt, ref, ref_opt = make(cls, kw)
    steps = 6
    g = torch.Generator().manual_seed(1)
    cfg = config(tmp_path, backend=backend, buffer_count=BUFFERS, prefetch_depth=1)
    with tiermem.offload(opt, cfg) as tm:
        tm.record_events(True)
        for _ in range(steps):
            for p, r in zip(ps, ref):
                p.grad = torch.randn(NUMEL, generator=g)
                r.grad = p.grad.clone()
            opt.step()
            ref_opt.step()
        stats, events, plan = tm.stats(), tm.events(), tm.plan()
    for p, r in zip(ps, ref):
        assert torch.equal(p, r)
    for p, r in zip(ps, ref):
        for k, v in ref_opt.state[r].items():
            assert torch.equal(opt.state[p][k], v), k
    n = plan["partitions"]
    assert n > 2 * BUFFERS
    record = plan["swap_bytes"] // n
    updates, reads = {}, {}
    for e in sorted(events, key=lambda e: e.start):
        if e.name.startswith("update p"):
            updates.setdefault(e.step, []).append(e.partition)
        elif e.track == "nvme read":
            reads.setdefault(e.step, set()).add(e.partition)
    for s in stats[1:]:
        # the records left in the buffers are not read again, every other one is
        assert s["reads_skipped"] == BUFFERS
        assert s["read_bytes"]["nvme"] == (n - BUFFERS) * record
    for step in range(2, steps + 1):
        now = updates[step]
        assert sorted(now) == list(range(n))
        # a step starts with the records the last one left in the buffers; it reads the rest
        assert reads[step] == set(now[BUFFERS:])
