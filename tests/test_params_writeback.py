"""Updated weights go back to their records as each parameter's update finishes, from the
buffer they live in, and nothing changes that buffer while the write is in flight: the
next update (or a load) waits for it. Plain training stays bitwise the reference's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tiermem
from offload_helpers import backend_params
from tiermem.params.records import WEIGHT


def _config(tmp_path, backend: str, *, overlap: bool) -> dict:
    return {"swap": {"paths": [str(tmp_path / "swap")]},
            "io": {"backend": backend, "queue_depth": 4, "block_size": "64KiB"},
            "tiers": {"host": {"capacity": 0}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2,
                         "overlap_backward": overlap},
            "optimizer": {"kernel": "match"},
            # the window holds the whole model: nothing is evicted, so only the update's
            # own write-back puts the new weights in the records
            "parameters": {"offload": "nvme", "prefetch": 2, "window": "2MiB"}}


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
@pytest.mark.parametrize("backend", backend_params())
def test_weights_written_as_their_update_finishes(tmp_path, backend, overlap):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64)])
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 64, generator=gen) for _ in range(4)]
    with tiermem.offload(opt, _config(tmp_path, backend, overlap=overlap), model=model) as tm:
        tier = tm.offloaded.weights
        dirty_at_end, settled = [], []
        real_done, real_settle = tier.step_done, tier.records.settle

        def step_done():
            dirty_at_end.append(set(tier.dirty))
            real_done()

        def settle(kind, index):
            settled.append((kind, index))
            real_settle(kind, index)

        tier.step_done, tier.records.settle = step_done, settle
        for x in batches:
            settled.clear()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            # every parameter's update waited for the write of its last update first
            assert {i for k, i in settled if k == WEIGHT} == set(range(len(tier.params)))
            tier.records.drain()
            for i, p in enumerate(tier.params):
                assert i in tier.live  # still in the window, not evicted
                assert torch.equal(tier.records.fetch(WEIGHT, i).wait(), p.detach())
        # nothing was left for the end of the step to write
        assert dirty_at_end == [set()] * len(batches)
    for x in batches:
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)
