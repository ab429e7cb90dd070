"""`tiermem probe`: is this directory fit to hold swap files, and how fast is it?

Checks filesystem type, free space, write permission, O_DIRECT and io_uring,
then measures sequential write and read throughput with the engine itself for
a few block sizes x queue depths, and recommends an `io:` config section.
"""

from __future__ import annotations

import errno as _errno
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from tiermem.io.buffers import aligned_empty
from tiermem.io import IOEngine, io_uring_status
from tiermem.sizes import format_size, yaml_size
from tiermem.swap.paths import check_paths
from tiermem.sysinfo import free_bytes, mount_of

MiB = 1 << 20
CHUNK = 64 * MiB  # bytes per submitted request; the engine cuts it into blocks
INFLIGHT = 3  # requests kept outstanding so the ring never drains between them


@dataclass
class Measurement:
    backend: str
    block_size: int
    queue_depth: int
    write_gbps: float
    read_gbps: float


@dataclass
class ProbeReport:
    path: str
    fstype: str = "unknown"
    mountpoint: str = "?"
    free_bytes: int = 0
    writable: bool = False
    o_direct: bool = False
    io_uring: bool = False
    io_uring_detail: str = ""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    recommended: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _check_writable(path: str) -> tuple[bool, bool, str]:
    """(writable, O_DIRECT works, problem) by creating a real file in `path`."""
    probe_file = os.path.join(path, f".tiermem-probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(probe_file, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return False, False, f"cannot create files in {path}: {exc.strerror}"
    os.close(fd)
    try:
        fd = os.open(probe_file, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        os.close(fd)
        direct = True
    except OSError as exc:
        if exc.errno != _errno.EINVAL:
            raise
        direct = False
    finally:
        os.unlink(probe_file)
    return True, direct, ""


def _measure(path: str, backend: str, block_size: int, depth: int, size: int,
             buffers: Sequence, direct: bool) -> Measurement:
    """Sequential write then read of `size` bytes through one engine."""
    target = os.path.join(path, f".tiermem-probe-{uuid.uuid4().hex}.bin")
    with IOEngine(backend, queue_depth=depth, block_size=block_size) as eng:
        eng.register_buffers(buffers)
        with eng.open(target, "w", direct=direct) as f:
            try:
                os.posix_fallocate(f.fd, 0, size)
                seconds = []
                for op in (eng.write, eng.read):
                    t0 = time.perf_counter()
                    _stream(op, f, buffers, size)
                    if op is eng.write:
                        os.fsync(f.fd)
                    if not direct:  # keep the read honest: not from the page cache
                        os.posix_fadvise(f.fd, 0, size, os.POSIX_FADV_DONTNEED)
                    seconds.append(time.perf_counter() - t0)
            finally:
                os.unlink(target)
    return Measurement(backend, block_size, depth, size / seconds[0] / 1e9,
                       size / seconds[1] / 1e9)


def _stream(op, f, buffers: Sequence, size: int) -> None:
    pending = []
    for i, off in enumerate(range(0, size, CHUNK)):
        buf = buffers[i % len(buffers)]
        pending.append(op(f, buf[: min(CHUNK, size - off)], off))
        if len(pending) >= INFLIGHT:
            pending.pop(0).wait()
    for req in pending:
        req.wait()


def recommend(measurements: Sequence[Measurement], direct: bool) -> dict | None:
    """The io: section whose read+write of the same bytes takes least time.

    Within 10% of the best (run-to-run noise here is larger), io_uring wins over
    threads (it costs no Python per block) and then the smaller queue depth."""
    if not measurements:
        return None

    def cost(m: Measurement) -> float:
        return 1 / m.write_gbps + 1 / m.read_gbps

    best = min(cost(m) for m in measurements)
    close = [m for m in measurements if cost(m) <= best * 1.10]
    pick = min(close, key=lambda m: (m.backend != "io_uring", m.queue_depth, cost(m)))
    return {"backend": pick.backend, "queue_depth": pick.queue_depth,
            "block_size": yaml_size(pick.block_size), "o_direct": True if direct else False}


def run_probe(path: str, *, size: int = 256 * MiB,
              block_sizes: Sequence[int] = (256 << 10, MiB, 4 * MiB),
              depths: Sequence[int] = (8, 32), backends: Sequence[str] | None = None,
              progress: Callable[[str], None] | None = None) -> ProbeReport:
    """Check `path` as offload() would (swap.paths) and measure it; problems go in
    report.problems. A directory the probe had to create is removed again. `progress`
    gets a line per measurement as it finishes."""
    check = check_paths([path]).checks[0]
    path = os.path.abspath(os.path.expanduser(os.path.expandvars(path)))
    report = ProbeReport(path)
    report.warnings += check.warnings
    report.notes += check.notes
    if check.errors:  # what offload() would refuse is not worth measuring
        report.problems += check.errors
        return report
    created = not os.path.exists(path)
    try:
        os.mkdir(path, mode=0o700) if created else None
    except OSError as exc:
        report.problems.append(f"cannot create {path}: {exc.strerror}")
        return report
    try:
        return _probe(report, path, size, block_sizes, depths, backends, progress)
    finally:
        if created:
            try:
                os.rmdir(path)
            except OSError:
                pass  # something else wrote there meanwhile: leave it


def _probe(report: ProbeReport, path: str, size: int, block_sizes: Sequence[int],
           depths: Sequence[int], backends: Sequence[str] | None,
           progress: Callable[[str], None] | None) -> ProbeReport:
    mount = mount_of(path)
    report.fstype, report.mountpoint = mount.fstype, mount.mountpoint
    report.free_bytes = free_bytes(path)
    report.io_uring, report.io_uring_detail = io_uring_status()
    report.writable, report.o_direct, problem = _check_writable(path)
    if problem:
        report.problems.append(problem)
        return report
    if not report.o_direct:
        report.problems.append(f"the {mount.fstype} filesystem refuses O_DIRECT: swap I/O "
                               "would go through the page cache")
    if not report.io_uring:
        report.problems.append(f"io_uring unavailable ({report.io_uring_detail}); "
                               "the threads backend will be used")
    size = size // 4096 * 4096  # O_DIRECT lengths are whole pages
    needed = size + 64 * MiB
    if report.free_bytes < needed:
        report.problems.append(f"only {format_size(report.free_bytes)} free; the throughput "
                               f"test needs {format_size(needed)}")
        return report
    if backends is None:
        backends = ["io_uring", "threads"] if report.io_uring else ["threads"]
    buffers = [aligned_empty(min(CHUNK, size)) for _ in range(INFLIGHT)]
    for b in buffers:
        b.fill_(0x5A)
    for backend in backends:
        for bs in block_sizes:
            for qd in depths:
                m = _measure(path, backend, bs, qd, size, buffers, report.o_direct)
                report.measurements.append(m)
                if progress is not None:
                    progress(measurement_line(m))
    report.recommended = recommend(report.measurements, report.o_direct)
    return report


TABLE_HEAD = f"{'backend':<10}{'block':>9}{'depth':>7}{'write GB/s':>12}{'read GB/s':>11}"


def measurement_line(m: Measurement) -> str:
    return (f"{m.backend:<10}{yaml_size(m.block_size):>9}{m.queue_depth:>7}"
            f"{m.write_gbps:>12.2f}{m.read_gbps:>11.2f}")


def format_report(report: ProbeReport, *, table: bool = True) -> str:
    """The human-readable table and recommendation."""
    yes = {True: "yes", False: "NO"}
    lines = [
        f"swap directory  {report.path}",
        f"filesystem      {report.fstype} (mounted at {report.mountpoint})",
        f"free space      {format_size(report.free_bytes)}",
        f"writable        {yes[report.writable]}",
        f"O_DIRECT        {yes[report.o_direct]}",
        f"io_uring        {yes[report.io_uring]} ({report.io_uring_detail})",
    ]
    if report.measurements and table:
        lines += ["", TABLE_HEAD]
        lines += [measurement_line(m) for m in report.measurements]
    lines += [f"note: {n}" for n in report.notes]
    lines += [f"warning: {w}" for w in report.warnings]
    for p in report.problems:
        lines.append(f"problem: {p}")
    if report.recommended:
        r = report.recommended
        lines += ["", "recommended config:", "io:"]
        lines += [f"  {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in r.items()]
    return "\n".join(lines)
