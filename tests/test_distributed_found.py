"""2-rank scenarios found by a search over what a single-process search had found buggy
(frozen parameters, set_to_none=False, grads None on some ranks, weight edits, Adagrad
groups added or never stepped, crash-consistent resumes after them): one gloo group runs
them all (tests/dist_scenarios.py), each test reports one, as test_distributed.py does."""

from __future__ import annotations

import os

import pytest

from dist_harness import launch

FOUND = ["adagrad-added-group", "fsdp2-adagrad-added-group", "dcp-adagrad-stateless",
         "crash-edit-unstepped"]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    d = tmp_path_factory.mktemp("found")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return launch(2, "dist_scenarios", "run_named", str(d), FOUND, {}, deadline=300)


def _outcome(found, name):
    for rank, (status, value) in sorted(found.items()):
        if status != "ok":
            pytest.fail(f"rank {rank} {status}: {value}")
        if value[name] != "ok":
            pytest.fail(f"rank {rank}:\n{value[name]}")


@pytest.mark.parametrize("name", FOUND)
def test_found(found, name):
    _outcome(found, name)

