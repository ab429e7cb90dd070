"""What the run directories under a swap path are, for `tiermem ls` / `tiermem clean` and for
the messages offload() gives when one is in the way.

A run directory `<swap path>/tiermem-<name>/` is one of:
  in use     a live process holds its lock
  kept       a block ended and kept its state on disk (manifest, scratch durability)
  committed  a crash_consistent run's last commit (manifest); a resume restores it
  stale      swap files without a manifest: a scratch-mode run that crashed; nothing in it
             can be resumed
  removing   a deletion interrupted half way (`*.removing-<pid>`); nothing in it is needed
It only reads (a non-blocking lock probe is released at once).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from typing import Iterable

from tiermem.sizes import format_size

PREFIX = "tiermem-"
MANIFEST = "manifest.json"  # as swap.manifest writes it
OWNER = "owner.json"  # as swap.rundir writes it
REMOVING = ".removing-"


@dataclass
class RunInfo:
    path: str
    name: str
    state: str  # in use | kept | committed | stale | removing
    step: int | None = None
    durability: str | None = None
    pid: int | None = None
    host: str | None = None
    started: str | None = None
    bytes: int = 0
    files: int = 0

    def line(self) -> str:
        what = {
            "in use": f"in use by process {self.pid} on {self.host}",
            "kept": f"state kept on disk at its block's step {self.step}; resume with "
                    f"tiermem.offload(..., name={self.name!r}, resume=True)",
            "committed": f"committed step {self.step} (crash_consistent); resume with "
                         f"tiermem.offload(..., name={self.name!r}, resume=True)",
            "stale": "swap files of a scratch-mode run that did not finish: nothing to "
                     "resume; tiermem clean removes it",
            "removing": "a deletion cut short: nothing needed; tiermem clean removes it",
        }[self.state]
        started = f", started {self.started} by pid {self.pid}" \
            if self.started and self.state != "in use" else ""
        return (f"{self.path}  {self.state:<9}  {format_size(self.bytes)} in {self.files} "
                f"files{started}: {what}")


def _read_json(path: str) -> dict:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _locked(path: str) -> bool:
    """Whether a process holds the directory's flock (swap.rundir takes it for a run's life)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this probe took
    return False


def _usage(path: str) -> tuple[int, int]:
    total = files = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
                files += 1
            except OSError:
                pass
    return total, files


def describe(path: str) -> RunInfo | None:
    """The run directory at `path`, or None when there is none."""
    if not os.path.isdir(path) or os.path.islink(path):
        return None
    base = os.path.basename(path.rstrip("/"))
    name = base[len(PREFIX):] if base.startswith(PREFIX) else base
    owner = _read_json(os.path.join(path, OWNER))
    info = RunInfo(path, name.split(REMOVING)[0], "stale", pid=owner.get("pid"),
                   host=owner.get("host"), started=owner.get("started"))
    info.bytes, info.files = _usage(path)
    if REMOVING in base:
        info.state = "removing"
    elif _locked(path):
        info.state = "in use"
    else:
        manifest = _read_json(os.path.join(path, MANIFEST))
        if manifest:
            info.step = manifest.get("step")
            info.durability = manifest.get("durability")
            info.state = "committed" if info.durability == "crash_consistent" else "kept"
    return info


def list_runs(swap_paths: Iterable[str]) -> list[RunInfo]:
    """Every run directory under the given swap paths."""
    out = []
    for sp in swap_paths:
        sp = os.path.expandvars(os.path.expanduser(sp))
        try:
            names = sorted(os.listdir(sp))
        except OSError:
            continue
        for n in names:
            if n.startswith(PREFIX):
                info = describe(os.path.join(sp, n))
                if info is not None:
                    out.append(info)
    return out


def remove(info: RunInfo) -> None:
    """Delete a run directory that no live process holds (checked again just before)."""
    if info.state == "in use" or _locked(info.path):
        raise RuntimeError(f"{info.path} is in use")
    shutil.rmtree(info.path)


def in_the_way(run_dir: str, *, resume: bool) -> str | None:
    """Why `run_dir` stops a block from starting (resume or not), saying what a resume can
    and cannot do in each durability mode; None when nothing is in the way."""
    info = describe(run_dir)
    if info is None or info.state == "removing":
        return None
    clean = f"tiermem clean {os.path.dirname(run_dir)} --name {info.name}"
    if info.state == "in use":
        if info.pid == os.getpid():
            return (f"swap directory {run_dir} is in use by process {info.pid}, this one: "
                    f"another tiermem.offload block here has name={info.name!r}; give this "
                    "block another name=")
        return (f"swap directory {run_dir} is in use by process {info.pid} on {info.host} "
                "(it holds the directory's lock); give this run another name "
                "(tiermem.offload(..., name=)) or swap path")
    if info.state == "stale":
        return (f"swap directory {run_dir} holds the swap files of an earlier run (pid "
                f"{info.pid}, started {info.started}) that did not finish cleanly and left no "
                "manifest: a swap.durability scratch run keeps its files as working space "
                "only (and a crash_consistent one had not committed yet), so there is nothing "
                f"to resume; resume=True would fail. Remove it ({clean}) and start over; "
                "swap.durability crash_consistent makes a run resumable after a crash.")
    if resume:
        return None
    if info.state == "committed":
        what = (f"committed step {info.step} of an earlier swap.durability crash_consistent "
                f"run (pid {info.pid}) that did not finish cleanly or kept its state")
    else:
        what = (f"optimizer state an earlier run (pid {info.pid}, swap.durability scratch) "
                f"kept on disk at its block's step {info.step}")
    return (f"swap directory {run_dir} holds the {what}. Nothing was touched. Continue from "
            f"it with tiermem.offload(..., name={info.name!r}, resume=True), or remove it "
            f"({clean}) to start over.")
