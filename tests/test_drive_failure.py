"""Two swap paths, one drive fails mid-run (crash_consistent).

Every access to the second drive fails with EIO (transfers through the engine,
on either backend, and every fsync tiermem does there), or its run directory is
removed. The step that hits it must fail with an error naming that drive, the
last committed step must stay intact on disk, and a resume with the drive back
must give that step bitwise.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

import tiermem
from conftest import BACKEND_PARAMS
from crash_run import crash_config, make_model, make_optimizer, set_grads
from faults import FailedTransfer
from offload_helpers import assert_same_tensor, compare_state_dicts
from test_crash import trajectory
from tiermem.errors import TierMemError, TierMemWarning
from tiermem.io.engine import IOEngine
from tiermem.swap import fsops


class Drive:
    """One drive's health, shared by every engine a run starts (a roll-back starts one)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.dead = prefix, False


class DeadDrive:
    """Backend wrapper: every transfer on a file under `prefix` fails with EIO."""

    def __init__(self, inner, drive: "Drive") -> None:
        self.inner, self.drive, self.name = inner, drive, inner.name
        self.paths: dict[int, str] = {}

    def add_file(self, fd):
        token = self.inner.add_file(fd)
        self.paths[token] = os.readlink(f"/proc/self/fd/{fd}")
        return token

    def submit(self, *, op, file, addr, nbytes, offset, buf_index, **kw):
        if self.drive.dead and self.paths.get(file, "").startswith(self.drive.prefix):
            return FailedTransfer(errno.EIO, offset, nbytes)
        return self.inner.submit(op=op, file=file, addr=addr, nbytes=nbytes, offset=offset,
                                 buf_index=buf_index, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class DeadFsOps(fsops.FsOps):
    def __init__(self, drive: Drive) -> None:
        self.drive = drive

    def _check(self, path):
        if self.drive.dead and os.path.abspath(path).startswith(self.drive.prefix):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    def fdatasync(self, fd, path, *, site):
        self._check(path)
        super().fdatasync(fd, path, site=site)

    def fsync(self, fd, path, *, site):
        self._check(path)
        super().fsync(fd, path, site=site)

    def fsync_dir(self, path, *, site):
        self._check(path)
        super().fsync_dir(path, site=site)


@pytest.fixture(scope="module")
def reference():
    return trajectory(set_grads, 3)


@pytest.mark.parametrize("how", ["eio", "gone"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_second_drive_fails_mid_run(tmp_path, monkeypatch, backend, how, reference):
    """eio: every access fails; gone: the drive's directory vanishes and its open files
    fail (a pulled or unmounted drive)."""
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    cfg = crash_config(paths[0], backend)
    cfg["swap"]["paths"] = paths
    drive_b = os.path.join(paths[1], "tiermem-default")
    drive = Drive(drive_b + os.sep)
    real_start = IOEngine._start_backend
    monkeypatch.setattr(IOEngine, "_start_backend",
                        lambda self, name: DeadDrive(real_start(self, name), drive))
    model = make_model()
    opt = make_optimizer(model)
    away = str(tmp_path / "b-away")
    with pytest.raises(TierMemError) as failed, pytest.warns(TierMemWarning) as warned:
        with fsops.use(DeadFsOps(drive)):
            with tiermem.offload(opt, cfg, model=model) as tm:
                for k in (1, 2):
                    set_grads(model, k)
                    opt.step()
                assert tm.committed_step == 2
                drive.dead = True
                if how == "gone":
                    shutil.move(drive_b, away)
                set_grads(model, 3)
                opt.step()
    assert drive_b in str(failed.value), str(failed.value)
    # The roll-back needs the dead drive's committed records too: it fails, and the exit
    # keeps the disk's committed step untouched (a warning says where).
    notes = "".join(getattr(failed.value, "__notes__", []))
    assert "rolling back to committed step 2 failed" in notes, notes
    assert any("committed step 2 stays on disk" in str(w.message) for w in warned)
    # The drive is back.
    drive.dead = False
    if how == "gone":
        shutil.move(away, drive_b)
    monkeypatch.setattr(IOEngine, "_start_backend", real_start)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    opt = make_optimizer(model)
    weights, state = reference[2]
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 2
        for (name, p), w in zip(model.named_parameters(), weights):
            assert_same_tensor(p.detach(), w, f"resumed {name}")
        compare_state_dicts(opt.state_dict(), state)
        set_grads(model, 3)
        opt.step()
        assert tm.committed_step == 3
    for (name, p), w in zip(model.named_parameters(), reference[3][0]):
        assert_same_tensor(p.detach(), w, f"step 3 after resume: {name}")


def test_removed_second_swap_directory_is_not_committed(tmp_path, reference):
    """rm -r of the second path's run directory: the open file still takes writes, but a
    manifest naming records in a file no directory holds would be lost by the next power
    loss. The commit must refuse, naming the file."""
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    cfg = crash_config(paths[0], "threads")
    cfg["swap"]["paths"] = paths
    drive_b = os.path.join(paths[1], "tiermem-default")
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model) as tm:
        set_grads(model, 1)
        opt.step()
        shutil.rmtree(drive_b)
        set_grads(model, 2)
        with pytest.raises(TierMemError, match="could not be committed") as failed:
            opt.step()
        assert os.path.join(drive_b, "state.swap") in str(failed.value)
        assert tm.committed_step == 1
