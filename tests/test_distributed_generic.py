"""The generic path (third-party optimizers, subclasses with a step of their own) under a
process group: ZeRO shares of whole parameters, each stepped by an optimizer of the user's
class (over fully_shard parameters: tests/test_distributed_fsdp_generic.py). One 2-rank
gloo group runs every scenario of tests/dist_generic.py; each test reports one."""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import launch
from offload_helpers import assert_same_tensor, compare_state_dicts
from test_distributed import outcome

# (counting-sgd's resume: resume-after-crash, a commit as a crash leaves it)
NAMES = ["lion-like", "lion-like-allreduced-io_uring", "counting-sgd",
         "counting-sgd-allreduced", "lion", "schedulefree",
         "schedulefree-allreduced-crash-consistent", "closure", "coupling-refused",
         "added-group", "loose-state-refused", "half-loaded-one-rank", "resume-schedulefree",
         "resume-after-crash", "kept", "unusable-share-left-scratch",
         "unusable-share-left-scratch-on-error", "unusable-share-left-crash_consistent",
         "unusable-share-left-crash_consistent-on-error", "write-back-failed-at-exit-scratch",
         "write-back-failed-at-exit-crash_consistent"]


def _missing(name: str) -> str | None:
    """The PyPI package scenario `name` needs, if it is not installed."""
    import importlib.util

    module = ("lion_pytorch" if name == "lion" else
              "schedulefree" if "schedulefree" in name else None)
    return module if module and importlib.util.find_spec(module) is None else None


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("generic")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return d


@pytest.fixture(scope="module")
def two(base):
    names = [n for n in NAMES if _missing(n) is None]
    return launch(2, "dist_generic", "run_named", str(base), names, {}, deadline=600)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(two, name):
    if _missing(name):
        pytest.skip(f"{_missing(name)} is not installed (the thirdparty test extra)")
    outcome(two, name)


def test_recover_puts_whole_parameters_back_together(two, base):
    """`tiermem recover` of one rank's directory: each parameter's entry from the rank that
    owned it, the counts the step keeps in the groups, and the weights."""
    from tiermem.swap import recover as rec

    outcome(two, "kept")
    tmp = base / "kept"
    want = torch.load(tmp / "kept.expected.pt")
    got = rec.gather(str(tmp / "tiermem-kept-rank1"))
    assert got["step"] == 3
    compare_state_dicts(got["optimizer"], want["optimizer"], exact=True)
    for k, v in want["model"].items():
        assert_same_tensor(got["model"][k], v, k)
