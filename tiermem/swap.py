"""Swap files: where each NVMe-homed partition's record lives on disk.

One directory per run under every swap path (`<path>/tiermem-<name>/`), one
preallocated file in each (`state.swap`); partitions are striped round-robin
over the paths, each at an aligned offset of its path's file. Preallocating at
start makes a full disk fail before training, not halfway through a step. A
directory left by a crashed run is reported, never silently reused or deleted.
"""

from __future__ import annotations

import errno as _errno
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tiermem.errors import TierMemError, TierMemIOError
from tiermem.io import File, IOEngine, Request
from tiermem.partition import Partition
from tiermem.sizes import format_size
from tiermem.sysinfo import free_bytes

OWNER_FILE = "owner.json"
STATE_FILE = "state.swap"


class StaleSwapError(TierMemError):
    """A swap directory from another (live or crashed) run is in the way."""


@dataclass
class Slot:
    """Where one partition's record lives."""

    file: int  # index into SwapStore.files
    offset: int
    nbytes: int


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_dirs(paths: Sequence[str], name: str) -> list[str]:
    """The run directory under each swap path."""
    return [os.path.join(os.path.abspath(os.path.expandvars(os.path.expanduser(p))),
                         f"tiermem-{name}") for p in paths]


def _owner(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, OWNER_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def live_owner(run_dir: str) -> int | None:
    """The pid of another live process on this host that owns `run_dir`, if any."""
    owner = _owner(run_dir)
    pid, host = owner.get("pid"), owner.get("host")
    if pid and host == socket.gethostname() and pid != os.getpid() and _pid_alive(pid):
        return pid
    return None


def check_not_stale(run_dir: str) -> None:
    """Raise StaleSwapError if `run_dir` exists: in use by a live process, or left by a crash."""
    if not os.path.lexists(run_dir):
        return
    holder = live_owner(run_dir)
    if holder:
        raise StaleSwapError(f"swap directory {run_dir} is in use by process {holder}; give "
                             "this run another name (tiermem.offload(..., name=)) or swap path")
    owner = _owner(run_dir)
    pid = owner.get("pid")
    started = owner.get("started", "an unknown time")
    raise StaleSwapError(
        f"swap directory {run_dir} holds state of an earlier run (pid {pid or '?'}, started "
        f"{started}) that did not finish cleanly or kept its state on disk. Nothing was "
        f"touched. Resume from it (tiermem.offload(..., resume=True)) or remove it "
        f"(rm -r {run_dir}) once you are sure it is not needed.")


class SwapStore:
    """Preallocated swap files for a list of NVMe partitions, read and written through an engine."""

    def __init__(self, engine: IOEngine, paths: Sequence[str], name: str,
                 parts: Sequence[Partition], direct: bool | str = "auto",
                 resume: bool = False) -> None:
        self.engine = engine
        self.dirs = run_dirs(paths, name)
        self.slots: dict[int, Slot] = {}
        self.sizes = [0] * len(self.dirs)
        self._place(parts)
        sizes = self.sizes
        self.files: list[File] = []
        self._created: list[str] = []
        if resume:
            self._reopen(direct)
            return
        for d in self.dirs:
            check_not_stale(d)
        self._check_space()
        try:
            for d, size in zip(self.dirs, sizes):
                self._create_dir(d)
                self.files.append(self._create_file(os.path.join(d, STATE_FILE), size, direct))
        except BaseException:
            self.remove()
            raise

    def _reopen(self, direct: bool | str) -> None:
        """Adopt the files a previous run kept on disk (resume).

        Nothing is marked as ours to delete until every file checked out: a
        failed resume leaves the kept state exactly as it was."""
        for d, size in zip(self.dirs, self.sizes):
            holder = live_owner(d)
            if holder:
                raise StaleSwapError(f"cannot resume from {d}: process {holder} is using it")
            path = os.path.join(d, STATE_FILE)
            try:
                f = self.engine.open(path, "r+", direct=direct)
            except TierMemIOError as exc:
                raise TierMemError(f"cannot resume: {exc}") from None
            self.files.append(f)
            if f.size() < size:
                raise TierMemError(f"cannot resume: {path} holds {f.size()} bytes, the kept "
                                   f"state needs {size} (truncated?)")
        for d in self.dirs:
            self._write_owner(d)
        self._created = list(self.dirs)

    def _place(self, parts: Sequence[Partition]) -> list[int]:
        """Stripe `parts` round-robin over the files, after what they hold; bytes added per file."""
        added = [0] * len(self.dirs)
        for part in parts:
            k = len(self.slots) % len(self.dirs)
            self.slots[part.id] = Slot(k, self.sizes[k], part.record_bytes)
            self.sizes[k] += part.record_bytes
            added[k] += part.record_bytes
        return added

    def add(self, parts: Sequence[Partition]) -> None:
        """Room for more partitions (a new param group): grow the files, preallocated."""
        added = self._place(parts)
        self._check_space(added)
        for f, size, extra in zip(self.files, self.sizes, added):
            if extra:
                self._allocate(f, size)

    def _check_space(self, sizes: Sequence[int] | None = None) -> None:
        need: dict[str, int] = {}
        for d, size in zip(self.dirs, sizes if sizes is not None else self.sizes):
            parent = os.path.dirname(d)
            os.makedirs(parent, mode=0o700, exist_ok=True)
            need[parent] = need.get(parent, 0) + size
        for parent, size in need.items():
            free = free_bytes(parent)
            if size > free:
                raise TierMemIOError(
                    f"swap path {parent} needs {format_size(size)} for NVMe-tier state but has "
                    f"only {format_size(free)} free; free space, add swap paths or raise "
                    "tiers.host.capacity", op="preallocate", path=parent, length=size,
                    errno=_errno.ENOSPC)

    def _create_dir(self, d: str) -> None:
        os.makedirs(d, mode=0o700)
        self._created.append(d)
        self._write_owner(d)

    @staticmethod
    def _write_owner(d: str) -> None:
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(os.path.join(d, OWNER_FILE), "w") as f:
            json.dump(owner, f)

    def _create_file(self, path: str, size: int, direct: bool | str) -> File:
        f = self.engine.open(path, "w", direct=direct)
        try:
            self._allocate(f, size)
        except BaseException:
            f.close()
            raise
        return f

    @staticmethod
    def _allocate(f: File, size: int) -> None:
        try:
            if size:
                os.posix_fallocate(f.fd, 0, size)
        except OSError as exc:
            raise TierMemIOError(f"preallocating {format_size(size)} for {f.path} failed: "
                                 f"{exc.strerror}", op="preallocate", path=f.path, offset=0,
                                 length=size, errno=exc.errno) from None

    def read(self, part: Partition, buf: torch.Tensor) -> Request:
        s = self.slots[part.id]
        return self.engine.read(self.files[s.file], buf[: s.nbytes], s.offset)

    def write(self, part: Partition, buf: torch.Tensor) -> Request:
        s = self.slots[part.id]
        return self.engine.write(self.files[s.file], buf[: s.nbytes], s.offset)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def close(self) -> None:
        """Close the files (after their transfers), keeping them on disk."""
        for f in self.files:
            f.close()

    def remove(self) -> None:
        """Close and delete this run's swap directories. Call only once the state is safe."""
        self.close()
        for d in self._created:
            shutil.rmtree(d, ignore_errors=True)
        self._created = []
