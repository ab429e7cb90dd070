"""`tiermem.offload` on the optimizer `accelerator.prepare` returns (an AcceleratedOptimizer).

The tiered loop and the plain one are the same Accelerate loop (accumulate(), backward,
clip_grad_norm_, step, zero_grad); weights and optimizer state must be bitwise equal, and
`accelerator.save_state` / `load_state` must save and resume like the plain run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed "
                                 "(pip install -e '.[integrations]')")

import tiermem  # noqa: E402
from tiermem.optim.hooks import installed  # noqa: E402
from tiermem.optim.rules import UnsupportedOptimizer  # noqa: E402

from offload_helpers import assert_same_tensor, compare_state_dicts, config, listdir  # noqa: E402

ACCUM = 2


def fresh_accelerator():
    # Accelerate keeps its state in process-wide singletons, and save_state writes every
    # optimizer an Accelerator ever prepared: each run gets its own, from a clean state.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)


def setup():
    accelerator = fresh_accelerator()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 1100), nn.Tanh(), nn.Linear(1100, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def loop(accelerator, model, opt, data, tm=None, clip: bool = True) -> None:
    """clip: off with overlap, which refuses gradients edited after backward started the
    update."""
    for x, y in data:
        with accelerator.accumulate(model):
            loss = (model(x) - y).square().mean()
            # with overlap, only the backward before a real step may start the update
            with contextlib.nullcontext() if tm is None or accelerator.sync_gradients \
                    else tm.accumulating():
                accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()


def compare(a, b) -> None:
    (_, ma, oa), (_, mb, ob) = a, b
    for (name, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), f"param {name}")
    compare_state_dicts(oa.state_dict(), ob.state_dict())


def cfg(tmp_path: Path, **pipeline) -> dict:
    c = config(tmp_path / "swap", host=0, kernel="match")
    c["pipeline"].update(pipeline)
    return c


def test_prepared_optimizer_trains_saves_and_resumes_like_plain(tmp_path):
    data = batches(8)  # 4 steps of 2 micro-batches
    plain = setup()
    loop(*plain, data[:4])
    plain[0].save_state(str(tmp_path / "plain_ckpt"))
    loop(*plain, data[4:])

    tiered = setup()
    with tiermem.offload(tiered[2], cfg(tmp_path), model=tiered[1]) as tm:
        assert tm.plan()["unwrapped"] == "accelerate.optimizer.AcceleratedOptimizer"
        assert installed(tiered[2].optimizer) is not None
        assert tm.plan()["state_bytes"]["nvme"] > 0
        loop(*tiered, data[:4])
        tiered[0].save_state(str(tmp_path / "tiered_ckpt"))
        loop(*tiered, data[4:])
    compare(tiered, plain)
    assert listdir(tmp_path / "swap") == []

    sd = lambda d: torch.load(tmp_path / d / "optimizer.bin", weights_only=False)  # noqa: E731
    assert sd("tiered_ckpt")["state"], "the checkpoint has no optimizer state"
    compare_state_dicts(sd("tiered_ckpt"), sd("plain_ckpt"))

    # resume: load the checkpoint inside the block (into the tiers), train the rest
    resumed = setup()
    with tiermem.offload(resumed[2], cfg(tmp_path), model=resumed[1]):
        resumed[0].load_state(str(tmp_path / "tiered_ckpt"))
        loop(*resumed, data[4:])
    compare(resumed, plain)


def test_overlap_with_accumulation_equals_plain(tmp_path):
    data = batches(6)
    plain = setup()
    loop(*plain, data, clip=False)
    tiered = setup()
    with tiermem.offload(tiered[2], cfg(tmp_path, overlap_backward=True), model=tiered[1]) as tm:
        loop(*tiered, data, tm=tm, clip=False)
        stats = tm.stats()
    compare(tiered, plain)
    assert len(stats) == 3 and all(s["early_partitions"] > 0 for s in stats), stats


def test_fp16_grad_scaler_is_refused(tmp_path):
    fresh_accelerator()
    opt = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    wrapped = accelerate.optimizer.AcceleratedOptimizer(
        opt, device_placement=False, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(UnsupportedOptimizer, match="GradScaler"):
        with tiermem.offload(wrapped, cfg(tmp_path)):
            pass
    assert installed(opt) is None


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_clipping_with_the_weights_in_the_tiers_equals_plain(tmp_path, offload):
    # Accelerator.clip_grad_norm_ reads p.grad itself; with parameters.offload the
    # gradients are in the parameter tier, and tiermem routes the call there
    # (tiermem/optim/clipping.py) rather than letting it clip nothing.
    own = vars(accelerate.Accelerator)["clip_grad_norm_"]
    data = batches(6)
    plain = setup()
    loop(*plain, data)
    tiered = setup()
    c = cfg(tmp_path)
    c["parameters"] = {"offload": offload}
    accelerator, model, opt = tiered
    with tiermem.offload(opt, c, model=model):
        loop(accelerator, model, opt, data)
    compare(tiered, plain)
    assert vars(accelerate.Accelerator)["clip_grad_norm_"] is own  # its own method again
