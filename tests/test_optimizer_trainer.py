"""The Hugging Face Trainer given `optimizers=(opt, sched)` inside `tiermem.offload`, as
docs/guide/optimizers.md shows it, with optimizers other than Adam: the run, its lr
schedule and its saved checkpoint equal the same Trainer run without tiermem."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install -e '.[integrations]')")

import tiermem  # noqa: E402

from offload_helpers import assert_same_tensor, config, listdir  # noqa: E402
from test_integration_transformers import Tiny, dataset  # noqa: E402
from test_optimizer_rules import state_equal  # noqa: E402


def same_state(sd, ref, what):
    state_equal(sd, ref, what)
    assert sd["param_groups"] == ref["param_groups"], what


def run(root, cls, kw, *, tiered):
    model = Tiny()
    opt = cls(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(root / "out"), max_steps=4, per_device_train_batch_size=4,
        save_strategy="steps", save_steps=2, logging_strategy="no", report_to=[],
        disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   optimizers=(opt, sched))
    if tiered:
        cfg = config(root / "swap", host=0, kernel="match")
        with tiermem.offload(opt, cfg, model=model) as tm:
            trainer.train()
            assert tm.plan()["state_bytes"]["nvme"] > 0
            # the per-parameter state lives in the tiers (MADGRAD's count in state['k'] stays)
            assert not any(v for k, v in opt.state.items() if isinstance(k, torch.Tensor))
    else:
        trainer.train()
    return model, opt, sched


@pytest.mark.parametrize("cls, kw", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (torch.optim.Adagrad, dict(lr=0.05)),
    (torch.optim.RMSprop, dict(lr=0.01, centered=True)),
    # the generic path, with a count in opt.state["k"]: in the Trainer's optimizer.pt too
    (("pytorch_optimizer", "MADGRAD"), dict(lr=1e-3)),
])
def test_trainer_with_optimizers_inside_offload(tmp_path, cls, kw):
    if isinstance(cls, tuple):
        cls = getattr(pytest.importorskip(cls[0]), cls[1])
    plain = run(tmp_path / "plain", cls, kw, tiered=False)
    tiered = run(tmp_path / "tiered", cls, kw, tiered=True)
    for (name, p), (_, q) in zip(tiered[0].named_parameters(), plain[0].named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    same_state(tiered[1].state_dict(), plain[1].state_dict(), "after training")
    assert tiered[2].get_last_lr() == plain[2].get_last_lr()
    ckpt = "out/checkpoint-2/optimizer.pt"
    same_state(torch.load(tmp_path / "tiered" / ckpt, weights_only=False),
               torch.load(tmp_path / "plain" / ckpt, weights_only=False), "checkpoint-2")
    assert listdir(tmp_path / "tiered" / "swap") == []
