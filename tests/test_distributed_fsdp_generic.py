"""The generic path (third-party optimizers, subclasses with a step of their own) over
fully_shard (FSDP2) parameters, each parameter stepped whole by one owner rank; and the
generic path with GradScaler under a process group. One 2-rank gloo group runs every
scenario of tests/dist_fsdp_generic.py; each test reports one."""

from __future__ import annotations

import os

import pytest

from dist_fsdp_generic import missing
from dist_harness import launch
from test_distributed import outcome

NAMES = ["lion", "lamb", "adan", "schedulefree", "counting-sgd",
         "schedulefree-crash-consistent", "adafactor-subclass", "closure",
         "crash-resume-schedulefree", "crash-resume-counting-sgd", "dcp-counting-sgd",
         "resume-one-step-apart", "resume-one-step-apart-adafactor",
         "dcp-helpers-lion", "dcp-helpers-counting-sgd", "refusals",
         "gradscaler-allreduced-lion", "gradscaler-allreduced-counting-sgd",
         "gradscaler-allreduced-own-scaling"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp_generic")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    names = [n for n in NAMES if missing(n) is None]
    return launch(2, "dist_fsdp_generic", "run_named", str(d), names, {}, deadline=600)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(two, name):
    if missing(name):
        pytest.skip(f"{missing(name)} is not installed (the thirdparty test extra)")
    outcome(two, name)
