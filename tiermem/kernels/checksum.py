"""CRC32C of byte buffers, in C (native/crc32c.c): the digest of swap records.

CRC32C because CRCs of pieces combine: `combine(crc(a), crc(b), len(b)) ==
crc(a + b)`. The native Adam kernel hashes every chunk it updates while the
chunk is in cache (native_adam.adam_fused_mixed(checksums=...)), and
`RecordDigest` assembles a whole record's CRC from those pieces and the bytes
it must hash itself, so sealing a record costs no second pass over it. The
SSE4.2 instruction is used where the CPU has it (three interleaved chains,
~26 GB/s a core from cache, 12 from DRAM here), a table otherwise; buffers of
1 KiB and more are folded with AVX-512 VPCLMULQDQ where the CPU has it (~50
GB/s from cache, and from DRAM as fast as one core reads, 26 GB/s here). All
give the same value. cffi releases the GIL around every call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tiermem._lib import ffi, lib
from tiermem.partition import Partition, record_of

# A record read back is hashed on this many threads (pieces >= 4 MiB). One: the folding
# path already hashes as fast as a core reads DRAM (a second thread gained 26 -> 33 GB/s
# here), and with pipeline.overlap_backward every extra thread is taken from backward.
VERIFY_THREADS = 1


def _pointer(data: torch.Tensor) -> tuple[object, int]:
    if data.device.type != "cpu":
        raise ValueError(f"crc32c hashes host memory; got a tensor on {data.device}")
    if not data.is_contiguous():
        raise ValueError("crc32c hashes contiguous memory; got a strided tensor")
    return ffi.cast("void *", data.data_ptr()), data.numel() * data.element_size()


def crc32c(data: torch.Tensor | bytes, crc: int = 0, *, threads: int = 1) -> int:
    """CRC-32C of `data`'s bytes, continuing `crc` (0 starts a new one)."""
    if isinstance(data, (bytes, bytearray)):
        return lib.tm_crc32c(crc, ffi.from_buffer(data), len(data))
    ptr, n = _pointer(data)
    if threads > 1 and crc == 0:
        return lib.tm_crc32c_threads(ptr, n, threads)
    return lib.tm_crc32c(crc, ptr, n)


def crc32c_portable(data: bytes, crc: int = 0) -> int:
    """The table-driven path, whatever the CPU (to test the SSE4.2 one against)."""
    return lib.tm_crc32c_sw(crc, ffi.from_buffer(data), len(data))


def crc32c_sse42(data: bytes, crc: int = 0) -> int:
    """The SSE4.2 path (the portable one where the CPU lacks it: see has_sse42())."""
    return lib.tm_crc32c_hw(crc, ffi.from_buffer(data), len(data))


def has_sse42() -> bool:
    return bool(lib.tm_crc32c_hw_supported())


def crc32c_clmul(data: bytes, crc: int = 0) -> int:
    """The 128-bit PCLMULQDQ folding path (the portable one where the CPU lacks it: see
    has_clmul())."""
    return lib.tm_crc32c_clmul(crc, ffi.from_buffer(data), len(data))


def has_clmul() -> bool:
    return bool(lib.tm_crc32c_clmul_supported())


def crc_path() -> str:
    """Which path crc32c() takes on this CPU (native/crc32c.c picks it at start-up)."""
    return ("table", "sse4.2 3-way", "pclmul fold", "vpclmul fold")[lib.tm_crc32c_path()]


def has_fold() -> bool:
    """crc32c() folds buffers of 1 KiB and more with AVX-512 VPCLMULQDQ on this CPU."""
    return bool(lib.tm_crc32c_fold_supported())


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(a + b) from crc32c(a), crc32c(b) and len(b)."""
    return lib.tm_crc32c_combine(crc1, crc2, len2)


class RecordDigest:
    """The CRC32C of a record built front to back from pieces: CRCs already known (from
    the kernel) and byte ranges hashed here. `pos` is how far it has got."""

    def __init__(self, record: torch.Tensor) -> None:
        self.record = record  # uint8
        self.crc = 0
        self.pos = 0

    def add(self, crc: int, nbytes: int) -> None:
        """The next `nbytes` of the record have CRC `crc`."""
        self.crc = combine(self.crc, crc, nbytes)
        self.pos += nbytes

    def hash_to(self, end: int) -> None:
        """Hash record bytes [pos, end) directly (padding, segments not updated)."""
        if end < self.pos:
            raise ValueError(f"record digest: asked to hash back to byte {end}, already "
                             f"at {self.pos}")
        if end > self.pos:
            self.crc = crc32c(self.record[self.pos: end], self.crc)
            self.pos = end

    def finish(self, nbytes: int) -> int:
        """The CRC of record bytes [0, nbytes) (the rest hashed here)."""
        self.hash_to(nbytes)
        return self.crc


def record_digest(part: Partition, views: dict[str, torch.Tensor],
                  crcs: Sequence[dict[str, int] | None]) -> int:
    """CRC32C of the record's bytes [0, record_bytes), from the kernel's CRC of each
    segment of each kind (`crcs[i]`, None for a segment it did not update: hashed here,
    as is the padding between kinds, whatever bytes it holds: a read hashes them too)."""
    d = RecordDigest(record_of(part, views))
    for kind in part.kinds:
        d.hash_to(part.offsets[kind])
        size = part.dtype(kind).itemsize
        for seg, seg_crcs in zip(part.segments, crcs, strict=True):
            if seg_crcs is None:
                d.hash_to(d.pos + seg.size(kind) * size)
            else:
                d.add(seg_crcs[kind], seg.size(kind) * size)
    return d.finish(part.record_bytes)
