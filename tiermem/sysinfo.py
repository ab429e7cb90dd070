"""Facts about the host that decide how buffers and files can be used: filesystems, memlock."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

CAP_IPC_LOCK = 14


@dataclass(frozen=True)
class Mount:
    """The mount that holds a path."""

    fstype: str
    mountpoint: str
    source: str


def mount_of(path: str) -> Mount:
    """The mount holding `path` (the longest mount point above its real path)."""
    real = os.path.realpath(path)
    best = Mount("unknown", "/", "?")
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        mp = fields[4].replace("\\040", " ")
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= len(best.mountpoint):
            best = Mount(rfields[0], mp, rfields[1])
    return best


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def lockable_bytes() -> int | None:
    """Bytes this process may page-lock; None when unlimited."""
    if has_cap_ipc_lock():
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def physical_memory() -> int:
    """Bytes of RAM on this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Bytes the kernel thinks can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
