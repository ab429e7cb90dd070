"""tiermem under torch.distributed: sharded state, FSDP2, distributed checkpoints, failures.

Process groups are expensive to start (each rank imports torch), so this module starts
one gloo group of 2 ranks and one of 3, runs all of their scenarios (tests/dist_scenarios.py)
in them, and each test below reports one scenario. The 2-rank group writes a DCP
checkpoint that the 3-rank group and this process (1 rank) load.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

import tiermem
from tiermem.config import ConfigError, load_config
from tiermem.dist.shard import CUT_ALIGN, pieces_in, share_cuts

from dist_harness import launch
from offload_helpers import (assert_close_tensor, assert_same_tensor, available_backends,
                             compare_state_dicts, config)

URING = "io_uring" in available_backends()
TWO = ["parity-threads", "parity-io_uring-mixed-amsgrad", "parity-lanes-cpu",
       "parity-lanes-device", "ddp-allreduced", "state-dict", "int8-nearest", "int8-kahan",
       "int8-none-stochastic", "fp32-kahan", "bf16-none-stochastic", "bf16-fp32-stochastic",
       "resume-one-step-apart", "kept-guard", "placeholders", "dcp-save", "dcp-master-modes", "fsdp2",
       "fsdp2-repadded", "torch-family", "fsdp2-torch-family",
       "recover-kept", "resume-kept-scalars", "gradscaler", "dcp-helpers-no-step",
       "dcp-helpers-no-step-allreduced", "dcp-helpers-load", "dcp-helpers-roundtrip",
       "fsdp2-dcp-helpers",
       "rank-raises"]  # rank-raises breaks the group: last
# resume-other-world runs an offload over ranks 0 and 1 only: rank-dies after it names the
# dead rank only if each group's offloads are counted apart (the c10d store keys)
THREE = ["parity-threads", "parity-io_uring-mixed-amsgrad", "dcp-load", "torch-family",
         "recover-kept", "resume-other-world",
         "rank-dies"]  # rank-dies kills rank 2: last


def _runnable(names: list[str]) -> list[str]:
    return [n for n in names if URING or "io_uring" not in n]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    os.chmod(d, 0o700)  # tiermem refuses swap paths others can write
    return d


@pytest.fixture(scope="module")
def two(base):
    return launch(2, "dist_scenarios", "run_named", str(base / "w2"), _runnable(TWO),
                  {"ckpt": str(base / "ckpt")}, deadline=600)


@pytest.fixture(scope="module")
def three(base, two):
    return launch(3, "dist_scenarios", "run_named", str(base / "w3"), _runnable(THREE),
                  {"ckpt": str(base / "ckpt")}, deadline=600)


def outcome(results: dict, name: str) -> None:
    """Fail (or skip) the test of scenario `name` from every rank's run_named results."""
    if "io_uring" in name and not URING:
        pytest.skip("io_uring is unavailable here")
    for rank, (status, value) in sorted(results.items()):
        if status == "lost" and name in value["scenarios"]:
            value = value["scenarios"]  # it died later, in a scenario that kills it
        elif status != "ok":
            pytest.fail(f"rank {rank} {status}: {value}")
        if value[name] != "ok":
            pytest.fail(f"rank {rank}:\n{value[name]}")


@pytest.mark.parametrize("name", TWO)
def test_two_ranks(two, name):
    outcome(two, name)


@pytest.mark.parametrize("name", THREE[:-1])
def test_three_ranks(three, name):
    outcome(three, name)


def test_killed_rank_is_named_by_the_others(three):
    """rank-dies: rank 2 is SIGKILLed in a step; ranks 0 and 1 name it and keep their shares
    (the scenario checks both), and the harness reports rank 2 lost, not hung."""
    status, value = three[2]
    assert status == "lost" and value["exitcode"] == -signal.SIGKILL, three[2]
    assert "rank-dies" not in value["scenarios"]
    assert value["scenarios"].keys() == set(THREE[:-1])
    for rank in (0, 1):
        status, value = three[rank]
        assert status == "ok", three[rank]
        if value["rank-dies"] != "ok":
            pytest.fail(f"rank {rank}:\n{value['rank-dies']}")


def test_dcp_checkpoint_of_two_ranks_loads_in_one_process(two, base, tmp_path):
    """The 2-rank checkpoint loads into a single process (no process group) exactly."""
    from dist_scenarios import pair
    from tiermem.dist import dcp

    outcome(two, "dcp-save")
    model, opt, *_ = pair(amsgrad=True)
    with tiermem.offload(opt, config(tmp_path, host="96KiB")) as tm:
        figures = dcp.load(tm, str(base / "ckpt"))
        sd = opt.state_dict()
    assert figures["peak_staged"] <= 2
    compare_state_dicts(sd, torch.load(str(base / "ckpt") + ".expected.pt"), exact=True)


@pytest.mark.parametrize("group", ["two", "three"])
def test_recover_puts_the_ranks_shares_back_together(request, base, tmp_path, capsys, group):
    """`tiermem recover` of one rank's directory finds the others beside it and writes the
    whole model's checkpoint: the plain optimizer's state_dict (scalars included) and the
    weights, as one process's optimizer on the mean gradient has them; FSDP2 shards too.
    A rank's directory missing, or given twice, is refused by name."""
    import tiermem.tools.cli
    from dist_scenarios import RECOVERED
    from tiermem.swap import recover as rec

    world = {"two": 2, "three": 3}[group]
    outcome(request.getfixturevalue(group), "recover-kept")
    tmp = base / f"w{world}" / "recover-kept"
    for n, _ in enumerate(RECOVERED):
        want = torch.load(tmp / f"kept{n}.expected.pt")
        out = tmp_path / f"kept{n}.pt"
        assert tiermem.tools.cli.main(["recover", str(tmp / f"tiermem-kept{n}-rank1"),
                                       "-o", str(out)]) == 0, capsys.readouterr().err
        got = torch.load(out)
        assert got["step"] == 3
        compare_state_dicts(got["optimizer"], want["optimizer"], exact=world == 2)
        for k, v in want["model"].items():
            (assert_same_tensor if world == 2 else assert_close_tensor)(
                got["model"][k], v, k)
    got = rec.gather(str(tmp / "tiermem-fsdp-rank0"))
    want = torch.load(tmp / "fsdp.expected.pt")
    for k, v in want["model"].items():
        assert_same_tensor(got["model"][k], v, k)
    for i, v in want["optimizer"].items():
        assert_same_tensor(got["optimizer"]["state"][i]["momentum_buffer"], v, f"state {i}")
    # every rank's directory named, in any order: the same checkpoint
    dirs = [str(tmp / f"tiermem-kept0-rank{r}") for r in reversed(range(world))]
    compare_state_dicts(rec.gather(*dirs)["optimizer"],
                        rec.gather(dirs[-1])["optimizer"], exact=True)
    with pytest.raises(tiermem.TierMemError, match="both hold rank"):
        rec.gather(dirs[0], dirs[0], *dirs[1:])
    # a crafted share is refused like any field, naming it
    from tiermem.swap.manifest import MANIFEST, encode
    path = tmp / "tiermem-kept0-rank1" / MANIFEST
    raw = path.read_bytes()
    for field, value, says in [("pieces", [[99, 0]], "share.pieces"),
                               ("ranks", [0, 0, 1][:world], "share.ranks"),
                               ("group_params", [[0]], "share.group_params")]:
        body = json.loads(raw)
        body["share"][field] = value
        path.write_bytes(encode(body))
        try:
            with pytest.raises(tiermem.TierMemError, match=re.escape(says)):
                rec.gather(dirs[-1])
        finally:
            path.write_bytes(raw)
    away = tmp / "rank1-away"
    os.rename(tmp / "tiermem-kept0-rank1", away)
    try:
        with pytest.raises(tiermem.TierMemError, match=r"the directories of ranks \[1\] "
                                                       r"are not beside it"):
            rec.gather(dirs[-1])
    finally:
        os.rename(away, tmp / "tiermem-kept0-rank1")


# -- shares ------------------------------------------------------------------------------


@pytest.mark.parametrize("numels,world", [
    ([31049, 62891, 1031, 34023, 33, 2013], 2), ([31049, 62891, 1031, 34023, 33, 2013], 3),
    ([33], 2), ([5000, 0, 7], 4), ([4096, 4096], 2), ([3000], 7)])
def test_shares_cover_each_element_once_cut_on_alignment(numels, world):
    cuts = share_cuts(numels, world)
    assert cuts[0] == 0 and cuts[-1] == sum(numels) and cuts == sorted(cuts)
    covered = [0] * len(numels)
    for r in range(world):
        pcs = pieces_in(numels, 0, cuts[r], cuts[r + 1])
        assert len({pc.index for pc in pcs}) == len(pcs)  # at most one piece per parameter
        for pc in pcs:
            covered[pc.index] += pc.length
            # a piece starts and ends at an aligned offset or at its parameter's end
            assert pc.start % CUT_ALIGN == 0
            assert (pc.start + pc.length) % CUT_ALIGN == 0 or pc.start + pc.length == \
                numels[pc.index]
    assert covered == list(numels)


def test_shares_are_balanced_when_parameters_are_large():
    cuts = share_cuts([1 << 20, 3 << 20], 3)
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    assert max(sizes) - min(sizes) <= 2 * CUT_ALIGN


def test_small_group_leaves_a_rank_without_a_share():
    cuts = share_cuts([33], 2)
    assert cuts == [0, 0, 33]  # the only cut would be inside 1024 elements: rank 0 owns none


# -- one process -------------------------------------------------------------------------


def test_rank_placeholder_is_zero_in_one_process(tmp_path):
    """A config written for distributed runs works in one process: {rank} is 0."""
    os.chmod(tmp_path, 0o700)
    model = torch.nn.Linear(40, 30)
    opt = torch.optim.AdamW(model.parameters())
    cfg = config(str(tmp_path / "d{rank}"))
    with tiermem.offload(opt, cfg):
        assert os.path.isdir(tmp_path / "d0" / "tiermem-default")


def test_distributed_config_is_validated():
    with pytest.raises(ConfigError, match="distributed.grads"):
        load_config({"distributed": {"grads": "sum"}})
    with pytest.raises(ConfigError, match="distributed.timeout"):
        load_config({"distributed": {"timeout": 0}})


# -- the weight all-gather's launch order (one process, a recording stand-in for c10d) ------


class _Done:
    def is_completed(self):
        return True


class _RecordingColl:
    """Rank 0 of 2: records every all-gather's window (by its first send element)."""

    rank, world = 0, 2

    def __init__(self):
        self.sent = []

    def all_gather(self, out, inp):
        self.sent.append(float(inp[0]))
        out.zero_()
        return _Done()

    def wait(self, work, what):
        pass


@pytest.mark.parametrize("backwards", [False, True])
def test_weight_windows_launch_in_a_fixed_order_once_their_partitions_are_updated(backwards):
    """Whatever order partitions are updated in, windows go out in share order (reversed
    on backward steps, as every rank does), each only after every active partition
    covering it was updated; an inactive partition holds nothing back."""
    from tiermem.partition import Partition, Segment
    from tiermem.dist.zero import ZeroLayout

    coll = _RecordingColl()
    params = [torch.nn.Parameter(torch.zeros(6144)), torch.nn.Parameter(torch.zeros(2048))]
    opt = torch.optim.Adam(params)
    lay = ZeroLayout(opt, coll, "reduce_scatter", bucket_bytes=1024 * 4)
    # Rank 0's share: elements [0, 4096) of the first parameter, in 4 windows of 1024.
    assert [w[1:] for w in lay.windows] == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    view = lay.views[0][0]
    for w in range(4):
        view[w * 1024] = w  # the first element of each window names it in the record
    parts = [Partition(i, 0, [Segment(view, 0, a, n)], ())
             for i, (a, n) in enumerate([(0, 1536), (1536, 1536), (3072, 512), (3584, 512)])]
    covers = lay.covers(parts)
    assert covers == {0: [0, 1], 1: [1, 2], 2: [3], 3: [3]}
    active = parts[:3]  # part 3 has no gradient: not stepped, never reported
    stats = {"comm_seconds": 0.0, "comm_wait_seconds": 0.0, "comm_bytes": 0,
             "weights_seconds": 0.0, "weights_wait_seconds": 0.0, "windows_early": 0}
    gather = lay.start_weights(covers, active, backwards, stats)
    launched_after = {}
    for part in (parts[2], parts[0], parts[1]):
        gather.updated(part)
        launched_after[part.id] = list(coll.sent)
    gather.finish()
    order = [3.0, 2.0, 1.0, 0.0] if backwards else [0.0, 1.0, 2.0, 3.0]
    assert coll.sent == order
    if backwards:
        # Window 3 needs only part 2 (part 3 is inactive); window 2 then waits for part 1.
        assert launched_after == {2: [3.0], 0: [3.0], 1: order}
    else:
        # Window 0 waits for part 0; window 1 (and the rest, in order) for part 1.
        assert launched_after == {2: [], 0: [0.0], 1: order}
    assert stats["windows_early"] == 4 and stats["comm_bytes"] == 4 * 2 * 1024 * 4
