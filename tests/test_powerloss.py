"""swap.durability: crash_consistent under simulated power loss (tests/powerloss.py).

A run is traced (record writes at the backend seam, every other durability
operation through tiermem.swap.fsops), then crashed before every sync of the
set-up and of three steps with several subsets of the unsynced operations
applied (none, all, a prefix, random subsets, writes torn at 4 KiB). Every
image must recover and resume to a committed step bitwise, or be refused
before the first commit returned. The reduced set runs here; bench/powerloss.py
runs the full one.

The harness must be able to fail: with any single sync of the commit path
switched off, it reports a bad recovery.
"""

from __future__ import annotations

import random

import pytest

from conftest import BACKEND_PARAMS, needs_io_uring
from powerloss import Disk, Scenario, powerloss, subsets
from tiermem.swap.fsops import SITES

SCENARIOS = [
    pytest.param(Scenario("threads", 1, "fp32"), id="threads-1path-fp32"),
    pytest.param(Scenario("threads", 2, "bf16"), id="threads-2path-bf16"),
    pytest.param(Scenario("threads", 1, "fp32", "overlap"), id="threads-overlap"),
    pytest.param(Scenario("io_uring", 1, "fp32", "overlap"), id="io_uring-overlap",
                 marks=needs_io_uring),
    # bf16 weights kept in the records (master_weights kahan/none, int8 moments)
    pytest.param(Scenario("threads", 1, "bf16", master="kahan"), id="threads-int8-kahan"),
    pytest.param(Scenario("io_uring", 2, "bf16", master="none"), id="io_uring-2path-int8-none",
                 marks=needs_io_uring),
]


def _root(tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    return str(root)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_power_loss_recovers_a_committed_step(tmp_path, scenario):
    rep = powerloss(scenario, _root(tmp_path), per_point=5, seed=1)
    assert rep.bad == 0, "\n".join(rep.failures[:5])
    # Some images of every kind must have resumed: a harness that refuses everything
    # (or never reaches a commit) proves nothing.
    assert rep.exact > rep.refused > 0
    assert rep.points >= 3 * 4  # set-up plus 3 steps, each with its own syncs


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_power_loss_both_backends_two_paths(tmp_path, backend):
    rep = powerloss(Scenario(backend, 2, "fp32", steps=2), _root(tmp_path), per_point=4, seed=2)
    assert rep.bad == 0, "\n".join(rep.failures[:5])
    assert rep.exact > 0


# resident.fsync is scratch mode's keep-on-disk, not a commit: not exercised here.
COMMIT_SITES = [s for s in SITES if s != "resident.fsync"]


@pytest.mark.parametrize("master", ["fp32", "kahan"])
@pytest.mark.parametrize("site", COMMIT_SITES)
def test_harness_fails_without_each_sync(tmp_path, site, master):
    """Each sync is needed: without it some crash image loses a committed step (or worse).
    The second swap path's file is the only one whose entry no manifest fsync covers.
    kahan: records holding the model's bf16 weights (int8 moments) are covered too."""
    paths = 2 if site == "swap.create.dirsync" else 1
    dtype = "fp32" if master == "fp32" else "bf16"
    rep = powerloss(Scenario("threads", paths, dtype, steps=2, master=master), _root(tmp_path),
                    per_point=3, disabled=frozenset([site]), stop_at_bad=True)
    assert rep.bad >= 1, f"{site} switched off, yet every recovery was good"


def test_disk_model_semantics(tmp_path):
    """What is durable, what may be lost, what may be torn."""
    root = str(tmp_path)
    d = Disk(root)
    f = f"{root}/f"
    d.apply(("create", f))
    d.apply(("write", f, 0, b"a" * 8192, 0))
    d.apply(("fsync", f, "s"))
    # File content synced, its directory entry not: the image may lack the file.
    dent, data = d.image([], {})
    assert dent[0] == {}
    d.apply(("dirsync", root, "s"))
    d.apply(("write", f, 0, b"b" * 8192, 7))  # in flight: never completed
    d.apply(("fsync", f, "s"))
    assert [op.kind for op in d.pending] == ["write"]  # an fsync does not cover it
    dent, data = d.image([], {})
    assert bytes(data[dent[0]["f"]]) == b"a" * 8192
    dent, data = d.image(d.pending, {d.pending[0].seq: {1}})  # torn: 2nd block only
    assert bytes(data[dent[0]["f"]]) == b"a" * 4096 + b"b" * 4096
    d.apply(("create", f"{root}/t"))
    d.apply(("rename", f"{root}/t", f"{root}/f"))
    labels = {lab for lab, _, _ in subsets(d.pending, random.Random(0), 6)}
    assert {"none", "all", "torn-last"} <= labels
    new = d.vent[0]["f"]
    dent, _ = d.image([op for op in d.pending if op.kind == "rename"], {})
    assert dent[0] == {"f": new}  # the rename alone: f names the new, empty file
    dent, _ = d.image([], {})
    assert dent[0]["f"] != new  # not persisted: the old file


def test_every_torn_committed_record_is_refused(tmp_path):
    """The model never tears a committed copy (commits sync first), so check the checksums
    directly: a committed record with any one 4 KiB block from its other copy (a write torn
    across the two generations), footer included, is refused by recover and by resume."""
    import json
    import os

    import tiermem
    from crash_run import make_optimizer
    from tiermem.swap.integrity import IntegrityError

    s = Scenario("threads", 1, "fp32", steps=2)
    root = _root(tmp_path)
    model = s.model()
    opt = make_optimizer(model)
    run = s.run_dir(root)
    with tiermem.offload(opt, s.config(root), model=model) as tm:
        for k in (1, 2):
            s.grad(model, k)
            opt.step()
        with open(os.path.join(run, "state.swap"), "rb") as f:
            image = f.read()
        with open(os.path.join(run, "manifest.json"), "rb") as f:
            manifest = f.read()
        tm.discard()
    m = json.loads(manifest)
    tiers = {str(p["id"]): p["tier"] for p in m["partitions"]}
    pids = [min((p for p in tiers if tiers[p] == t), key=int) for t in ("host", "nvme")]
    assert {tiers[p] for p in pids} == {"host", "nvme"}  # a written-through and a paged one
    from tiermem.swap.recover import gather
    for pid in pids:
        _, offset, nbytes = m["records"][pid]
        mine = offset + m["copies"][pid] * nbytes
        other = offset + (1 - m["copies"][pid]) * nbytes
        tried = 0
        for blk in range(nbytes // 4096):
            a, b = mine + blk * 4096, other + blk * 4096
            if image[a:a + 4096] == image[b:b + 4096]:
                continue  # the same bytes in both generations: nothing torn
            torn = image[:a] + image[b:b + 4096] + image[a + 4096:]
            os.makedirs(run, mode=0o700, exist_ok=True)
            with open(os.path.join(run, "state.swap"), "wb") as f:
                f.write(torn)
            with open(os.path.join(run, "manifest.json"), "wb") as f:
                f.write(manifest)
            with pytest.raises(IntegrityError):
                gather(run)
            net = s.model()
            with pytest.raises(IntegrityError):
                with tiermem.offload(make_optimizer(net), s.config(root), model=net,
                                     resume=True) as tm:
                    tm.discard()
            tried += 1
        assert tried >= nbytes // 4096 - 2, pid  # the data blocks and the footer differ


def test_scratch_state_kept_on_disk_goes_through_the_seam(tmp_path, monkeypatch):
    """Scratch mode keeps state on disk at exit when it does not fit in memory: resident.swap
    is written and fsynced through fsops (site resident.fsync) before the manifest that
    names it, and the kept state resumes bitwise."""
    import torch

    import tiermem
    import tiermem.optim.handle
    from crash_run import make_optimizer, set_grads
    from offload_helpers import compare_state_dicts
    from powerloss import Trace, recording, reference
    from tiermem.errors import TierMemWarning

    s = Scenario("threads", 1, "fp32", steps=2)
    root = _root(tmp_path)
    cfg = s.config(root)
    cfg["swap"]["durability"] = "scratch"
    monkeypatch.setattr(tiermem.optim.handle, "available_memory", lambda: 0)
    trace = Trace(root)
    model = s.model()
    opt = make_optimizer(model)
    with recording(trace), pytest.warns(TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, cfg, model=model):
            for k in (1, 2):
                set_grads(model, k)
                opt.step()
    ev = trace.events
    resident = [i for i, e in enumerate(ev) if e[0] == "fsync" and e[2] == "resident.fsync"]
    written = [i for i, e in enumerate(ev) if e[0] == "write" and e[1].endswith("resident.swap")]
    published = [i for i, e in enumerate(ev) if e[0] == "rename" and e[2].endswith("manifest.json")]
    assert written and resident and published
    assert max(written) < resident[0] < published[-1]
    monkeypatch.undo()
    weights, state = reference(s)[2]
    model2 = s.model()
    opt2 = make_optimizer(model2)
    with torch.no_grad():
        for p, w in zip(model2.parameters(), model.parameters()):
            p.copy_(w)  # scratch mode: the weights live in the model's own checkpoint
    with tiermem.offload(opt2, cfg, model=model2, resume=True) as tm:
        assert tm.resumed_step == 2
        compare_state_dicts(opt2.state_dict(), {"state": state,
                                                "param_groups": opt2.state_dict()["param_groups"]})
        tm.discard()
