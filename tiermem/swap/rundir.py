"""Run directories: where a run's swap files live, who holds them, and whether the path is safe.

Each run works in `<swap path>/tiermem-<name>/`, created 0700 and held with an
advisory lock (flock on the directory) for as long as the run lives. The
kernel drops the lock when the holder dies, so a locked directory is in use
by a live process, and an unlocked one that exists was left by a run that
crashed or kept its state on disk: that is reported, never silently reused or
deleted. Optimizer state is model IP: swap paths that are symbolic links or
writable by other users are refused, files are created 0600 and never opened
through a link.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import stat
import time
from typing import Sequence

from tiermem.errors import TierMemError, TierMemIOError
from tiermem.swap import fsops

OWNER_FILE = "owner.json"
REMOVING = ".removing-"  # suffix of a run directory being deleted: no state in it


class SwapPathError(TierMemError):
    """A swap path that tiermem will not put optimizer state in."""


class StaleSwapError(TierMemError):
    """A swap directory from another (live or crashed) run is in the way."""


def run_dirs(paths: Sequence[str], name: str) -> list[str]:
    """The run directory under each swap path."""
    return [os.path.join(os.path.abspath(os.path.expandvars(os.path.expanduser(p))),
                         f"tiermem-{name}") for p in paths]


def check_swap_path(path: str) -> None:
    """Refuse a swap path that is a symbolic link, not a directory, or writable by others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # it will be created 0700
    if stat.S_ISLNK(st.st_mode):
        raise SwapPathError(
            f"swap path {path} is a symbolic link (to {os.readlink(path)}); tiermem refuses "
            "links so optimizer state cannot be redirected elsewhere: give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise SwapPathError(f"swap path {path} exists and is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SwapPathError(
            f"swap path {path} is writable by other users (mode {st.st_mode & 0o7777:o}): "
            "they could read, replace or delete the optimizer state there. Use a directory "
            f"only you can write (chmod go-w {path}, or a subdirectory created 0700)")


def _mkdir_error(path: str, exc: OSError) -> TierMemIOError:
    return TierMemIOError(f"cannot create swap directory {path}: {exc.strerror}",
                          op="mkdir", path=path, errno=exc.errno)


def make_swap_path(path: str) -> None:
    """Create `path` 0700 if missing, then check it."""
    check_swap_path(path)
    try:
        fsops.makedirs(path, 0o700)
    except OSError as exc:
        raise _mkdir_error(path, exc) from None
    check_swap_path(path)


def _owner(run_dir: str) -> dict:
    try:
        fd = os.open(os.path.join(run_dir, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _try_lock(run_dir: str) -> int | None:
    """An fd holding the run directory's lock, or None when another process holds it."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _in_use(run_dir: str) -> StaleSwapError:
    owner = _owner(run_dir)
    return StaleSwapError(
        f"swap directory {run_dir} is in use by process {owner.get('pid', '?')} on "
        f"{owner.get('host', '?')} (it holds the directory's lock); give this run another "
        "name (tiermem.offload(..., name=)) or swap path")


def check_not_stale(run_dir: str) -> None:
    """Raise StaleSwapError if `run_dir` exists: locked by a live run, or left by one."""
    if not os.path.lexists(run_dir):
        return
    if os.path.islink(run_dir):
        raise SwapPathError(f"{run_dir} is a symbolic link; remove it")
    fd = _try_lock(run_dir)
    if fd is None:
        raise _in_use(run_dir)
    os.close(fd)  # only probing: the directory stays exactly as it was
    owner = _owner(run_dir)
    raise StaleSwapError(
        f"swap directory {run_dir} holds state of an earlier run (pid {owner.get('pid', '?')}, "
        f"started {owner.get('started', 'at an unknown time')}) that did not finish cleanly or "
        "kept its state on disk. Nothing was touched. Resume from it "
        f"(tiermem.offload(..., resume=True)) or remove it (rm -r {run_dir}) once you are "
        "sure it is not needed.")


class RunDir:
    """A run directory this process created or adopted, and the lock that says so."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def create(cls, path: str) -> "RunDir":
        """mkdir 0700 (atomic: fails if it exists), lock it, record the owner."""
        make_swap_path(os.path.dirname(path))
        check_not_stale(path)
        try:
            fsops.ops().mkdir(path, 0o700)
        except FileExistsError:
            check_not_stale(path)  # another process made it a moment ago: say which case
            raise
        except OSError as exc:
            raise _mkdir_error(path, exc) from None
        try:
            # Without this a power loss can drop the whole directory, committed state and all.
            fsops.ops().fsync_dir(os.path.dirname(path), site="rundir.mkdir.dirsync")
        except OSError as exc:
            raise TierMemIOError(f"fsync of swap path {os.path.dirname(path)} failed: "
                                 f"{exc.strerror}", op="fsync", path=os.path.dirname(path),
                                 errno=exc.errno) from None
        # Between mkdir and flock another process could probe it unlocked: it then
        # reports a stale directory and touches nothing, which is safe.
        return cls._hold(path)

    @classmethod
    def adopt(cls, path: str) -> "RunDir":
        """Take over a directory a finished or crashed run left (resume)."""
        check_swap_path(os.path.dirname(path))
        if os.path.islink(path) or not os.path.isdir(path):
            raise StaleSwapError(f"cannot resume: {path} is not a directory")
        return cls._hold(path)

    @classmethod
    def _hold(cls, path: str) -> "RunDir":
        fd = _try_lock(path)
        if fd is None:
            raise _in_use(path)
        rd = cls(path, fd)
        rd.write_owner()
        return rd

    def write_owner(self) -> None:
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = os.path.join(self.path, OWNER_FILE + ".tmp")
        # Not synced: who held the directory is advice for a person, no state depends on it.
        fsops.ops().write_file(tmp, json.dumps(owner).encode(), site=None)
        fsops.ops().replace(tmp, os.path.join(self.path, OWNER_FILE))

    def release(self) -> None:
        """Drop the lock (the directory stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def remove_run_dir(path: str) -> None:
    """Delete a run directory whose state is safe elsewhere, so that no crash can leave it
    half deleted under its own name: it is renamed first (atomic), then emptied. A
    leftover `*.removing-<pid>` directory holds nothing anyone needs."""
    doomed = f"{path}{REMOVING}{os.getpid()}"
    try:
        fsops.ops().replace(path, doomed)
    except FileNotFoundError:
        return  # already gone (removed by hand mid-run)
    except OSError:
        doomed = path  # cannot rename (read-only parent?): delete in place, as before
    shutil.rmtree(doomed, ignore_errors=True)
