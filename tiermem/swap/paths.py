"""The one swap-path checker: `validate`, `probe`, `stress`, `doctor` and `offload()` all ask it.

It only looks (stat, statvfs, /proc/self/mountinfo, access); it creates nothing.
Errors are what offload() would refuse or what cannot work (a relative or
duplicate path, a missing parent, a symbolic link, a virtual or read-only
filesystem, a directory others can write); warnings are set-ups that work but
are probably not what was meant (RAM-backed or network filesystems, stripes
that share one device).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Sequence

import errno as _errno

from tiermem.errors import TierMemIOError
from tiermem.swap import rundir
from tiermem.sysinfo import Mount, mount_of

# Filesystems that are not storage at all: nothing written there is a file on a disk.
VIRTUAL_FS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs",
              "tracefs", "securityfs", "pstore", "bpf", "configfs", "mqueue", "hugetlbfs",
              "autofs", "binfmt_misc", "fusectl", "efivarfs", "nsfs", "rpc_pipefs"}
RAM_FS = {"tmpfs", "ramfs"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre",
              "fuse.sshfs", "fuse.glusterfs", "fuse.s3fs", "fuse.gcsfuse", "afs", "beegfs",
              "gpfs", "fuse.juicefs", "virtiofs"}


class SwapPathError(rundir.SwapPathError, ValueError):
    """A swap path that cannot hold swap files; the message names the path and why."""


@dataclass
class PathCheck:
    """What one swap path is on this machine."""

    given: str  # as written in the config
    path: str  # ~ and $VARS expanded
    exists: bool = False
    real: str = ""  # symbolic links resolved (for a missing path: of its nearest ancestor)
    mount: Mount | None = None
    device: int | None = None  # st_dev of the path, or of the ancestor it would be made in
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # errno when the path cannot be written (read-only, permissions): offload() raises
    # TierMemIOError for it, as it would for the mkdir that fails
    write_errno: int | None = None

    def lines(self) -> list[str]:
        where = (f"{self.mount.fstype} on {self.mount.source}, mounted at "
                 f"{self.mount.mountpoint}" if self.mount else "not reachable")
        state = "exists" if self.exists else "will be created"
        out = [f"{self.given}: {state}; {where}"]
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  warning: {w}" for w in self.warnings]
        out += [f"  error: {e}" for e in self.errors]
        return out


@dataclass
class PathsReport:
    checks: list[PathCheck]
    errors: list[str] = field(default_factory=list)  # about the list (duplicates)
    warnings: list[str] = field(default_factory=list)  # about the list (shared devices)

    @property
    def ok(self) -> bool:
        return not self.errors and not any(c.errors for c in self.checks)

    def all_errors(self) -> list[str]:
        return [f"swap path {c.given}: {e}" for c in self.checks for e in c.errors] + self.errors

    def all_warnings(self) -> list[str]:
        return [f"swap path {c.given}: {w}" for c in self.checks for w in c.warnings] + \
            self.warnings

    def lines(self) -> list[str]:
        out = [line for c in self.checks for line in c.lines()]
        out += [f"warning: {w}" for w in self.warnings]
        out += [f"error: {e}" for e in self.errors]
        return out

    def raise_first(self) -> None:
        errors = self.all_errors()
        for c in self.checks:
            if c.write_errno is not None and len(c.errors) == 1:
                raise TierMemIOError(f"cannot create swap directory {c.path}: {c.errors[0]}",
                                     op="mkdir", path=c.path, errno=c.write_errno)
        if errors:
            more = f" (and {len(errors) - 1} more: tiermem validate lists them)" \
                if len(errors) > 1 else ""
            raise SwapPathError(errors[0] + more)


def expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def _may_create_parents(path: str) -> bool:
    """Missing parents are created only inside the home directory (~/.cache/tiermem/...): a
    missing /mnt/nvme0 is an unmounted drive, and creating it would put the swap files on
    whatever disk holds /mnt."""
    home = os.path.realpath(os.path.expanduser("~"))
    return path == home or path.startswith(home.rstrip("/") + "/")


def check_path(given: str) -> PathCheck:
    c = PathCheck(given, expand(given))
    if not os.path.isabs(c.path):
        c.errors.append("is relative: it would depend on the directory the job starts in; "
                        "give an absolute path (or one starting with ~)")
        return c
    path = os.path.normpath(c.path)
    c.exists = os.path.lexists(path)
    if c.exists:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            c.real = os.path.realpath(path)
            c.mount = mount_of(c.real)
            c.errors.append(f"is a symbolic link to {os.path.realpath(path)}; tiermem refuses "
                            "links (optimizer state could be redirected): give "
                            f"{os.path.realpath(path)} itself")
            return c
        if not stat.S_ISDIR(st.st_mode):
            c.errors.append("exists and is not a directory")
            return c
        target = path
    else:
        parent = os.path.dirname(path)
        target = parent
        while not os.path.exists(target):
            target = os.path.dirname(target)
        if target != parent and not _may_create_parents(path):
            c.errors.append(f"its parent {parent} does not exist (is the drive mounted?); "
                            "tiermem creates only the last directory of a swap path outside "
                            "your home, so an unmounted drive never turns into a directory "
                            f"on the disk that holds {target}")
    c.real = os.path.realpath(target)
    if c.real != target:
        c.notes.append(f"resolves to {c.real} (a parent directory is a symbolic link)")
    c.mount = mount_of(c.real)
    st = os.stat(c.real)
    c.device = st.st_dev
    fs = c.mount.fstype
    if fs in VIRTUAL_FS:
        c.errors.append(f"is on {fs}, a virtual filesystem of the kernel, not storage")
        return c
    if c.exists and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        c.errors.append(f"is writable by other users (mode {st.st_mode & 0o7777:o}): they "
                        "could read, replace or delete the optimizer state; chmod go-w it "
                        "or use a subdirectory")
    try:
        read_only = bool(os.statvfs(c.real).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        c.errors.append(f"the filesystem mounted at {c.mount.mountpoint} is read-only")
        c.write_errno = _errno.EROFS
    elif not os.access(c.real, os.W_OK | os.X_OK):
        c.errors.append(f"{c.real} is not writable by this user")
        c.write_errno = _errno.EACCES
    if fs in RAM_FS:
        c.warnings.append(f"is on {fs}: the swap files live in RAM (they count against host "
                          "memory, which is what offloading should save) and refuse "
                          "O_DIRECT; use a directory on an NVMe drive")
    elif fs in NETWORK_FS or fs.startswith("fuse."):
        c.warnings.append(f"is on {fs}, a network or FUSE filesystem: throughput is far below "
                          "a local NVMe drive and O_DIRECT and locking may not behave; use a "
                          "local drive")
    if c.mount.mountpoint == "/":
        c.notes.append("is on the root filesystem, not on a drive mounted for it")
    elif c.exists and c.mount.mountpoint == c.real:
        c.notes.append("is itself a mount point")
    return c


def check_paths(paths: Sequence[str]) -> PathsReport:
    """Check every swap path and the list as a whole (duplicates, shared devices)."""
    report = PathsReport([check_path(p) for p in paths])
    seen: dict[str, str] = {}
    for c in report.checks:
        if not os.path.isabs(c.path):
            continue
        key = os.path.realpath(c.path)
        if key in seen:
            report.errors.append(f"swap paths {seen[key]} and {c.given} are the same "
                                 f"directory ({key}); give each once")
        seen.setdefault(key, c.given)
    if len(report.checks) > 1:
        by_dev: dict[int, list[PathCheck]] = {}
        distinct = {os.path.realpath(c.path): c for c in report.checks}.values()
        for c in distinct:
            if c.device is not None:
                by_dev.setdefault(c.device, []).append(c)
        for group in by_dev.values():
            if len(group) > 1:
                m = group[0].mount
                report.warnings.append(
                    f"swap paths {', '.join(c.given for c in group)} are on one device "
                    f"({m.source if m else '?'}, mounted at {m.mountpoint if m else '?'}): "
                    "striping over them shares one drive's bandwidth; give paths on "
                    "different drives")
    return report
