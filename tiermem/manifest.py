"""The manifest of state kept on disk at exit, and its check on resume.

When the optimizer state does not fit back into host memory, the run directory
keeps the swap files plus `resident.swap` (records of host/GPU-tier
partitions) and `manifest.json` (layout, step counts, which records were never
written). The manifest is written last and atomically (write, fsync, rename,
fsync the directory), so a directory with a manifest is a complete state.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Sequence

from tiermem.errors import TierMemError
from tiermem.partition import Partition

MANIFEST = "manifest.json"
RESIDENT_FILE = "resident.swap"
VERSION = 1


@dataclass
class Manifest:
    partitions: list[dict]  # id, tier, numel, record_bytes, kinds
    steps: list[float]
    fresh: list[int]  # partitions never written (their records hold nothing yet)
    resident: list[dict] = field(default_factory=list)  # id, offset, nbytes in RESIDENT_FILE
    generations: dict = field(default_factory=dict)  # partition id -> last generation written
    version: int = VERSION


def layout_of(parts: Sequence[Partition]) -> list[dict]:
    return [{"id": p.id, "tier": p.tier, "numel": p.numel, "record_bytes": p.record_bytes,
             "kinds": list(p.kinds)} for p in parts]


def write_manifest(run_dir: str, manifest: Manifest) -> str:
    path = os.path.join(run_dir, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(manifest), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)
    return path


def read_manifest(run_dir: str, parts: Sequence[Partition]) -> Manifest:
    """The manifest in `run_dir`, checked against the layout this optimizer and config give."""
    path = os.path.join(run_dir, MANIFEST)
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
    expected = layout_of(parts)
    if m.partitions != expected:
        diff = next((i for i, (a, b) in enumerate(zip(m.partitions, expected)) if a != b),
                    min(len(m.partitions), len(expected)))
        raise TierMemError(
            f"cannot resume from {run_dir}: the kept state has {len(m.partitions)} partitions "
            f"and this optimizer/config lays out {len(expected)}; they first differ at "
            f"partition {diff}. Resume with the same model, optimizer param groups and "
            "config (partition_size, tier capacities, placement).")
    return m
