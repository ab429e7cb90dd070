"""Bugs the second review found that need ranks: one 2-rank gloo group runs every scenario
of tests/dist_review2.py; each test reports one."""

from __future__ import annotations

import os

import pytest

from dist_harness import launch
from test_distributed import outcome

NAMES = ["zero-order-differs", "fsdp-order-differs"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("review2")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return launch(2, "dist_review2", "run_named", str(d), NAMES, {}, deadline=300)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(two, name):
    outcome(two, name)
