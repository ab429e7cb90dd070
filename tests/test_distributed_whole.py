"""Rules that step whole parameters (torch's Adafactor and Muon) under a process group:
ZeRO shares cut between parameters. One 2-rank gloo group runs every scenario of
tests/dist_whole.py; each test reports one."""

from __future__ import annotations

import os

import pytest
import torch

from tiermem.dist.shard import share_cuts

from dist_harness import launch
from offload_helpers import assert_same_tensor, compare_state_dicts
from test_distributed import outcome

NAMES = ["adafactor", "adafactor-allreduced", "adafactor-crash-consistent", "muon", "kept"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("whole")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return d


@pytest.fixture(scope="module")
def two(base):
    return launch(2, "dist_whole", "run_named", str(base), NAMES, {}, deadline=600)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(two, name):
    outcome(two, name)


def test_recover_puts_whole_parameters_back_together(two, base, tmp_path):
    """`tiermem recover` of one rank's directory: each parameter's Adafactor entry (row and
    column statistics in their own shapes) from the rank that owned it, and the weights."""
    from tiermem.swap import recover as rec

    outcome(two, "kept")
    tmp = base / "kept"
    want = torch.load(tmp / "kept.expected.pt")
    got = rec.gather(str(tmp / "tiermem-kept-rank1"))
    assert got["step"] == 3
    compare_state_dicts(got["optimizer"], want["optimizer"], exact=True)
    for k, v in want["model"].items():
        assert_same_tensor(got["model"][k], v, k)


@pytest.mark.parametrize("numels, world, cuts", [
    ([10, 10, 10, 10], 2, [0, 20, 40]),
    ([100, 1, 1], 2, [0, 100, 102]),        # the cut goes to the nearer end of the big one
    ([1, 1, 100], 2, [0, 2, 102]),
    ([5], 3, [0, 0, 5, 5]),                  # one parameter: one rank owns it
    ([3, 3, 3], 4, [0, 3, 3, 6, 9]),
])
def test_whole_cuts_fall_between_parameters(numels, world, cuts):
    assert share_cuts(numels, world, whole=True) == cuts
