"""Lightning DDP (2 processes, gloo on CPU, launched as torchrun would) with TiermemCallback.

Each rank runs the plain DDP fit and then the tiered one with `{rank}` swap paths; the
tiered weights and the optimizer state handed back at the exit must be bitwise the plain
fit's on every rank, and each rank must have tiered only its share.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning.pytorch", reason="lightning is not installed "
                    "(pip install -e '.[integrations]')")

from dist_harness import launch  # noqa: E402


def rank_main(rank: int, world: int, swap: str) -> dict:
    # Lightning treats the processes as launched outside (torchrun) when LOCAL_RANK is set,
    # and keeps the process group the harness initialised.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")
    import lightning.pytorch as L
    import torch

    from tiermem.integrations.lightning import TiermemCallback
    from test_integration_lightning import Tiny, compare, cfg
    from pathlib import Path

    def fit(callbacks):
        module = Tiny()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=3,
                            logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            num_sanity_val_steps=0, callbacks=callbacks,
                            default_root_dir=swap)
        trainer.fit(module)
        return module, trainer

    plain = fit([])
    c = cfg(Path(swap))
    c["swap"]["paths"] = [os.path.join(swap, "rank{rank}")]
    c["distributed"] = {"grads": "allreduced"}  # DDP has averaged the gradients already
    cb = TiermemCallback(c)
    plans = []

    class Plan(L.Callback):
        def on_train_end(self, trainer, pl_module):
            plans.append(cb.tm.plan())

    tiered = fit([cb, Plan()])
    compare(tiered, plain)
    assert torch.distributed.get_world_size() == world
    plan = plans[0]
    assert plan["world"] == world and plan["rank"] == rank, plan
    assert plan["swap_dirs"] and all(f"rank{rank}" in d for d in plan["swap_dirs"]), plan
    return {"share": plan["share_elements"]}


def test_lightning_ddp_two_ranks(tmp_path):
    out = launch(2, "test_integration_ddp", "rank_main", str(tmp_path), deadline=240)
    for rank, (status, value) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {value}"
    shares = [out[r][1]["share"] for r in range(2)]
    n = sum(p.numel() for p in __import__("test_integration_lightning").Tiny().parameters())
    assert all(s > 0 for s in shares) and sum(shares) == n, shares  # each rank a share only
