"""The parameter tier's reads ahead: past `prefetch` units while those are small, up to
the I/O queue's worth of bytes (never more than half the window)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiermem
from offload_helpers import backend_params


def _config(tmp_path, backend: str, *, prefetch: int, window: str, depth: int = 4) -> dict:
    return {"swap": {"paths": [str(tmp_path / "swap")]},
            "io": {"backend": backend, "queue_depth": depth, "block_size": "64KiB"},
            "tiers": {"host": {"capacity": 0}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2},
            "optimizer": {"kernel": "match"},
            "parameters": {"offload": "nvme", "prefetch": prefetch, "window": window}}


def _train(model, config, steps: int = 3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    with tiermem.offload(opt, config, model=model) as tm:
        tm.discard()
        for _ in range(steps):
            model(torch.randn(4, 64, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        tier = tm.offloaded.weights
        return tier, tier._ahead(tier.learned, 0), tm.param_stats()


@pytest.mark.parametrize("backend", backend_params())
def test_small_units_are_read_ahead_past_prefetch_up_to_the_queue(tmp_path, backend):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)])  # ~24 KiB records a unit
    # the window holds most of the model (~400 KiB), so weights are read again each
    # iteration, and more than twice the queue's worth
    tier, ahead, stats = _train(model, _config(tmp_path, backend, prefetch=1, window="320KiB",
                                               depth=2))
    assert tier.ahead_bytes == 2 * (64 << 10)
    sizes = [sum(tier._bytes(i) for i in tier.units[u]) for u in ahead]
    assert len(ahead) > 1  # prefetch 1 alone would take one unit
    assert sum(sizes[:-1]) < tier.ahead_bytes <= sum(sizes)
    assert stats["prefetched"] > 0


@pytest.mark.parametrize("backend", backend_params())
def test_reads_ahead_stop_at_half_the_window(tmp_path, backend):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)])
    tier, ahead, _ = _train(model, _config(tmp_path, backend, prefetch=1, window="160KiB"))
    assert tier.ahead_bytes == (160 << 10) // 2
    sizes = [sum(tier._bytes(i) for i in tier.units[u]) for u in ahead]
    assert sum(sizes[:-1]) < tier.ahead_bytes
