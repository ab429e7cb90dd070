"""Swap directories: locks, permissions, symbolic links (optimizer state is model IP)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

import tiermem
from tiermem.swap.rundir import StaleSwapError, SwapPathError


def _cfg(path, host=0):
    return {"swap": {"paths": [str(path)]}, "tiers": {"host": {"capacity": host}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2}}


def _opt():
    torch.manual_seed(0)
    m = torch.nn.Linear(200, 300)
    return m, torch.optim.AdamW(m.parameters())


def test_dirs_0700_files_0600(tmp_path):
    swap = tmp_path / "swap"
    m, o = _opt()
    with tiermem.offload(o, _cfg(swap)) as tm:
        run = tm.plan()["swap_dirs"][0]
        assert stat.S_IMODE(os.stat(swap).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
        for name in os.listdir(run):
            assert stat.S_IMODE(os.stat(os.path.join(run, name)).st_mode) == 0o600, name


def test_second_run_on_the_same_dir_is_refused_while_the_first_lives(tmp_path):
    """The lock, not a pid guess: a second offload with the same name gets 'in use' with our pid."""
    m1, o1 = _opt()
    m2, o2 = _opt()
    with tiermem.offload(o1, _cfg(tmp_path)):
        with pytest.raises(StaleSwapError, match=f"in use by process {os.getpid()}"):
            with tiermem.offload(o2, _cfg(tmp_path)):
                pass
    with tiermem.offload(o2, _cfg(tmp_path)):  # free again once the first has left
        pass


def test_lock_of_a_killed_process_is_released_and_reported_stale(tmp_path):
    """A run killed with SIGKILL leaves its directory unlocked: the next run says it is
    stale (with the dead pid) instead of 'in use', and touches nothing."""
    code = f"""
import os, signal, torch, tiermem
m = torch.nn.Linear(200, 300); o = torch.optim.AdamW(m.parameters())
cfg = {_cfg(tmp_path)!r}
with tiermem.offload(o, cfg):
    m(torch.randn(2, 200)).sum().backward(); o.step()
    print(os.getpid(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    dead = proc.stdout.split()[0]
    run = tmp_path / "tiermem-default"
    before = sorted(os.listdir(run))
    m, o = _opt()
    with pytest.raises(StaleSwapError, match=f"earlier run \\(pid {dead}"):
        with tiermem.offload(o, _cfg(tmp_path)):
            pass
    assert sorted(os.listdir(run)) == before


def test_symlinked_swap_path_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    m, o = _opt()
    with pytest.raises(SwapPathError, match="symbolic link"):
        with tiermem.offload(o, _cfg(link)):
            pass
    assert os.listdir(real) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_swap_path_writable_by_others_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    m, o = _opt()
    with pytest.raises(SwapPathError, match="writable by other users"):
        with tiermem.offload(o, _cfg(shared)):
            pass
    assert os.listdir(shared) == []


def test_engine_refuses_a_symlinked_file_when_asked(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"x" * 4096)
    (tmp_path / "link").symlink_to(target)
    with tiermem.IOEngine("threads") as eng:
        with pytest.raises(tiermem.TierMemIOError, match="symbolic link"):
            eng.open(tmp_path / "link", "r+", direct=False, follow_symlinks=False)
        eng.open(tmp_path / "link", "r", direct=False).close()  # the default follows


def test_read_only_swap_directory_is_a_clear_error(readonly_dir):
    """A swap path on a read-only filesystem: TierMemIOError naming the directory, before
    training, and the optimizer untouched."""
    m, o = _opt()
    with pytest.raises(tiermem.TierMemIOError, match="cannot create swap directory") as info:
        with tiermem.offload(o, _cfg(readonly_dir)):
            pass
    assert str(readonly_dir) in str(info.value)
    assert "_tiermem" not in o.__dict__ and "step" not in o.__dict__
