"""The manifest: which records on disk make up one consistent optimizer state.

Two writers. Scratch mode writes it once, at exit, when the optimizer state does
not fit back into host memory: the run directory keeps the swap files plus
`resident.swap` (records of host/GPU-tier partitions). Crash-consistent mode
writes it after every step (a commit): every record, resident ones included,
lives in one of two copies in the swap files, and the manifest names the copy
and generation of each. Either way it is written last and atomically (write,
fsync, rename, fsync the directory), so a directory's manifest always describes
a complete state, and carries enough (parameter shapes, names, param groups,
where every record is) for `tiermem recover` to rebuild a checkpoint without
the model.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Sequence

from tiermem.errors import TierMemError, TierMemIOError
from tiermem.partition import Partition

MANIFEST = "manifest.json"
# The commit before the last one, kept for runs under torch.distributed: each rank commits
# its share on its own, so a crash between two ranks' commits leaves them one step apart,
# and a rank ahead reopens this one (its records are intact: a rank writes the next step's
# records only after that step's first collective, which needs every rank to have
# committed).
PREVIOUS = "manifest.previous.json"
RESIDENT_FILE = "resident.swap"
VERSION = 2


@dataclass
class Manifest:
    partitions: list[dict]  # id, group, tier, numel, record_bytes, kinds, segments
    steps: list[float]  # per parameter, in the optimizer's flattened order
    fresh: list[int]  # partitions never written (their records hold nothing yet)
    resident: list[dict] = field(default_factory=list)  # id, offset, nbytes in RESIDENT_FILE
    generations: dict = field(default_factory=dict)  # partition id -> generation of its record
    durability: str = "scratch"
    step: int = 0  # optimizer steps taken when this state was committed
    copies: dict = field(default_factory=dict)  # partition id -> copy (0/1) holding it
    records: dict = field(default_factory=dict)  # partition id -> [file, offset, nbytes]
    files: list[str] = field(default_factory=list)  # the swap files records refer to
    checksums: bool = True
    params: list[dict] = field(default_factory=list)  # name, shape, dtype per parameter
    groups: list[dict] = field(default_factory=list)  # hyperparameters, params as indices
    version: int = VERSION


def layout_of(parts: Sequence[Partition]) -> list[dict]:
    return [{"id": p.id, "group": p.group, "tier": p.tier, "numel": p.numel,
             "record_bytes": p.record_bytes, "kinds": list(p.kinds),
             "segments": [[s.index, s.start, s.length] for s in p.segments]} for p in parts]


def write_manifest(run_dir: str, manifest: Manifest, name: str = MANIFEST) -> str:
    """Replace `run_dir`'s manifest (or the file `name`) atomically: the old one stays valid
    until the rename, and the rename is on disk before this returns."""
    path = os.path.join(run_dir, name)
    tmp = path + ".tmp"
    data = json.dumps(asdict(manifest)).encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)  # the rename itself is durable
        finally:
            os.close(dfd)
    except OSError as exc:
        _discard(tmp)
        gone = "" if os.path.isdir(run_dir) else " (the swap directory was removed)"
        raise TierMemIOError(f"writing the manifest {path} failed: {exc.strerror} "
                             f"({errno.errorcode.get(exc.errno, exc.errno)}){gone}",
                             op="manifest", path=path, errno=exc.errno) from None
    return path


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # never written, or its directory is gone: nothing to clean


def read_manifest(run_dir: str, parts: Sequence[Partition] | None,
                  durability: str | None = None, *, previous: bool = False) -> Manifest:
    """The manifest in `run_dir` (the one before it with `previous`), checked against the
    layout this optimizer and config give (`parts`, `durability`; parts None reads it as it
    is, for `tiermem recover`)."""
    path = os.path.join(run_dir, PREVIOUS if previous else MANIFEST)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise TierMemError(f"cannot resume: {path} does not exist (no state was kept on disk "
                           "there, or the run that kept it did not finish writing it)") from None
    except ValueError as exc:
        raise TierMemError(f"cannot resume: {path} is not valid JSON ({exc})") from None
    if data.get("version") != VERSION:
        raise TierMemError(f"cannot resume: {path} has version {data.get('version')!r}, "
                           f"this tiermem reads version {VERSION}")
    m = Manifest(**data)
    if parts is None:
        return m
    if durability is not None and m.durability != durability:
        # The two modes lay the swap files out differently (one copy or two per record).
        raise TierMemError(
            f"cannot resume from {run_dir}: the kept state was written with "
            f"swap.durability: {m.durability}, this config says {durability}; resume with "
            f"{m.durability}")
    expected = layout_of(parts)
    if m.partitions != expected:
        diff = next((i for i, (a, b) in enumerate(zip(m.partitions, expected)) if a != b),
                    min(len(m.partitions), len(expected)))
        raise TierMemError(
            f"cannot resume from {run_dir}: the kept state has {len(m.partitions)} partitions "
            f"and this optimizer/config lays out {len(expected)}; they first differ at "
            f"partition {diff}. Resume with the same model, optimizer param groups and "
            "config (partition_size, tier capacities, placement, optimizer.state_dtype, "
            f"swap.durability: the kept state was written with {m.durability!r}).")
    return m
