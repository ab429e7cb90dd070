"""Every optimizer class of pytorch-optimizer, torch-optimizer, lion-pytorch, schedulefree,
bitsandbytes, adam-atan2-pytorch, came-pytorch and prodigyopt (the thirdparty extra),
tiered against its plain run: each must end
bitwise equal or be refused with tiermem's error, never different. New versions of those
packages bring new classes; this is where one that tiermem would run wrong shows up.

A class whose plain run cannot start on the test model (constructor arguments it
requires, a closure it needs) is left out: there is nothing to compare with.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import make_batches, train
from test_optimizer_rules import cfg, small


def classes(module: str) -> list[type]:
    mod = pytest.importorskip(module)
    found = {cls for cls in vars(mod).values()
             if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)}
    return sorted(found, key=lambda c: c.__name__)


def outcome(cls: type, tmp_path) -> str | None:
    """'equal', 'refused', 'different ...', or None when the plain run cannot start.

    The tiered run goes first: a class tiermem refuses needs no plain run (Kron's took two
    minutes of the suite's time on a 2-core host)."""
    torch.manual_seed(0)
    model = small()
    ref = copy.deepcopy(model)
    try:
        opt, ref_opt = cls(list(model.parameters()), lr=1e-3), cls(list(ref.parameters()),
                                                                     lr=1e-3)
        batches = make_batches(model, 4)
    except Exception:
        return None
    modes = callable(getattr(cls, "train", None))  # schedule-free style
    try:
        with tiermem.offload(opt, cfg(tmp_path, "threads", "mixed"), model=model):
            if modes:
                opt.train()
            torch.manual_seed(1)
            train(model, opt, batches)
    except UnsupportedOptimizer:
        return "refused"
    except Exception as tiered_error:
        if not plain_run(ref, ref_opt, batches, modes):
            return None  # it cannot run untiered either
        raise AssertionError(f"{cls.__name__} runs untiered but failed tiered") from tiered_error
    if not plain_run(ref, ref_opt, batches, modes):
        return None
    worst = max(float((p - q).abs().max()) for p, q in zip(model.parameters(),
                                                           ref.parameters()))
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    return "equal" if same else f"different (max abs {worst:.3g})"


def plain_run(ref, ref_opt, batches, modes: bool) -> bool:
    """The untiered reference run; False when it cannot start."""
    try:
        if modes:
            ref_opt.train()
        torch.manual_seed(1)
        train(ref, ref_opt, batches)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("module", ["pytorch_optimizer", "torch_optimizer", "lion_pytorch",
                                    "schedulefree", "bitsandbytes.optim",
                                    "adam_atan2_pytorch", "came_pytorch", "prodigyopt"])
def test_every_class_equal_or_refused(tmp_path, module):
    results = {}
    for i, cls in enumerate(classes(module)):
        got = outcome(cls, tmp_path / str(i))
        if got is not None:
            results[cls.__name__] = got
    wrong = {k: v for k, v in results.items() if v not in ("equal", "refused")}
    assert not wrong, f"tiered runs that ended different from the plain ones: {wrong}"
    # (prodigyopt's one class, Prodigy, couples its parameters: refused)
    assert sum(v == "equal" for v in results.values()) >= len(results) // 2, results
