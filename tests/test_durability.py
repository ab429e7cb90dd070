"""swap.durability: crash_consistent inside one process — parity, roll-back of a failed
step, a commit that cannot be written (full disk, swap directory removed), and
RLIMIT_MEMLOCK at the offload level. Crashes of a whole process: tests/test_crash.py."""

from __future__ import annotations

import copy
import errno
import os
import shutil

import pytest
import torch

import tiermem
from conftest import BACKEND_PARAMS, run_without_ipc_lock
from crash_run import crash_config, make_model, make_optimizer, run_killed, set_grads
from faults import inject
from offload_helpers import (assert_same_tensor, compare_runs, compare_state_dicts, swap_dir,
                             tmpfs)
from tiermem.errors import TierMemError, TierMemIOError
from tiermem.swap.manifest import MANIFEST, read_manifest

STEPS = 4


def trajectory(dtype: torch.dtype = torch.float32):
    """(model, optimizer) copies of plain fp32 AdamW after 0..STEPS steps, from the
    weights a `dtype` model starts with and the gradients it would give."""
    ref = make_model(dtype).float()
    opt = make_optimizer(ref)
    out = [copy.deepcopy((ref, opt))]
    for k in range(1, STEPS + 1):
        set_grads(ref, k)
        for p in ref.parameters():
            p.grad = p.grad.to(dtype).float()
        opt.step()
        out.append(copy.deepcopy((ref, opt)))  # one memo: the copy keys state by its params
    return out


REF = trajectory()


def ref_at(k: int):
    return REF[k]


def assert_at(model, opt, k: int) -> None:
    """Weights and the state handed back equal plain AdamW after k steps."""
    ref_model, ref_opt = ref_at(k)
    compare_runs(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("host", ["0", "160KiB", "1MiB"], ids=["nvme", "mixed", "host"])
def test_parity_and_commits(tmp_path, backend, host):
    """Bitwise AdamW for every placement; every step leaves a manifest naming it."""
    cfg = crash_config(str(tmp_path), backend)
    cfg["tiers"]["host"]["capacity"] = host
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model) as tm:
        assert tm.committed_step == 0
        plan = tm.plan()
        # Two copies of every record, resident ones too, each with its 4 KiB footer.
        records = sum(plan["state_bytes"].values()) + 4096 * plan["partitions"]
        assert plan["swap_bytes"] == 2 * records
        for k in range(1, STEPS + 1):
            set_grads(model, k)
            opt.step()
            assert tm.committed_step == k
            m = read_manifest(str(swap_dir(tmp_path)), None)
            assert (m.step, m.durability) == (k, "crash_consistent")
            assert set(m.copies.values()) <= {0, 1}
    assert_at(model, opt, STEPS)
    assert not swap_dir(tmp_path).exists()


def test_bf16_model_resumes_from_master(tmp_path):
    """A bf16 model killed after step 2: the resume puts back bf16(master) of step 2, and
    the optimizer state (fp32 master and moments) is bitwise fp32 AdamW's on bf16 grads."""
    run_killed(tmp_path, "threads", "after-step:2", 3, "bf16")
    ref_model, ref_opt = trajectory(torch.bfloat16)[2]
    model = make_model(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = make_optimizer(model)
    with tiermem.offload(opt, crash_config(str(tmp_path), "threads"), model=model,
                         resume=True) as tm:
        assert tm.resumed_step == 2
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_same_tensor(p.detach(), q.detach().to(torch.bfloat16), "bf16 weight")
        sd = opt.state_dict()
        for i, q in enumerate(ref_model.parameters()):
            assert_same_tensor(sd["state"][i]["master_param"], q.detach(), "master")
            for k in ("exp_avg", "exp_avg_sq"):
                assert_same_tensor(sd["state"][i][k], ref_opt.state[q][k], k)
        tm.discard()


def test_bf16_state_resumes_bitwise(tmp_path):
    """optimizer.state_dtype bf16 (stochastic rounding, seeded per step and partition): a
    run killed after step 2 resumes to exactly what an uninterrupted run holds then."""
    cfg = crash_config(str(tmp_path / "ref"), "threads", "bf16")
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model) as tm:
        for k in (1, 2):
            set_grads(model, k)
            opt.step()
        weights = [p.detach().clone() for p in model.parameters()]
        state = opt.state_dict()
        tm.discard()
    swap = tmp_path / "run"
    run_killed(swap, "threads", "after-step:2", 3, "fp32", "bf16")
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, crash_config(str(swap), "threads", "bf16"), model=model,
                         resume=True) as tm:
        assert tm.resumed_step == 2
        for p, w in zip(model.parameters(), weights):
            assert_same_tensor(p.detach(), w, "weights")
        compare_state_dicts(opt.state_dict(), state)
        tm.discard()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("op", ["read", "write"])
def test_failed_step_rolls_back(tmp_path, backend, op):
    """A transfer failing for good in step 3: the step raises, the optimizer and the model
    are back at step 2, and training goes on from there."""
    cfg = crash_config(str(tmp_path), backend)
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model) as tm:
        for k in (1, 2):
            set_grads(model, k)
            opt.step()
        parts = tm.plan()["partitions"]
        inject(tm, op, 0 if op == "read" else parts // 2, times=10)
        set_grads(model, 3)
        with pytest.raises(TierMemIOError) as info:
            opt.step()
        assert "rolled back to committed step 2" in "".join(info.value.__notes__)
        assert tm.committed_step == 2
        compare_state_dicts(opt.state_dict(), ref_at(2)[1].state_dict())
        for p, q in zip(model.parameters(), ref_at(2)[0].parameters()):
            assert_same_tensor(p.detach(), q.detach(), "weights after roll-back")
        for k in (3, 4):  # the new engine has no fault
            set_grads(model, k)
            opt.step()
    assert_at(model, opt, 4)


def test_rollback_impossible_keeps_committed_state(tmp_path, monkeypatch):
    """The roll-back itself fails (here: its manifest cannot be read): further steps are
    refused, the exit keeps the last committed step on disk and warns, and a resume
    continues from it."""
    cfg = crash_config(str(tmp_path), "threads")
    model = make_model()
    opt = make_optimizer(model)
    with pytest.warns(tiermem.TierMemWarning, match="committed step 1 stays on disk"):
        with tiermem.offload(opt, cfg, model=model) as tm:
            set_grads(model, 1)
            opt.step()

            def unreadable(*a, **kw):
                raise TierMemError("manifest unreadable")
            monkeypatch.setattr(tiermem.optim.offloaded, "read_manifest", unreadable)
            inject(tm, "read", 0, times=10)
            set_grads(model, 2)
            with pytest.raises(TierMemIOError) as info:
                opt.step()
            assert "rolling back to committed step 1 failed too" in "".join(
                info.value.__notes__)
            with pytest.raises(TierMemError, match="leave the offload block and resume"):
                opt.step()
            monkeypatch.undo()
    assert "stays on disk" in tm.where_state_is()
    model2 = make_model()
    opt2 = make_optimizer(model2)
    with tiermem.offload(opt2, cfg, model=model2, resume=True) as tm2:
        assert tm2.resumed_step == 1
        for k in (2, 3):
            set_grads(model2, k)
            opt2.step()
    assert_at(model2, opt2, 3)


def test_commit_fails_on_full_disk(tmp_path):
    """The disk fills between steps: the step's commit fails naming the manifest and
    ENOSPC, the previous commit stays valid, and the next commit succeeds once space is
    back (nothing is rolled back: the step itself was complete)."""
    with tmpfs(tmp_path / "fs", "4m") as fs:
        cfg = crash_config(str(fs), "threads")
        cfg["io"]["o_direct"] = False
        model = make_model()
        opt = make_optimizer(model)
        with tiermem.offload(opt, cfg, model=model) as tm:
            set_grads(model, 1)
            opt.step()
            filler = fs / "filler"
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
            set_grads(model, 2)
            with pytest.raises(TierMemError) as info:
                opt.step()
            msg = str(info.value)
            assert "step 2 completed but could not be committed" in msg
            assert MANIFEST in msg and "ENOSPC" in msg and "resume at step 1" in msg
            run = swap_dir(fs)
            assert read_manifest(str(run), None).step == 1
            assert not (run / (MANIFEST + ".tmp")).exists()
            os.unlink(filler)
            for k in (3, 4):
                set_grads(model, k)
                opt.step()
            assert tm.committed_step == 4
        assert_at(model, opt, 4)


@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
def test_swap_directory_removed_mid_run(tmp_path, durability):
    """rm -r of the run directory between steps. The open files keep the records, so the
    state is never lost: scratch mode trains on and hands it back; crash-consistent mode
    says the step cannot be committed (the directory is gone) and hands back the state of
    the completed step at exit."""
    cfg = crash_config(str(tmp_path), "threads")
    cfg["swap"]["durability"] = durability
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model):
        set_grads(model, 1)
        opt.step()
        shutil.rmtree(swap_dir(tmp_path))
        set_grads(model, 2)
        if durability == "scratch":
            opt.step()
        else:
            with pytest.raises(TierMemError, match="swap directory was removed"):
                opt.step()
    assert_at(model, opt, 2)


MEMLOCK_SCRIPT = """
import json, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
sys.path.insert(0, "tests")
import torch, tiermem
from crash_run import crash_config, make_model, make_optimizer, run_killed, set_grads
from tiermem.errors import TierMemWarning
from tiermem.sysinfo import has_cap_ipc_lock
out = {"cap": has_cap_ipc_lock(), "runs": []}
for host in ("2MiB", 0):  # beyond the limit with the host tier; the pipeline's buffers alone
    cfg = crash_config(sys.argv[1], "threads")
    cfg["swap"]["durability"] = "scratch"
    cfg["tiers"]["host"]["capacity"] = host
    model = make_model()
    opt = make_optimizer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tiermem.offload(opt, cfg, model=model):
            for k in (1, 2):
                set_grads(model, k)
                opt.step()
    out["runs"].append({
        "warnings": [str(w.message) for w in caught if issubclass(w.category, TierMemWarning)],
        "weights": [p.detach().tolist() for p in model.parameters()]})
print(json.dumps(out))
"""


def test_memlock_limit_at_offload_level(tmp_path):
    """RLIMIT_MEMLOCK of 1 MiB, no CAP_IPC_LOCK, a pinned budget (host tier + buffers) above
    it: what cannot be locked stays pageable with one warning (per process) naming the
    limit, and training is exact."""
    out = run_without_ipc_lock(MEMLOCK_SCRIPT, str(tmp_path))
    ref_model = ref_at(2)[0]
    first, second = (run["warnings"] for run in out["runs"])
    assert len(first) == 1 and "RLIMIT_MEMLOCK" in first[0], first
    assert second == []  # one warning per process
    for run in out["runs"]:
        for p, w in zip(ref_model.parameters(), run["weights"]):
            assert_same_tensor(torch.tensor(w, dtype=torch.float32), p.detach(), "weights")


def test_resume_with_the_other_durability_is_refused(tmp_path):
    """The modes lay the files out differently: a resume says which mode wrote the state,
    and leaves it untouched."""
    run_killed(tmp_path, "threads", "after-step:1", 2, "bf16")
    cfg = crash_config(str(tmp_path), "threads")
    cfg["swap"]["durability"] = "scratch"
    model = make_model(torch.bfloat16)
    with pytest.raises(TierMemError, match="written with swap.durability: crash_consistent"):
        with tiermem.offload(make_optimizer(model), cfg, model=model, resume=True):
            pass
    model = make_model(torch.bfloat16)
    with tiermem.offload(make_optimizer(model), crash_config(str(tmp_path), "threads"),
                         model=model, resume=True) as tm:
        assert tm.resumed_step == 1
        tm.discard()



def test_a_resume_refused_for_another_layout_says_what_differs(tmp_path):
    """A resume whose config lays the records out otherwise is refused, naming the first
    partition that differs and how (here its tier: the host capacity changed)."""
    run_killed(tmp_path, "threads", "after-step:1", 2)
    cfg = crash_config(str(tmp_path), "threads")
    cfg["tiers"]["host"]["capacity"] = 0
    model = make_model()
    with pytest.raises(TierMemError, match=r"partition 0 \(tier: kept 'host', now 'nvme'\)"):
        with tiermem.offload(make_optimizer(model), cfg, model=model, resume=True):
            pass


def test_a_run_directory_moved_whole_resumes_and_recovers_from_its_own_file(tmp_path):
    """Its manifest names the swap file where it was written: a copy of the directory
    (off a failing node, to another mount) resumes and recovers from the file beside the
    manifest, never from that path (here the original, damaged since)."""
    import tiermem.tools.cli

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    run_killed(src, "threads", "after-step:1", 2)
    shutil.copytree(src, dst)
    with open(src / "tiermem-default" / "state.swap", "r+b") as f:
        f.write(b"\xff" * 8192)
    out = tmp_path / "ckpt.pt"
    assert tiermem.tools.cli.main(["recover", str(dst / "tiermem-default"), "-o", str(out)]) == 0
    ref_model, _ = ref_at(1)
    ckpt = torch.load(out, weights_only=True)
    for name, p in ref_model.named_parameters():
        assert_same_tensor(ckpt["model"][name], p.detach(), name)
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, crash_config(str(dst), "threads"), model=model,
                         resume=True) as tm:
        assert tm.resumed_step == 1
    assert_at(model, opt, 1)
