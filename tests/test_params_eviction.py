"""The window evicts by next use in the learned order (the weight needed furthest ahead
goes first): fewer weight bytes read than least-recently-used eviction on the same model,
and never a wrong or missing weight, in or out of the learned order."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tiermem
from offload_helpers import backend_params
from tiermem.params.tier import ParamTier

LAYERS, D = 8, 96


class Stack(nn.Module):
    """Linear layers run in order; `detour` runs the first ones again at the end (a
    request the learned order does not expect)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))
        self.detour = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.detour:
            for layer in self.layers[:3]:
                x = torch.tanh(layer(x))
        return x.square().mean()


def _config(tmp_path, backend: str, *, overlap: bool, window: str, swap: str = "swap") -> dict:
    return {"swap": {"paths": [str(tmp_path / swap)]},
            "io": {"backend": backend, "queue_depth": 4, "block_size": "16KiB"},
            "tiers": {"host": {"capacity": 0}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2,
                         "overlap_backward": overlap},
            "optimizer": {"kernel": "match"},
            "parameters": {"offload": "nvme", "prefetch": 2, "window": window}}


def _data(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, D, generator=gen) for _ in range(n)]


def _plain(model: Stack, data, detours) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step, x in enumerate(data):
        model.detour = step in detours
        loss = model(x)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _tiered(model: Stack, data, config, detours) -> tuple[list[float], list[int], dict]:
    """Losses, weight bytes read in each iteration after the first, and the counters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, reads = [], []
    with tiermem.offload(opt, config, model=model) as tm:
        tier = tm.offloaded.weights
        for step, x in enumerate(data):
            model.detour = step in detours
            before = tm.param_stats()["bytes_read"]
            loss = model(x)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            if step:
                reads.append(tm.param_stats()["bytes_read"] - before)
        stats = tm.param_stats()
        assert stats["peak_window_bytes"] <= tier.window
    return losses, reads, stats


def _least_recently_used(self, free, before=None):
    """The eviction before next use: the least recently used weight, whatever the order."""
    return next(iter(free), None)


@pytest.mark.parametrize("backend", backend_params())
def test_next_use_reads_fewer_bytes_than_least_recently_used(tmp_path, backend, monkeypatch):
    # 8 layers of ~40 KiB records (weight + bias): the window holds about seven of them
    torch.manual_seed(0)
    ref = Stack()
    data = _data(5)
    want = _plain(copy.deepcopy(ref), data, ())
    window = "288KiB"
    got, reads, _ = _tiered(copy.deepcopy(ref), data, _config(
        tmp_path, backend, overlap=False, window=window, swap="next"), ())
    monkeypatch.setattr(ParamTier, "_furthest", _least_recently_used)
    lru, lru_reads, _ = _tiered(copy.deepcopy(ref), data, _config(
        tmp_path, backend, overlap=False, window=window, swap="lru"), ())
    assert got == want == lru
    # the steps run after backward on one thread: the same reads in every run
    assert sum(reads) < sum(lru_reads), (reads, lru_reads)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
@pytest.mark.parametrize("backend", backend_params())
def test_out_of_order_requests_still_get_their_weights(tmp_path, backend, overlap):
    torch.manual_seed(0)
    ref = Stack()
    model = copy.deepcopy(ref)
    data = _data(6)
    detours = (2, 4)
    want = _plain(ref, data, detours)
    got, _, stats = _tiered(model, data, _config(tmp_path, backend, overlap=overlap,
                                                 window="224KiB"), detours)
    assert got == want
    assert stats["out_of_order"] > 0 and stats["on_demand"] > 0
    assert stats["evictions"] > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
