"""Every file-system operation that the durability of kept state depends on, in one place.

Swap records themselves go through the I/O engine; everything else that
decides what survives a power loss — creating files and directories,
preallocating, `fdatasync`/`fsync` of files, `fsync` of directories (which is
what makes a create or a rename durable), renames, unlinks, the manifest's
bytes — goes through the `FsOps` object returned by `ops()`. Tests install a
recording variant (`use()`) to rebuild what a disk could hold after a power
loss at any point (tests/powerloss.py), and to switch single sync sites off to
prove the harness notices (each sync names its `site`).

Why a module-level object rather than a parameter: the sites are spread over
the store, the run directory, the manifest and the tier manager, and a test
must see all of them; one seam keeps that true as callers change.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator

# The sync sites a commit depends on. Tests iterate this to switch each off in turn.
SITES = (
    "swap.fdatasync",       # store.sync: the records of a step are on disk before its manifest
    "swap.create.dirsync",  # a new swap file's entry in its run directory
    "rundir.mkdir.dirsync",  # a new run directory's entry in its swap path
    "swappath.mkdir.dirsync",  # swap path directories made by tiermem, in their parents
    "manifest.fsync",       # the manifest's bytes before the rename that publishes them
    "manifest.dirsync",     # the rename itself
    "resident.fsync",       # scratch mode: resident.swap before the manifest naming it
)


class FsOps:
    """The real thing: thin wrappers over os.*, each raising OSError as os does."""

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        os.mkdir(path, mode)

    def create(self, path: str, mode: int = 0o600) -> None:
        """A new, empty file (O_EXCL: never an existing one, never through a link)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode)
        os.close(fd)

    def write_file(self, path: str, data: bytes | Iterable[bytes], *,
                   site: str | None) -> None:
        """Create or truncate `path` with `data` (bytes, or pieces written one after the
        other), then fsync it (unless `site` is None)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            pos = 0
            for piece in ([data] if isinstance(data, (bytes, bytearray)) else data):
                self.pwrite(fd, path, piece, pos)
                pos += len(piece)
            if site is not None:
                self.fsync(fd, path, site=site)
        finally:
            os.close(fd)

    def pwrite(self, fd: int, path: str, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def fallocate(self, fd: int, path: str, size: int) -> None:
        """Make the file at least `size` bytes, blocks allocated (a full disk fails here)."""
        os.posix_fallocate(fd, 0, size)

    def fsync(self, fd: int, path: str, *, site: str) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int, path: str, *, site: str) -> None:
        # Enough for records and for a grown size: fdatasync flushes the metadata that a
        # later read needs, i_size included (fdatasync(2)).
        os.fdatasync(fd)

    def fsync_dir(self, path: str, *, site: str) -> None:
        """Make the entries of directory `path` (creates, renames, removals) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)


_ops = FsOps()


def ops() -> FsOps:
    """The FsOps in use (the real one unless a test installed another)."""
    return _ops


@contextlib.contextmanager
def use(replacement: FsOps) -> Iterator[FsOps]:
    """Install `replacement` for the duration of the block (tests)."""
    global _ops
    before, _ops = _ops, replacement
    try:
        yield replacement
    finally:
        _ops = before


def makedirs(path: str, mode: int = 0o700) -> None:
    """os.makedirs, but each directory created here is made durable in its parent: a swap
    path tiermem made must not vanish with the state under it."""
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            ops().mkdir(d, mode)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue  # made by someone else meanwhile; their job to sync it
        ops().fsync_dir(os.path.dirname(d), site="swappath.mkdir.dirsync")
