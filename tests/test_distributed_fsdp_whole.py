"""torch's Adafactor and Muon over fully_shard (FSDP2) parameters: each parameter stepped
whole by one owner rank. One 2-rank gloo group runs every scenario of
tests/dist_fsdp_whole.py; each test reports one."""

from __future__ import annotations

import os

import pytest

from dist_harness import launch
from test_distributed import outcome

NAMES = ["adafactor", "adafactor-io_uring", "muon", "owns-nothing", "crash-resume",
         "dcp-helpers", "refusals", "other-group"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp_whole")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    from test_distributed import URING

    names = [n for n in NAMES if URING or "io_uring" not in n]
    return launch(2, "dist_fsdp_whole", "run_named", str(d), names, {}, deadline=600)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(two, name):
    outcome(two, name)
