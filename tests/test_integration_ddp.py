"""The integrations under DDP: 2 processes, gloo on CPU, launched as torchrun would.

Lightning (TiermemCallback), Accelerate (tiermem.offload on the prepared optimizer) and the
Hugging Face Trainer (its TiermemCallback): each rank runs the plain DDP run and then the
tiered one with `{rank}` swap paths; the tiered weights and the optimizer state handed back
at the exit must be bitwise the plain run's on every rank, and each rank must have tiered
only its share.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dist_harness import launch


def torchrun_env(rank: int, world: int, port: int) -> None:
    """What torchrun sets: the frameworks then take the processes as launched outside and
    keep the process group the harness initialised."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def sharded_config(base: dict, swap: str) -> dict:
    base["swap"]["paths"] = [os.path.join(swap, "rank{rank}")]
    base["distributed"] = {"grads": "allreduced"}  # DDP has averaged the gradients already
    return base


def check_share(plan: dict, rank: int, world: int, model) -> dict:
    assert plan["world"] == world and plan["rank"] == rank, plan
    assert plan["swap_dirs"] and all(f"rank{rank}" in d for d in plan["swap_dirs"]), plan
    return {"share": plan["share_elements"], "numel": sum(p.numel() for p in model.parameters())}


def check_shares(out: dict) -> None:
    for rank, (status, value) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {value}"
    shares = [out[r][1]["share"] for r in range(len(out))]
    n = out[0][1]["numel"]
    assert all(s > 0 for s in shares) and sum(shares) == n, shares  # each rank a share only


def rank_main(rank: int, world: int, swap: str, optimizer: str = "adamw") -> dict:
    """optimizer "sgd": SGD with Nesterov momentum and the same step schedule, which the
    sharded path runs as its own torch class (not only Adam/AdamW)."""
    torchrun_env(rank, world, 29599 if optimizer == "adamw" else 29596)
    import lightning.pytorch as L
    import torch

    from tiermem.integrations.lightning import TiermemCallback
    from test_integration_lightning import Tiny, compare, cfg

    class TinySGD(Tiny):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def fit(callbacks):
        module = Tiny() if optimizer == "adamw" else TinySGD()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=3,
                            logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            num_sanity_val_steps=0, callbacks=callbacks,
                            default_root_dir=swap)
        trainer.fit(module)
        return module, trainer

    plain = fit([])
    cb = TiermemCallback(sharded_config(cfg(Path(swap)), swap))
    plans = []

    class Plan(L.Callback):
        def on_train_end(self, trainer, pl_module):
            plans.append(cb.tm.plan())

    tiered = fit([cb, Plan()])
    compare(tiered, plain)
    assert torch.distributed.get_world_size() == world
    return check_share(plans[0], rank, world, tiered[0])


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_lightning_ddp_two_ranks(tmp_path, optimizer):
    pytest.importorskip("lightning.pytorch", reason="lightning is not installed "
                        "(pip install -e '.[integrations]')")
    out = launch(2, "test_integration_ddp", "rank_main", str(tmp_path), optimizer,
                 deadline=240)
    check_shares(out)


def accelerate_rank_main(rank: int, world: int, swap: str) -> dict:
    torchrun_env(rank, world, 29598)
    import torch

    import tiermem
    from test_integration_accelerate import batches, cfg, compare, loop, setup

    # Each rank its own batches, as a distributed sampler would give.
    data = batches(4 * (rank + 1))[4 * rank:]
    plain = setup()
    assert plain[0].num_processes == world
    loop(*plain, data)
    tiered = setup()
    with tiermem.offload(tiered[2], sharded_config(cfg(Path(swap)), swap)) as tm:
        loop(*tiered, data)
        plan = tm.plan()
    compare(tiered, plain)
    assert torch.distributed.get_world_size() == world
    return check_share(plan, rank, world, tiered[1])


def test_accelerate_ddp_two_ranks(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed "
                        "(pip install -e '.[integrations]')")
    out = launch(2, "test_integration_ddp", "accelerate_rank_main", str(tmp_path),
                 deadline=240)
    check_shares(out)


def trainer_rank_main(rank: int, world: int, swap: str) -> dict:
    torchrun_env(rank, world, 29597)
    import torch
    import transformers

    from tiermem.integrations.transformers import TiermemCallback
    from test_integration_transformers import cfg, compare, train

    extra = dict(save_strategy="no", ddp_backend="gloo", max_grad_norm=0.05)
    plain = train(Path(swap) / "plain", **extra)
    cb = TiermemCallback(sharded_config(cfg(Path(swap)), swap))
    plans = []

    class Plan(transformers.TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            plans.append(cb.tm.plan())

    # Plan before the tiermem callback: on_train_end runs in order and tiermem's leaves.
    with cb:
        tiered = train(Path(swap) / "tiered", callbacks=[Plan(), cb], **extra)
    compare(tiered, plain)
    assert torch.distributed.get_world_size() == world
    return check_share(plans[0], rank, world, tiered[0])


def test_trainer_ddp_two_ranks(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed "
                        "(pip install -e '.[integrations]')")
    out = launch(2, "test_integration_ddp", "trainer_rank_main", str(tmp_path), deadline=240)
    check_shares(out)
