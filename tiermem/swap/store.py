"""Swap files: where each NVMe-homed partition's record lives on disk.

One directory per run under every swap path (`<path>/tiermem-<name>/`), one
preallocated file in each (`state.swap`); partitions are striped round-robin
over the paths, each at an aligned offset of its path's file. Preallocating at
start makes a full disk fail before training, not halfway through a step. A
directory left by a crashed run is reported, never silently reused or deleted.

With `copies=2` (crash-consistent mode) each record has two places side by
side: a write always goes to the copy that does not hold the last committed
version, so a crash in the middle of a write can only tear a copy that no
manifest points to. `latest` is where reads find a record now, `committed`
where the last manifest says it is.
"""

from __future__ import annotations

import errno as _errno
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from tiermem.errors import TierMemError, TierMemIOError
from tiermem.swap import fsops
from tiermem.swap.integrity import FOOTER_BYTES, check, hash_landing, seal
from tiermem.swap.manifest import STATE_FILE
from tiermem.io import File, IOEngine, Request
from tiermem.partition import Partition
from tiermem.sizes import format_size
from tiermem.swap.rundir import (RunDir, StaleSwapError, SwapPathError, check_not_stale,
                              check_swap_path, make_swap_path, remove_run_dir, run_dirs)
from tiermem.sysinfo import free_bytes

__all__ = ["STATE_FILE", "SwapStore", "StaleSwapError", "SwapPathError", "run_dirs"]


@dataclass
class Slot:
    """Where one partition's record lives (copy k at offset + k * nbytes)."""

    file: int  # index into SwapStore.files
    offset: int
    nbytes: int


def _sync_dir(path: str, site: str) -> None:
    try:
        fsops.ops().fsync_dir(path, site=site)
    except OSError as exc:
        raise TierMemIOError(f"fsync of swap directory {path} failed: {exc.strerror}",
                             op="fsync", path=path, errno=exc.errno) from None


class SwapStore:
    """Preallocated swap files for a list of NVMe partitions, read and written through an engine."""

    def __init__(self, engine: IOEngine, paths: Sequence[str], name: str,
                 parts: Sequence[Partition], direct: bool | str = "auto",
                 resume: bool = False, checksums: bool = True, copies: int = 1) -> None:
        self.engine = engine
        self.checksums = checksums
        self.copies = copies
        self.footer = FOOTER_BYTES if checksums else 0
        self.generation: dict[int, int] = {}  # generation of the latest record, per partition
        self.latest: dict[int, int] = {}  # copy holding the latest record
        self.committed: dict[int, tuple[int, int]] = {}  # (copy, generation) last committed
        self.dirs = run_dirs(paths, name)
        self.slots: dict[int, Slot] = {}
        self.sizes = [0] * len(self.dirs)
        self._place(parts)
        sizes = self.sizes
        self.files: list[File] = []
        self._held: list[RunDir] = []  # locked by us; deleted by remove()
        if resume:
            self._reopen(direct)
            return
        for d in self.dirs:
            check_swap_path(os.path.dirname(d))
            check_not_stale(d)
        self._check_space()
        try:
            for d, size in zip(self.dirs, sizes):
                self._held.append(RunDir.create(d))
                self.files.append(self._create_file(os.path.join(d, STATE_FILE), size, direct))
        except BaseException:
            self.remove()
            raise

    def _reopen(self, direct: bool | str) -> None:
        """Adopt the files a previous run kept on disk (resume).

        Nothing is marked as ours to delete until every file checked out: a
        failed resume leaves the kept state exactly as it was."""
        held = []
        try:
            for d, size in zip(self.dirs, self.sizes):
                held.append(RunDir.adopt(d))
                path = os.path.join(d, STATE_FILE)
                try:
                    f = self.engine.open(path, "r+", direct=direct, follow_symlinks=False)
                except TierMemIOError as exc:
                    raise TierMemError(f"cannot resume: {exc}") from None
                self.files.append(f)
                if f.size() < size:
                    raise TierMemError(f"cannot resume: {path} holds {f.size()} bytes, the "
                                       f"kept state needs {size} (truncated?)")
        except BaseException:
            for rd in held:
                rd.release()
            raise
        self._held = held

    def _place(self, parts: Sequence[Partition]) -> list[int]:
        """Stripe `parts` round-robin over the files, after what they hold; bytes added per file."""
        added = [0] * len(self.dirs)
        for part in parts:
            k = len(self.slots) % len(self.dirs)
            nbytes = part.record_bytes + self.footer
            self.slots[part.id] = Slot(k, self.sizes[k], nbytes)
            self.sizes[k] += nbytes * self.copies
            added[k] += nbytes * self.copies
            self.generation[part.id] = 0
            self.latest[part.id] = 0
            self.committed[part.id] = (0, 0)
        return added

    def add(self, parts: Sequence[Partition]) -> None:
        """Room for more partitions (a new param group): grow the files, preallocated.
        Refused (no room), nothing is placed: a retry places them where a resume, which
        places every record after the one before, looks for them."""
        was = self.placement()
        try:
            added = self._place(parts)
            self._check_space(added)
            for f, size, extra in zip(self.files, self.sizes, added):
                if extra:
                    self._allocate(f, size)
        except BaseException:
            self.restore_placement(was)
            raise

    def placement(self) -> tuple:
        """Where every record is placed now, for restore_placement."""
        return (dict(self.slots), list(self.sizes), dict(self.generation), dict(self.latest),
                dict(self.committed))

    def restore_placement(self, was: tuple | None = None) -> None:
        """Undo the placements since `placement()` gave `was` (None: every one): partitions
        added and then refused are placed again where a resume, which places each record
        after the one before, looks for them. (The files keep the size they grew to.)"""
        if was is None:
            was = ({}, [0] * len(self.dirs), {}, {}, {})
        slots, sizes, generation, latest, committed = was
        self.slots, self.sizes = dict(slots), list(sizes)
        self.generation, self.latest, self.committed = (dict(generation), dict(latest),
                                                        dict(committed))

    def _check_space(self, sizes: Sequence[int] | None = None) -> None:
        need: dict[str, int] = {}
        for d, size in zip(self.dirs, sizes if sizes is not None else self.sizes):
            parent = os.path.dirname(d)
            make_swap_path(parent)
            need[parent] = need.get(parent, 0) + size
        for parent, size in need.items():
            free = free_bytes(parent)
            if size > free:
                raise TierMemIOError(
                    f"swap path {parent} needs {format_size(size)} for NVMe-tier state but has "
                    f"only {format_size(free)} free; free space, add swap paths or raise "
                    "tiers.host.capacity", op="preallocate", path=parent, length=size,
                    errno=_errno.ENOSPC)

    def _create_file(self, path: str, size: int, direct: bool | str) -> File:
        # Created here rather than by the engine's "w" so that the create goes through
        # fsops (the run directory is new and empty: there is nothing to truncate).
        try:
            fsops.ops().create(path)
        except OSError as exc:
            raise TierMemIOError(f"creating swap file {path} failed: {exc.strerror}",
                                 op="open", path=path, errno=exc.errno) from None
        f = self.engine.open(path, "r+", direct=direct, follow_symlinks=False)
        try:
            self._allocate(f, size)
            # The file's entry must outlive a power loss: for the first swap path the
            # manifest's directory fsync would cover it, for the others nothing else does.
            _sync_dir(os.path.dirname(path), "swap.create.dirsync")
        except BaseException:
            f.close()
            raise
        return f

    @staticmethod
    def _allocate(f: File, size: int) -> None:
        # The new size becomes durable with the next commit's fdatasync (store.sync).
        try:
            if size:
                fsops.ops().fallocate(f.fd, f.path, size)
        except OSError as exc:
            raise TierMemIOError(f"preallocating {format_size(size)} for {f.path} failed: "
                                 f"{exc.strerror}", op="preallocate", path=f.path, offset=0,
                                 length=size, errno=exc.errno) from None

    def _offset(self, part: Partition) -> int:
        s = self.slots[part.id]
        return s.offset + self.latest[part.id] * s.nbytes

    def read(self, part: Partition, buf: torch.Tensor, *, after: Request | None = None,
             nbytes: int | None = None) -> Request:
        """Read `part`'s record (its first `nbytes` only, if given) into `buf`; `after`: a
        write from `buf` still in flight, which the read follows piece by piece
        (IOEngine.read)."""
        s = self.slots[part.id]
        n = s.nbytes if nbytes is None else nbytes
        return self.engine.read(self.files[s.file], buf[:n], self._offset(part), after=after)

    def write(self, part: Partition, buf: torch.Tensor, *,
              digest: int | None = None) -> Request:
        """Seal (when checksummed) and write `part`'s record from `buf`. `digest`: the
        CRC32C of the record's bytes, when its update computed it (no second pass)."""
        s = self.slots[part.id]
        # Never over the committed copy: a write torn by a crash must leave it whole.
        self.latest[part.id] = (self.committed[part.id][0] + 1) % self.copies
        if self.checksums:
            # The generation moves on when the write is issued: if the write is lost,
            # the next read finds the older one and says so.
            self.generation[part.id] += 1
            seal(buf, part.record_bytes, part.id, self.generation[part.id], digest=digest)
        return self.engine.write(self.files[s.file], buf[: s.nbytes], self._offset(part))

    def rewrite(self, part: Partition, buf: torch.Tensor) -> Request:
        """Issue a failed write again, to the same copy, footer and generation unchanged."""
        s = self.slots[part.id]
        return self.engine.write(self.files[s.file], buf[: s.nbytes], self._offset(part))

    def finish_write(self, part: Partition, buf: torch.Tensor, req: Request, *,
                     retries: int) -> int:
        """Wait for `req`, a write of `part` from `buf`, reissuing it (same copy, footer and
        generation) up to `retries` times; returns how many attempts failed before one
        landed, or raises the last failure (`buf` then holds the only current copy)."""
        failed = 0
        while True:
            try:
                req.wait()
                return failed
            except TierMemIOError:
                if failed == retries:
                    raise
            failed += 1
            req = self.rewrite(part, buf)

    def verify(self, part: Partition, buf: torch.Tensor, landing: Request | None = None
               ) -> None:
        """Check a record that a read() brought into `buf` (raises IntegrityError).
        `landing`: that read, maybe still in flight: waited for here (its failure raises
        as its wait() does), the record hashed as it lands."""
        if not self.checksums:
            if landing is not None:
                landing.wait()
            return
        found = (hash_landing(buf, part.record_bytes, landing)
                 if landing is not None else None)
        s = self.slots[part.id]
        check(buf, part.record_bytes, part.id, self.generation[part.id],
              path=self.files[s.file].path, offset=self._offset(part), found=found)

    # -- commits (crash-consistent mode) ------------------------------------------

    def sync(self) -> None:
        """Every completed write is on stable storage (the disk's cache flushed too)."""
        for f in self.files:
            try:
                fsops.ops().fdatasync(f.fd, f.path, site="swap.fdatasync")
            except OSError as exc:
                raise TierMemIOError(f"fdatasync of {f.path} failed: {exc.strerror}",
                                     op="fdatasync", path=f.path, errno=exc.errno) from None
            self._check_linked(f)

    @staticmethod
    def _check_linked(f: File) -> None:
        """An open file takes writes and syncs after its directory was removed, but a
        manifest naming records in it would name nothing after a crash: refuse."""
        held = os.fstat(f.fd)
        try:
            at = os.stat(f.path, follow_symlinks=False)
        except OSError:
            at = None
        if held.st_nlink == 0 or at is None or (at.st_dev, at.st_ino) != (held.st_dev,
                                                                          held.st_ino):
            why = ("the swap directory was removed, or its drive is gone"
                   if not os.path.isdir(os.path.dirname(f.path)) else "removed or replaced")
            raise TierMemIOError(
                f"swap file {f.path} is no longer in its directory ({why}): records there "
                "would not survive this process",
                op="fdatasync", path=f.path, errno=_errno.ENOENT)

    def latest_records(self) -> dict[int, tuple[int, int]]:
        """(copy, generation) of every partition's latest record, for a manifest."""
        return {pid: (self.latest[pid], self.generation[pid]) for pid in self.slots}

    def mark_committed(self, records: dict[int, tuple[int, int]]) -> None:
        """A manifest naming `records` is on disk: later writes must spare those copies."""
        self.committed.update(records)

    def restore(self, records: dict[int, tuple[int, int]]) -> None:
        """Make the committed records of a manifest the latest (resume)."""
        for pid, (copy, gen) in records.items():
            self.latest[pid] = copy
            self.generation[pid] = gen
        self.committed.update(records)

    def locations(self) -> dict[int, list[int]]:
        """file, offset, nbytes of copy 0 of each record (copy k is k * nbytes further)."""
        return {pid: [s.file, s.offset, s.nbytes] for pid, s in self.slots.items()}

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def close(self) -> None:
        """Close the files (after their transfers) and drop the locks, keeping it all on disk."""
        for f in self.files:
            f.close()
        for rd in self._held:
            rd.release()

    def remove(self) -> None:
        """Close and delete this run's swap directories. Call only once the state is safe."""
        for f in self.files:
            f.close()
        for rd in self._held:
            remove_run_dir(rd.path)  # still locked: nobody else adopts it meanwhile
            rd.release()
        self._held = []
