"""optimizer.add_param_group() inside tiermem.offload under a process group for the rules
that step whole parameters (torch's Adafactor and Muon, the generic path), over ZeRO shares
and over fully_shard (FSDP2) parameters. One 2-rank gloo group runs every scenario of
tests/dist_addgroup.py; each test reports one."""

from __future__ import annotations

import os

import pytest

from dist_harness import launch
from test_distributed import URING, outcome

NAMES = ["zero-adafactor", "zero-adafactor-allreduced-io_uring", "zero-muon",
         "zero-crash-resume", "zero-differs", "fsdp-adafactor", "fsdp-adafactor-io_uring",
         "fsdp-muon", "fsdp-counting-sgd", "fsdp-crash-resume", "fsdp-refusals"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("addgroup")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    names = [n for n in NAMES if URING or "io_uring" not in n]
    return launch(2, "dist_addgroup", "run_named", str(d), names, {}, deadline=600)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(two, name):
    outcome(two, name)
