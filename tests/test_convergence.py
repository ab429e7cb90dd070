"""bench/convergence.py in short: the state and master formats still train a language model.

A tiny byte-level GPT (bench/convergence.py's model, 1 block of width 32) trains 200
steps on the first 100 files of the standard library's source, once through
tiermem.offload with fp32 state (the reference) and once per other format, all from the
same weights on the same batches, state in the host tier. Each must bring the held-out
loss well below the unigram baseline and no more than a stated tolerance worse than the reference.
A format whose config key or value this tiermem does not have yet is skipped with the
config error; any other refusal fails. A last test shows the tolerance catches an
update that is wrong by a factor (AdamW at a tenth of the learning rate).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

import pytest
import torch

from tiermem.config import ConfigError, OptimizerSettings, load_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import convergence as cv  # noqa: E402

SETUP = cv.Setup(dim=32, layers=1, heads=2, seq=32, batch=32, steps=200, lr=1e-2, warmup=20,
                 last=20, eval_windows=64, partition_size="64KiB")
FILES = 100
SEED = 0
# Held-out loss at most this fraction of the unigram loss (3.16 nats/byte): a model that
# learned context. Measured over seeds 0-4: 0.80-0.83 for fp32 state, bf16 state and
# bf16 weights with fp32 masters.
LEARNED = 0.9
# How much worse than the fp32-state run a format may end, relative, one-sided (ending
# better is no defect), as (held-out loss, the run's mean train loss). The mean train loss
# over all 200 steps compares the same batches and is the sharp check; the held-out loss
# of one short run moves with the trajectory a rounding difference sets off. Measured over
# seeds 0-4 as format - fp32 state, held-out / run mean: bf16 state -0.66..+0.33% /
# -0.16..+0.18%, bf16 weights with fp32 masters -1.68..+0.18% / -0.41..+0.11%; on the
# int8 branch (helper/bytes b3e299e, seeds 0-2) fp32.int8 -1.06..+0.19% / -0.52..+0.18%,
# bf16.fp32.int8 -0.87..+0.38% / -0.34..+0.39%, bf16.kahan.int8 -1.54..+0.16% /
# -0.45..+0.20%, bf16.none.int8 -0.79..+0.16% / -0.52..+0.31%. Allowed: the issue's
# goals plus 2% / plus 0.5% (bf16 state and weights: 1% / 1%, as int8's goal).
TOLERANCE = {"fp32.bf16": (0.03, 0.01), "bf16.fp32.fp32": (0.03, 0.01),
             "fp32.int8": (0.03, 0.015), "bf16.fp32.int8": (0.03, 0.015),
             "bf16.kahan.int8": (0.04, 0.025), "bf16.none.int8": (0.05, 0.035),
             # master-less weights with fp32 / bf16 moments: the same goals as with int8
             "bf16.kahan.fp32": (0.04, 0.025), "bf16.none.bf16": (0.05, 0.035)}


def missing_option(combo: cv.Combo) -> str | None:
    """The config error when this tiermem lacks the key or the value the row asks for
    (optimizer.master_weights, optimizer.state_dtype int8 before they exist); None when it
    has them, and then the config must load."""
    section = combo.optimizer_section()
    fields = {f.name for f in dataclasses.fields(OptimizerSettings)}
    hints = typing.get_type_hints(OptimizerSettings)
    lacking = [k for k, v in section.items()
               if k not in fields or v not in typing.get_args(hints[k])]
    if not lacking:
        return None
    with pytest.raises(ConfigError) as refused:
        load_config(cv.tiermem_config(combo, SETUP, "/tmp/unused"))
    return str(refused.value)


@pytest.fixture(scope="module")
def data():
    torch.set_num_threads(1)  # this small a model trains fastest on one core
    corpus = cv.load_corpus(FILES)
    return corpus, cv.eval_windows(corpus, SETUP.eval_windows, SETUP.seq), cv.unigram_loss(corpus)


def run(name: str, data, tmp_path, setup: cv.Setup = SETUP) -> dict:
    corpus, eval_set, _ = data
    return cv.train(cv.COMBOS[name], SEED, corpus,
                    dataclasses.replace(setup, swap_dir=str(tmp_path)), eval_set)


def gaps(result: dict, reference: dict) -> tuple[float, float]:
    """(held-out, run-mean train) loss relative to the reference's, minus 1."""
    return tuple(result[k] / reference[k] - 1 for k in ("held_out_loss", "run_mean_loss"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The fp32-state run; it learned."""
    result = run(cv.REFERENCE, data, tmp_path_factory.mktemp("ref"))
    assert result["held_out_loss"] < LEARNED * data[2], (result, data[2])
    return result


# A bf16 model trains ~9x slower than an fp32 one on a CPU without AVX-512 BF16 (15 s a
# run on the 2-core host): the default tier runs the two master-less goals with
# int8 moments; bf16 weights with fp32 masters and the master-less ones with dense moments
# run in the full tier (TIERMEM_FULL_SWEEP=1).
LONG = {"bf16.fp32.fp32", "bf16.fp32.int8", "bf16.kahan.fp32", "bf16.none.bf16"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.long] if n in LONG else [])
                                  for n in TOLERANCE])
def test_format_trains_like_fp32_state(name, data, reference, tmp_path):
    why = missing_option(cv.COMBOS[name])
    if why:
        pytest.skip(f"not available: {why}")
    result = run(name, data, tmp_path)
    unigram = data[2]
    assert result["held_out_loss"] < LEARNED * unigram, (
        f"{name}: held-out {result['held_out_loss']:.4f}, unigram {unigram:.4f}")
    for what, gap, allowed in zip(("held-out", "run-mean train"), gaps(result, reference),
                                  TOLERANCE[name]):
        assert gap <= allowed, (f"{name}: {what} loss {100 * gap:+.2f}% against fp32 state "
                                f"(allowed {100 * allowed:g}%)")


def test_tolerance_catches_a_wrong_update(data, reference, tmp_path):
    """The plain AdamW at a tenth of the learning rate stands in for an update that is off
    by a factor (measured: +12..+18% held-out, +24..+28% run mean, seeds 0-4): outside
    every tolerance above."""
    result = run("torch", data, tmp_path, dataclasses.replace(SETUP, lr=SETUP.lr / 10))
    loosest = [max(t[i] for t in TOLERANCE.values()) for i in range(2)]
    assert all(g > t for g, t in zip(gaps(result, reference), loosest)), (result, reference)


def test_plain_adamw_matches_fp32_state(data, reference, tmp_path):
    """The reference itself: tiermem's fp32 state trains as torch.optim.AdamW does (the
    fused kernel and torch's default loop round differently, so not bit for bit)."""
    result = run("torch", data, tmp_path)
    assert result["held_out_loss"] == pytest.approx(reference["held_out_loss"], rel=1e-3)
    assert result["run_mean_loss"] == pytest.approx(reference["run_mean_loss"], rel=1e-4)
