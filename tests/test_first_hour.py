"""Issue 16, "a user's first hour": the lifecycle guards, the one swap-path checker as offload()
uses it, and the mistakes that used to pass in silence."""

from __future__ import annotations

import os
import warnings
from unittest import mock

import pytest
import torch

import tiermem
from tiermem.optim.hooks import installed
from tiermem.swap.rundir import StaleSwapError, SwapPathError


def _cfg(swap, **extra):
    return {"swap": {"paths": [str(swap)]}, "tiers": {"host": {"capacity": 0}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3},
            "io": {"backend": "threads"}, **extra}


def _pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt):
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def swap(tmp_path):
    d = tmp_path / "swap"
    d.mkdir(mode=0o700)
    return d


def _keep_on_disk(model, opt, cfg, name):
    """Leave a block with the state kept on disk (as when it does not fit in host memory)."""
    with mock.patch("tiermem.optim.handle.available_memory", return_value=0):
        with pytest.warns(tiermem.TierMemWarning, match="stays on disk") as w:
            with tiermem.offload(opt, cfg, model=model, name=name):
                _step(model, opt)
    return str(w[0].message)


# -- 1. lifecycle ---------------------------------------------------------------------


def test_second_block_on_one_optimizer_names_the_open_one(swap):
    model, opt = _pair()
    with tiermem.offload(opt, _cfg(swap), model=model, name="outer"):
        with pytest.raises(tiermem.TierMemError, match=r"already offloaded .*name='outer'.*"
                           r"test_first_hour.py:\d+") as info:
            with tiermem.offload(opt, _cfg(swap), model=model, name="inner"):
                pass
        assert installed(opt) is not None
        _step(model, opt)  # the outer block still works after the refusal
    assert installed(opt) is None
    assert "name='inner'" in str(info.value)
    assert opt.state[model[0].weight]["step"] == 1


def test_same_name_twice_does_not_blame_another_process(swap):
    model, opt = _pair()
    with tiermem.offload(opt, _cfg(swap), model=model):
        with pytest.raises(tiermem.TierMemError) as info:
            with tiermem.offload(opt, _cfg(swap), model=model):
                pass
    assert "in use by process" not in str(info.value)
    assert "already offloaded" in str(info.value)


def test_step_after_keep_on_disk_raises_and_the_hint_resumes(swap):
    """After an exit that keeps the state on disk, opt.step() must not restart Adam from step
    1 in silence; the hint (name= included) is the call that resumes it."""
    model, opt = _pair()
    message = _keep_on_disk(model, opt, _cfg(swap), "run7")
    assert "name='run7', resume=True" in message
    assert not opt.state
    with pytest.raises(tiermem.TierMemError, match=r"kept on disk in .*tiermem-run7.*"
                       r"name='run7', resume=True"):
        opt.step()
    # The hint, followed exactly: tiermem.offload(optimizer, config, model=model, name=...)
    with tiermem.offload(opt, _cfg(swap), model=model, name="run7", resume=True) as tm:
        assert tm.resumed_step == 1
        _step(model, opt)
    assert opt.state[model[0].weight]["step"] == 2  # continued, not started over
    _step(model, opt)  # a plain step works again once the state is back


def test_forget_kept_lets_a_plain_step_run(swap):
    model, opt = _pair()
    _keep_on_disk(model, opt, _cfg(swap), "x")
    tiermem.optim.handle.forget_kept(opt)
    _step(model, opt)
    assert opt.state[model[0].weight]["step"] == 1


def test_fresh_block_over_kept_state_says_how_to_resume_and_keeps_the_guard(swap):
    model, opt = _pair()
    _keep_on_disk(model, opt, _cfg(swap), "k")
    with pytest.raises(StaleSwapError, match=r"kept on disk.*name='k', resume=True.*"
                       r"tiermem clean"):
        with tiermem.offload(opt, _cfg(swap), model=model, name="k"):
            pass
    with pytest.raises(tiermem.TierMemError, match="kept on disk"):
        opt.step()  # a refused block leaves the guard in place


def test_scratch_crash_leftover_does_not_suggest_resume(swap):
    """A scratch run that died leaves swap files and no manifest: the error must not send the
    user to resume=True (which fails on the missing manifest), and resume=True says why."""
    run = swap / "tiermem-default"
    run.mkdir(mode=0o700)
    (run / "swap-0.bin").write_bytes(b"\0" * 4096)
    model, opt = _pair()
    with pytest.raises(StaleSwapError) as info:
        with tiermem.offload(opt, _cfg(swap), model=model):
            pass
    text = str(info.value)
    assert "nothing to resume" in text and "resume=True would fail" in text
    assert "tiermem clean" in text
    with pytest.raises(tiermem.TierMemError, match="manifest.json does not exist.*nothing to "
                       "resume"):
        with tiermem.offload(opt, _cfg(swap), model=model, resume=True):
            pass


# -- 2. swap paths in offload() -------------------------------------------------------


def test_offload_never_creates_a_missing_mount_tree(tmp_path):
    model, opt = _pair()
    target = tmp_path / "mnt" / "nvme0" / "tiermem"
    with pytest.raises(SwapPathError, match=r"parent .*nvme0 does not exist"):
        with tiermem.offload(opt, _cfg(target), model=model):
            pass
    assert not (tmp_path / "mnt").exists()


@pytest.mark.parametrize("paths, match", [
    (["relative/swap"], "is relative"),
    (["/proc/tiermem"], "virtual filesystem"),
])
def test_offload_refuses_unusable_paths(paths, match):
    model, opt = _pair()
    cfg = _cfg("x")
    cfg["swap"]["paths"] = paths
    with pytest.raises(SwapPathError, match=match):
        with tiermem.offload(opt, cfg, model=model):
            pass


def test_checker_reports_links_duplicates_and_shared_devices(tmp_path):
    from tiermem.swap.paths import check_paths
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    r = check_paths([str(tmp_path / "link")])
    assert any(f"symbolic link to {real}" in e for e in r.all_errors())
    r = check_paths([str(real), str(real) + "/"])
    assert any("same directory" in e for e in r.all_errors())
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    r = check_paths([str(real), str(other)])
    assert r.ok
    assert any("on one device" in w for w in r.all_warnings())


def test_checker_warns_on_tmpfs():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    from tiermem.swap.paths import check_paths
    from tiermem.sysinfo import mount_of
    if mount_of("/dev/shm").fstype != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    r = check_paths(["/dev/shm/tiermem-test"])
    assert any("tmpfs" in w and "RAM" in w for w in r.all_warnings())


# -- 5. silent mistakes ---------------------------------------------------------------


def test_offload_of_a_model_is_a_clear_error(swap):
    model, _opt = _pair()
    with pytest.raises(tiermem.TierMemError, match="takes the optimizer, got a model"):
        with tiermem.offload(model, _cfg(swap)):
            pass


def test_placement_rule_matching_nothing_warns(swap):
    model, opt = _pair()
    cfg = _cfg(swap, placement=[{"match": "*embed*", "tier": "host"},
                                {"match": "0.*", "tier": "nvme"}])
    with pytest.warns(tiermem.TierMemWarning, match=r"placement\[0\].*'\*embed\*'.*matches no "
                      r"parameter") as rec:
        with tiermem.offload(opt, cfg, model=model):
            pass
    assert not [w for w in rec if "placement[1]" in str(w.message)]


def test_model_that_does_not_own_the_parameters_warns(swap):
    model, opt = _pair()
    other, _ = _pair(1)
    with pytest.warns(tiermem.TierMemWarning, match=r"model= does not own 4 of the "
                      r"optimizer's 4 parameters"):
        with tiermem.offload(opt, _cfg(swap), model=other):
            pass


def test_the_right_model_gives_no_warning(swap):
    model, opt = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tiermem.TierMemWarning)
        with tiermem.offload(opt, _cfg(swap, placement=[{"match": "0.*", "tier": "nvme"}]),
                             model=model):
            _step(model, opt)
