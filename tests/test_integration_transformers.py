"""tiermem.integrations.transformers.TiermemCallback against the real Hugging Face Trainer.

The Trainer builds its own optimizer (`optim=`); the callback tiers it from on_train_begin.
Each tiered run is compared with the same Trainer run without the callback: weights and
optimizer state bitwise, the saved checkpoint's optimizer.pt bitwise, and a
`resume_from_checkpoint` run against the plain resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install -e '.[integrations]')")

from tiermem.errors import TierMemError  # noqa: E402
from tiermem.integrations.transformers import TiermemCallback  # noqa: E402
from tiermem.optim.hooks import installed  # noqa: E402

from offload_helpers import assert_same_tensor, compare_state_dicts, config, listdir  # noqa: E402


class Tiny(nn.Module):
    """Linear -> tanh -> Linear; 1100 hidden units make a few 64 KiB partitions."""

    def __init__(self, fail_at: int | None = None, hidden: int = 1100) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 8))
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x, labels):
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            raise RuntimeError("boom in forward")
        return {"loss": (self.net(x) - labels).square().mean()}


def dataset(n: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(16, generator=g), "labels": torch.randn(8, generator=g)}
            for _ in range(n)]


def train(root: Path, *, callbacks=(), resume: str | None = None,
          model: Tiny | Callable[[], Tiny] | None = None, **args_kw):
    if model is None:
        model = Tiny()
    elif not isinstance(model, nn.Module):
        model = model()  # a fresh one for each run
    kw = dict(output_dir=str(root), max_steps=4, per_device_train_batch_size=4,
              learning_rate=1e-2, weight_decay=0.05, lr_scheduler_type="linear",
              save_strategy="steps", save_steps=2, logging_strategy="no", report_to=[],
              disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0)
    kw.update(args_kw)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**kw),
                                   train_dataset=dataset(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def compare(a, b) -> None:
    (ma, ta), (mb, tb) = a, b
    for (name, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    compare_state_dicts(ta.optimizer.state_dict(), tb.optimizer.state_dict())


def cfg(tmp_path: Path, **pipeline) -> dict:
    c = config(tmp_path / "swap", host=0, kernel="match")
    c["pipeline"].update(pipeline)
    return c


class Probe(transformers.TrainerCallback):
    """What the tiered run looked like mid-training (after the block, it is gone)."""

    def __init__(self, cb: TiermemCallback) -> None:
        self.cb, self.plan, self.live_state = cb, None, None

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.plan = self.cb.tm.plan()
        self.live_state = sum(1 for s in optimizer.state.values() if s)


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _needs(module: str, *names: str) -> list:
    return [pytest.param(n, marks=pytest.mark.skipif(
        not _has(module), reason=f"{module} is not installed (the thirdparty extra)"))
        for n in names]


# Rows whose path another row takes too (bitsandbytes' optimizers all run the generic path
# on codes and scales, as adamw_bnb_8bit does; torch's Adagrad and RMSprop rules as SGD's
# torch-family rule; 4-bit torchao as 8-bit): the full tier (docs/dev/testing.md).
LONG_OPTIM = {"paged_adamw_32bit", "lion_8bit", "rmsprop_bnb_8bit", "ademamix_8bit", "adagrad",
              "rmsprop", "adamw_torch_4bit"}


def _tiered(rows: list) -> list:
    out = []
    for row in rows:
        row = row if hasattr(row, "marks") else pytest.param(row)
        long = [pytest.mark.long] if row.values[0] in LONG_OPTIM else []
        out.append(pytest.param(*row.values, marks=[*row.marks, *long], id=row.values[0]))
    return out


# The Trainer's optim= names that build an optimizer on the CPU with what the test extras
# install: torch's (the Adam rule, the torch-family rules, Adafactor on the generic path),
# bitsandbytes' 8- and 32-bit ones (generic path: uint8 codes, code maps, block scales)
# and schedule-free AdamW, whose train()/eval() the Trainer calls.
@pytest.mark.parametrize("optim", _tiered([
    "adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor",
    *_needs("bitsandbytes", "adamw_bnb_8bit", "paged_adamw_32bit", "lion_8bit",
            "rmsprop_bnb_8bit", "ademamix_8bit"),
    *_needs("schedulefree", "schedule_free_adamw"),
    # torchao's low-bit AdamW: state in tensor subclasses made of codes and block scales
    *_needs("torchao", "adamw_torch_8bit", "adamw_torch_4bit")]))
def test_trainer_built_optimizer_checkpoint_and_resume_equal_plain(tmp_path, optim):
    extra = dict(optim=optim, max_grad_norm=0.05, gradient_accumulation_steps=2)
    # torchao quantises the state of parameters its block size divides (else: fp32)
    lowbit = optim.startswith("adamw_torch_") and optim.endswith("bit")
    extra["model"] = lambda: Tiny(hidden=1024 if lowbit else 1100)
    plain = train(tmp_path / "plain", **extra)
    cb = TiermemCallback(cfg(tmp_path))
    probe = Probe(cb)
    with cb:
        tiered = train(tmp_path / "tiered", callbacks=[cb, probe], **extra)
    compare(tiered, plain)
    # the state really lived in the tiers (NVMe), not in the optimizer
    assert probe.plan["state_bytes"]["nvme"] > 0 and probe.live_state == 0
    assert probe.plan["unwrapped"] == "accelerate.optimizer.AcceleratedOptimizer"
    assert installed(tiered[1].optimizer.optimizer) is None and cb.tm is None
    assert listdir(tmp_path / "swap") == []

    sd_plain = torch.load(tmp_path / "plain/checkpoint-2/optimizer.pt", weights_only=False)
    sd_tiered = torch.load(tmp_path / "tiered/checkpoint-2/optimizer.pt", weights_only=False)
    # the Trainer's sgd has no momentum, so no state; every other one must have some
    assert bool(sd_tiered["state"]) == (optim != "sgd"), "the checkpoint's optimizer state"
    assert not lowbit or any(hasattr(type(v), "__tensor_flatten__")
                             for st in sd_plain["state"].values() for v in st.values())
    compare_state_dicts(sd_tiered, sd_plain)

    r_plain = train(tmp_path / "rp", resume=str(tmp_path / "plain/checkpoint-2"), **extra)
    cb = TiermemCallback(cfg(tmp_path))
    with cb:
        r_tiered = train(tmp_path / "rt", callbacks=[cb],
                         resume=str(tmp_path / "tiered/checkpoint-2"), **extra)
    compare(r_tiered, r_plain)
    compare(r_tiered, plain)  # the Trainer resumes its data order too


class Grab(transformers.TrainerCallback):
    """Keeps the optimizer the Trainer built (the Trainer is gone with an exception)."""

    opt = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.opt = getattr(optimizer, "optimizer", optimizer)  # inside Accelerate's wrapper


def test_failed_train_leaves_through_the_exit(tmp_path):
    # 2 steps of one forward each succeed, the third forward raises
    model = Tiny(fail_at=2)
    cb, grab = TiermemCallback(cfg(tmp_path)), Grab()
    with pytest.raises(RuntimeError, match="boom"), cb:
        train(tmp_path / "t", callbacks=[grab, cb], model=model, save_strategy="no")
    assert cb.tm is None and listdir(tmp_path / "swap") == []
    assert isinstance(grab.opt, torch.optim.AdamW)
    opt_state = [s for s in grab.opt.state.values() if s]
    assert len(opt_state) == 4 and all(float(s["step"]) == 2 for s in opt_state)


def test_overlap_is_refused_before_any_step(tmp_path):
    cb = TiermemCallback(cfg(tmp_path, overlap_backward=True))
    model = Tiny()
    with pytest.raises(TierMemError, match="overlap_backward"):
        train(tmp_path / "t", callbacks=[cb], model=model, save_strategy="no")
    assert model.calls == 0


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_clipping_with_the_weights_in_the_tiers_equals_plain(tmp_path, offload):
    # The Trainer clips through Accelerate, which reads p.grad; with parameters.offload
    # the gradients are in the parameter tier, and tiermem routes the clip there. The
    # logged grad_norm is the tier's, as the plain run's.
    extra = dict(optim="adamw_torch", max_grad_norm=0.05, gradient_accumulation_steps=2,
                 logging_strategy="steps", logging_steps=1)
    plain = train(tmp_path / "plain", **extra)
    c = cfg(tmp_path)
    c["parameters"] = {"offload": offload}
    cb = TiermemCallback(c)
    with cb:
        tiered = train(tmp_path / "tiered", callbacks=[cb], **extra)
    compare(tiered, plain)
    norms = [[e["grad_norm"] for e in t.state.log_history if "grad_norm" in e]
             for _, t in (tiered, plain)]
    assert norms[0] == norms[1] and len(norms[0]) == 4 and max(norms[0]) > 0.05
    from safetensors.torch import load_file  # the checkpoint's weights too
    saved = [load_file(tmp_path / run / "checkpoint-2/model.safetensors")
             for run in ("tiered", "plain")]
    for k, v in saved[1].items():
        assert_same_tensor(saved[0][k], v, k)
