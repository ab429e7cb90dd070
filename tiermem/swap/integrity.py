"""Checksummed, generation-numbered swap records.

With `swap.checksums: true` every record written to NVMe is followed by a
4 KiB footer: a magic string, the partition id, a generation number that grows
with every write, the length of the data and its CRC32C (tiermem/checksum.py).
A read is checked against all of them before the record is used: a flipped
bit, a record written for another partition or at another offset, or an older
copy of the right one (a lost write) raises IntegrityError instead of feeding a
wrong update.

The writer usually knows the CRC already: the native Adam kernel computes it
in the pass that updates the record (`seal(..., digest=)`). Otherwise the record
is hashed here, in C, on VERIFY_THREADS threads. A read is hashed as it lands
(`hash_landing`): only its last pieces are left to hash once it is done, so the
record a step waits for last is not held up by a pass over all of it.
"""

from __future__ import annotations

import struct
import time
from typing import Protocol

import torch

from tiermem.kernels.checksum import VERIFY_THREADS, crc32c
from tiermem.errors import TierMemError

FOOTER_BYTES = 4096
MAGIC = b"TIERMEM2"
OLD_MAGICS = {b"TIERMEM1": "an XXH3-64 footer of tiermem before the CRC32C records"}
_LAYOUT = struct.Struct("<8sQQQI")  # magic, partition, generation, data bytes, crc32c


class IntegrityError(TierMemError):
    """A swap record failed its check; names file, partition, offset, expected and found."""


def record_crc(data: torch.Tensor) -> int:
    """CRC32C of a uint8 record, hashed on VERIFY_THREADS threads."""
    return crc32c(data, threads=VERIFY_THREADS)


def seal(buf: torch.Tensor, nbytes: int, partition: int, generation: int, *,
         digest: int | None = None) -> None:
    """Write the footer after the first `nbytes` of the uint8 buffer. `digest`: the CRC32C
    of buf[:nbytes] when the caller computed it while writing the data (else hashed here)."""
    crc = record_crc(buf[:nbytes]) if digest is None else digest
    footer = _LAYOUT.pack(MAGIC, partition, generation, nbytes, crc)
    buf[nbytes: nbytes + len(footer)].copy_(torch.frombuffer(bytearray(footer), dtype=torch.uint8))


def check(buf: torch.Tensor, nbytes: int, partition: int, generation: int, *, path: str,
          offset: int, found: int | None = None) -> None:
    """Raise IntegrityError unless the footer after `nbytes` matches what was last written.
    `found`: the CRC32C of buf[:nbytes], when the caller hashed it as it landed."""
    raw = bytes(buf[nbytes: nbytes + _LAYOUT.size].numpy())
    magic, part, gen, length, expected = _LAYOUT.unpack(raw)
    where = f"swap record of partition {partition} in {path} at offset {offset}"
    if magic in OLD_MAGICS:
        raise IntegrityError(f"{where}: the footer is {OLD_MAGICS[magic]} (magic {magic!r}, "
                             f"expected {MAGIC!r}); this version cannot check it: resume "
                             "with the tiermem that wrote it, or start the run afresh")
    if magic != MAGIC:
        raise IntegrityError(f"{where}: no record footer (expected magic {MAGIC!r}, found "
                             f"{magic!r}): the file was overwritten or never written there")
    for what, want, got in (("partition id", partition, part), ("data length", nbytes, length),
                            ("generation", generation, gen)):
        if want != got:
            extra = " (an older copy: a write was lost)" if what == "generation" else ""
            raise IntegrityError(f"{where}: {what} expected {want}, found {got}{extra}")
    if found is None:
        found = record_crc(buf[:nbytes])
    if found != expected:
        raise IntegrityError(f"{where}: checksum expected {expected:#010x}, found "
                             f"{found:#010x} (CRC32C: the data changed on disk)")


HASH_STEP = 4 << 20  # bytes hashed at a time while a read lands (~0.2 ms of CRC32C)
POLL = 0.0005  # seconds between looks at a read that has landed less than HASH_STEP more


def hash_landing(buf: torch.Tensor, nbytes: int, landing: "Landing") -> int:
    """CRC32C of the uint8 buf[:nbytes], which the read `landing` is bringing in: the
    prefix it has landed is hashed while the rest moves, never a byte beyond it. Waits for
    the read (its failure raises as its wait() does) and returns the CRC."""
    crc, done = 0, 0
    while not landing.done():
        upto = min(landing.landed, nbytes)
        if upto - done >= HASH_STEP:
            crc, done = crc32c(buf[done:upto], crc, threads=VERIFY_THREADS), upto
        else:
            time.sleep(POLL)
    landing.wait()
    return crc32c(buf[done:nbytes], crc, threads=VERIFY_THREADS)


class Landing(Protocol):
    """A read in flight, as hash_landing sees it (tiermem.io.Request)."""

    @property
    def landed(self) -> int: ...

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> int: ...
