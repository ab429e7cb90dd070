"""torch's gradient clipping under distributed.grads: reduce_scatter clips the averaged
gradient, as DDP does (tiermem/dist/clip.py). One 2-rank gloo group runs every scenario
of tests/dist_clip.py; each test reports one."""

from __future__ import annotations

import os

import pytest

from dist_harness import launch
from test_distributed import outcome

NAMES = ["adamw-norm", "adamw-value", "adamw-subset", "adamw-inf", "adafactor-norm",
         "adafactor-tm", "lion-norm", "edited-refused", "refusals", "plans-after-add"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("clip")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return launch(2, "dist_clip", "run_named", str(d), NAMES, {}, deadline=600)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(two, name):
    outcome(two, name)
