"""Sequential O_DIRECT write and read throughput of tiermem's IOEngine, against fio.

Why: the swap pipeline is only as fast as its I/O engine, and fio with
io_uring is the best a single process gets from this disk. The goal is
engine/fio >= 0.95 for reads and writes at every depth, and >= 1.0x DeepSpeed's
aio_handle (measured when DeepSpeed is installed).

Every tool writes, then reads, one shared data file that is created and filled
once before the first round, so every measured write overwrites allocated,
written blocks (a reused swap file's steady state; extending O_DIRECT writes on
ext4 run one at a time and would measure the filesystem, not the engine).
Tools are interleaved within each round, so drift of the shared disk hits all
of them alike; each figure reported is the median over rounds.

fio uses --mem=mmaphuge, which in fio 3.33 maps anonymous MAP_HUGETLB memory
when no hugetlbfs file is named (and dies with SIGSEGV when no huge pages are
free), so the script reserves huge pages through /proc/sys/vm/nr_hugepages for
the run and restores the original count afterwards, on Ctrl-C and SIGTERM too.
The engine's buffers are allocated while the pages are reserved, so both sides
use hugetlb pages; the page kind they actually got is reported.

Each pass also reads the disk's own counters (/sys/dev/block/MAJ:MIN/stat): how many
requests were in flight at the device on average while it was busy, and how large the
requests were after the block layer split or merged them, for fio and the engine alike.

Quick smoke test:  PYTHONPATH=. python3 bench/io_vs_fio.py --size 512MiB --rounds 1
Full run (root):   PYTHONPATH=. python3 bench/io_vs_fio.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from _harness import (format_size, parse_size, parser, ratio, ratio_text, run_header, save,
                      settings, show_table)
from tiermem.io import IOEngine
from tiermem.io.buffers import aligned_empty
from tiermem.sysinfo import mount_of

OPS = ("write", "read")
FIO = "fio"
URING = "tiermem io_uring"
THREADS = "tiermem threads"
DEEPSPEED = "deepspeed aio"
ENGINE_TOOLS = {URING: "io_uring", THREADS: "threads"}
GOAL_VS_FIO = 0.95
GOAL_VS_DEEPSPEED = 1.0
FIO_SLACK_PAGES = 8  # fio maps bs*iodepth plus alignment, rounded up to huge pages
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@dataclass(frozen=True)
class Measurement:
    """One timed pass over the file by one tool."""

    round: int
    tool: str
    depth: int
    op: str
    nbytes: int
    seconds: float
    queue: float | None = None  # requests in flight at the device on average while busy
    request_kib: float | None = None  # average size of the requests the device completed

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


class DeviceCounters:
    """The block device's own counters (/sys/dev/block/MAJ:MIN/stat) around one pass: how
    many requests were really in flight at the device (time_in_queue / io_ticks, iostat's
    aqu-sz over the busy time only, so fio's start-up does not count) and how large they
    were after the block layer split or merged them. Other users of the disk add to both."""

    def __init__(self, directory: Path) -> None:
        st = os.stat(directory)
        self.path = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
        if not self.path.exists():
            self.path = None  # e.g. an overlay or network filesystem: no counters

    def read(self) -> list[int] | None:
        if self.path is None:
            return None
        with open(self.path) as f:
            return [int(x) for x in f.read().split()]

    @staticmethod
    def summary(before: list[int] | None, after: list[int] | None,
                op: str) -> tuple[float | None, float | None]:
        if before is None or after is None:
            return None, None
        d = [a - b for a, b in zip(after, before)]
        ios, sectors = (d[0], d[2]) if op == "read" else (d[4], d[6])
        queue = d[10] / d[9] if d[9] > 0 else None  # time_in_queue ms / io_ticks ms
        return queue, (sectors * 512 / 1024 / ios if ios else None)


# -- arguments -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line settings; sizes accept strings such as 4GiB or 512MiB."""
    p = parser(__doc__, json_name="io_vs_fio.json", quick={"size": "512MiB", "rounds": 1})
    p.add_argument("--size", type=parse_size, default="4GiB",
                   help="bytes written and read per pass (default 4GiB)")
    p.add_argument("--block-size", type=parse_size, default="1MiB",
                   help="bytes per I/O (default 1MiB)")
    p.add_argument("--depths", type=_int_list, default="8,32",
                   help="comma-separated queue depths (default 8,32)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds; the median is reported (default 5)")
    p.add_argument("--directory", type=Path, default=Path("/var/tmp/tiermem-bench"),
                   help="where the data file goes; a local disk filesystem that takes "
                        "O_DIRECT (default /var/tmp/tiermem-bench)")
    p.add_argument("--chunk", type=parse_size, default=None,
                   help="bytes per engine request; the engine cuts it into block-size "
                        "pieces (default: depth x block size / inflight, so the engine's "
                        "buffers span as much memory as fio's, depth x block size: this "
                        "VM's disk reads ~10%% slower into a working set of hundreds of "
                        "MiB than into one of a few MiB, for fio and the engine alike)")
    p.add_argument("--inflight", type=int, default=4,
                   help="engine requests kept outstanding so the queue never drains "
                        "between them; also the number of buffers (default 3)")
    p.add_argument("--deepspeed-chunk", type=parse_size, default="64MiB",
                   help="bytes per aio_handle request (default 64MiB: it submits each "
                        "request whole, and small ones cost it dearly)")
    p.add_argument("--no-deepspeed", action="store_true",
                   help="skip DeepSpeed's aio_handle even when it is installed")
    p.add_argument("--deepspeed-threads", type=int, default=1,
                   help="aio_handle intra_op_parallelism; each thread keeps its own "
                        "queue of `depth`, so 1 keeps depths equal (default 1)")
    p.add_argument("--fio-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every fio run, e.g. --fio-arg=--fixedbufs")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject settings that would fail half-way through a long run."""
    align = 4096
    if a.block_size % align or a.block_size <= 0:
        p.error(f"--block-size must be a positive multiple of {align}")
    if a.size % a.block_size or a.size <= 0:
        p.error("--size must be a positive multiple of --block-size")
    if a.chunk is not None and (a.chunk % a.block_size or a.chunk <= 0):
        p.error("--chunk must be a positive multiple of --block-size")
    if not a.depths or min(a.depths) < 1:
        p.error("--depths needs at least one depth >= 1")
    if a.rounds < 1 or a.inflight < 1 or a.deepspeed_threads < 1:
        p.error("--rounds, --inflight and --deepspeed-threads must be >= 1")
    if a.deepspeed_chunk % a.deepspeed_threads or a.deepspeed_chunk % a.block_size:
        p.error("--deepspeed-chunk must be a multiple of --block-size and divide evenly "
                "among --deepspeed-threads")


def chunk_for(a: argparse.Namespace, depth: int) -> int:
    """Bytes per engine request at `depth`: --chunk, or depth x block size split over the
    requests in flight (fio's memory footprint), whole blocks, at most the file."""
    if a.chunk is not None:
        return min(a.chunk, a.size)
    blocks = max(1, depth // a.inflight)
    return min(blocks * a.block_size, a.size)


# -- huge pages ------------------------------------------------------------------------------


def meminfo_hugepages() -> dict[str, int]:
    """HugePages_* counts and Hugepagesize (bytes) from /proc/meminfo."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key.startswith("HugePages_"):
                out[key[len("HugePages_"):].lower()] = int(rest.split()[0])
            elif key == "Hugepagesize":
                out["size"] = int(rest.split()[0]) * 1024
    return out


def read_nr_hugepages() -> int:
    with open(NR_HUGEPAGES) as f:
        return int(f.read())


def write_nr_hugepages(n: int) -> None:
    with open(NR_HUGEPAGES, "w") as f:
        f.write(f"{n}\n")


def pages_for(nbytes: int, page: int) -> int:
    return -(-nbytes // page)


class HugePageReservation:
    """Adds huge pages to the system pool for the run and puts the count back afterwards.

    Free pages come and go under us: the previous fio's pages are freed only once
    its io_uring has torn down, and other processes may take free pages
    (tiermem's own buffers take hugetlb pages first). So ensure_available() tops
    the pool up before each fio run rather than trusting the count reserved at
    the start. The original count is restored even when another process changed it
    meanwhile; `changed_by_others` records that it happened.
    """

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.original: int | None = None
        self.last_set: int | None = None
        self.changed_by_others = False
        self.peak = 0

    def __enter__(self) -> "HugePageReservation":
        self.original = read_nr_hugepages()
        self._set(self.original + self.pages)
        got = read_nr_hugepages() - self.original
        if got < self.pages:
            print(f"note: asked the kernel for {self.pages} more huge pages, got {got} "
                  "(memory too fragmented?)", file=sys.stderr)
        return self

    def _set(self, n: int) -> None:
        try:
            write_nr_hugepages(n)
        except PermissionError:
            raise SystemExit(f"cannot write {NR_HUGEPAGES}: reserving huge pages for fio's "
                             "--mem=mmaphuge needs root") from None
        self.last_set = read_nr_hugepages()
        self.peak = max(self.peak, self.last_set)

    def ensure_available(self, pages: int) -> None:
        """Grow the pool until `pages` huge pages are free and not reserved by anyone."""
        info = meminfo_hugepages()
        short = pages - (info["free"] - info["rsvd"])
        if short > 0:
            self._set(self._current() + short)

    def _current(self) -> int:
        n = read_nr_hugepages()
        if n != self.last_set:
            self.changed_by_others = True
            print(f"note: another process changed {NR_HUGEPAGES} from {self.last_set} to {n} "
                  "during the run", file=sys.stderr)
        return n

    def __exit__(self, *exc: Any) -> None:
        if self.original is not None:
            self._current()
            write_nr_hugepages(self.original)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while the run lasts, so `finally` blocks
    (huge-page count, data file) run when the run is killed politely."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the data file ---------------------------------------------------------------------------


@contextlib.contextmanager
def data_file(directory: Path, size: int) -> Iterator[Path]:
    """A preallocated file of `size` bytes in `directory`, deleted afterwards (with the
    directory, when this created it and left it empty)."""
    created_dir = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < size + (1 << 30):
        raise SystemExit(f"{directory}: {free} bytes free; the run needs {size} plus 1 GiB")
    path = directory / f"io_vs_fio-{os.getpid()}.dat"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        yield path
    finally:
        path.unlink(missing_ok=True)
        if created_dir:
            with contextlib.suppress(OSError):
                directory.rmdir()


# -- tiermem's engine ------------------------------------------------------------------------


def engine_pass(engine: IOEngine, path: Path, op: str, size: int,
                buffers: Sequence[torch.Tensor], chunk: int) -> float:
    """Seconds to move `size` bytes sequentially in `chunk`-byte requests, `len(buffers)`
    outstanding (only the first `chunk` bytes of each buffer are used)."""
    with engine.open(path, "r+", direct=True) as f:
        submit = engine.read if op == "read" else engine.write
        pending: deque = deque()
        start = time.perf_counter()
        for i, offset in enumerate(range(0, size, chunk)):
            if len(pending) == len(buffers):
                pending.popleft().wait()  # frees the buffer this request reuses
            buf = buffers[i % len(buffers)][:min(chunk, size - offset)]
            pending.append(submit(f, buf, offset))
        while pending:
            pending.popleft().wait()
        return time.perf_counter() - start


def allocate_engine_buffers(count: int, nbytes: int) -> list[torch.Tensor]:
    """The engine's buffers, allocated once: first touch of fresh memory is slow here."""
    return [aligned_empty(nbytes) for _ in range(count)]


def describe_buffers(buffers: Sequence[torch.Tensor]) -> dict[str, Any]:
    infos = [b.tiermem_info for b in buffers]
    return {"count": len(buffers), "nbytes": infos[0].nbytes,
            "pages": "/".join(sorted({i.pages for i in infos})),
            "locked": all(i.locked for i in infos)}


def open_engines(stack: contextlib.ExitStack, depths: Sequence[int], block_size: int,
                 buffers: Sequence[torch.Tensor]) -> tuple[dict[tuple[str, int], IOEngine], bool]:
    """One engine per backend and depth for the whole run, and whether every io_uring one
    took the buffers as fixed buffers (as a BufferPool given the engine would)."""
    engines, registered = {}, True
    for tool, backend in ENGINE_TOOLS.items():
        for depth in depths:
            eng = stack.enter_context(
                IOEngine(backend=backend, queue_depth=depth, block_size=block_size))
            ok = eng.register_buffers(list(buffers))
            registered &= ok or backend != "io_uring"
            engines[tool, depth] = eng
    return engines, registered


# -- fio -------------------------------------------------------------------------------------


class FioFailed(RuntimeError):
    """fio exited with an error or reported one for the job."""


def fio_version() -> str:
    return subprocess.run([FIO, "--version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def fio_command(path: Path, op: str, size: int, block_size: int, depth: int,
                extra: Sequence[str]) -> list[str]:
    """fio's best single-job sequential run; the file already has its full size, so fio
    neither lays it out nor unlinks it."""
    return [FIO, "--name=io_vs_fio", f"--filename={path}", f"--rw={op}", f"--size={size}",
            f"--bs={block_size}", f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1",
            "--mem=mmaphuge", "--fallocate=none", "--numjobs=1",
            "--output-format=json", *extra]


def fio_pass(cmd: Sequence[str], op: str) -> tuple[int, float]:
    """(bytes, seconds) of one fio run, from its JSON report."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    report = _fio_json(proc.stdout)
    job = report["jobs"][0] if report else None
    if proc.returncode != 0 or job is None or job.get("error"):
        free = meminfo_hugepages()
        raise FioFailed(f"fio failed (exit {proc.returncode}, error "
                        f"{job and job.get('error')}): {proc.stderr.strip()[-500:]}\n"
                        f"command: {shlex.join(cmd)}\n(--mem=mmaphuge needs free huge "
                        f"pages; now HugePages_Free={free['free']} Rsvd={free['rsvd']}; "
                        "with none fio dies with SIGSEGV, with too few reads fail EFAULT)")
    stats = job[op]
    return stats["io_bytes"], stats["io_bytes"] / stats["bw_bytes"]


def _fio_json(stdout: str) -> dict | None:
    """fio may print notes before its JSON; parse from the first brace."""
    start = stdout.find("{")
    try:
        return json.loads(stdout[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


# -- DeepSpeed -------------------------------------------------------------------------------


def load_deepspeed_aio() -> tuple[Any, dict[str, Any]]:
    """DeepSpeed's compiled async_io module, or None, with a status saying why not."""
    try:
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:  # ImportError, or a broken install raising anything
        return None, {"status": "not installed", "detail": f"{type(exc).__name__}: {exc}"}
    info = {"version": deepspeed.__version__}
    # Its NVMe-wear warning on every first write would break up the progress lines.
    deepspeed.utils.logger.setLevel(logging.ERROR)
    try:
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, {**info, "status": "not compatible (libaio-dev missing?)"}
        print("loading DeepSpeed's async_io op (compiled on first use: minutes)...",
              flush=True)
        return builder.load(verbose=False), {**info, "status": "measured"}
    except Exception as exc:
        return None, {**info, "status": f"failed to load: {type(exc).__name__}: {exc}"}


def open_deepspeed(stack: contextlib.ExitStack, aio: Any, depths: Sequence[int],
                   block_size: int, chunks: dict[int, int], count: int,
                   threads: int) -> dict[int, tuple[Any, list[torch.Tensor]]]:
    """One aio_handle per depth (DeepSpeed's defaults otherwise: single_submit off,
    overlap_events on) with its own page-locked buffers from new_cpu_locked_tensor, so
    it never copies through a bounce buffer."""
    out = {}
    for depth in depths:
        handle = aio.aio_handle(block_size, depth, False, True, threads)
        example = torch.empty(0, dtype=torch.uint8)
        bufs = [handle.new_cpu_locked_tensor(chunks[depth], example) for _ in range(count)]
        for b in bufs:
            stack.callback(handle.free_cpu_locked_tensor, b)
        out[depth] = handle, bufs
    return out


def deepspeed_pass(handle: Any, buffers: Sequence[torch.Tensor], path: Path, op: str,
                   size: int) -> float:
    """Seconds for aio_handle to move `size` bytes: every chunk submitted, then one wait().

    wait() returns only when everything is done, so submitting the whole file up
    front is the most favourable pattern for it; its worker runs one chunk at a time.
    """
    chunk = buffers[0].numel()
    submit = handle.async_pread if op == "read" else handle.async_pwrite
    offsets = range(0, size, chunk)
    start = time.perf_counter()
    for i, offset in enumerate(offsets):
        buf = buffers[i % len(buffers)][:min(chunk, size - offset)]
        if submit(buf, str(path), offset) != 0:
            handle.wait()
            raise RuntimeError(f"deepspeed aio {op} at offset {offset} was refused")
    done = handle.wait()
    seconds = time.perf_counter() - start
    if done != len(offsets):
        raise RuntimeError(f"deepspeed aio {op}: {done} of {len(offsets)} requests completed")
    return seconds


# -- the run ---------------------------------------------------------------------------------


Measure = Callable[[str, int], tuple[int, float]]


def build_tools(args: argparse.Namespace, path: Path, engines: dict, deepspeed: dict | None,
                buffers: Sequence[torch.Tensor],
                hugepages: HugePageReservation) -> dict[str, Measure]:
    """Name -> measure(op, depth) returning (bytes, seconds), in the order they run."""
    hp = meminfo_hugepages()["size"]

    def fio(op: str, depth: int) -> tuple[int, float]:
        cmd = fio_command(path, op, args.size, args.block_size, depth, args.fio_arg)
        need = pages_for(args.block_size * depth, hp) + FIO_SLACK_PAGES
        hugepages.ensure_available(need)
        try:
            return fio_pass(cmd, op)
        except FioFailed as exc:  # another process may have shrunk the pool meanwhile
            print(f"note: {str(exc).splitlines()[0]}; retrying once", file=sys.stderr)
            hugepages.ensure_available(need)
            return fio_pass(cmd, op)

    def engine(tool: str) -> Measure:
        return lambda op, depth: (args.size, engine_pass(engines[tool, depth], path, op,
                                                         args.size, buffers,
                                                         chunk_for(args, depth)))

    tools: dict[str, Measure] = {FIO: fio, URING: engine(URING), THREADS: engine(THREADS)}
    if deepspeed is not None:
        tools[DEEPSPEED] = lambda op, depth: (args.size, deepspeed_pass(
            *deepspeed[depth], path, op, args.size))
    return tools


def run_rounds(tools: dict[str, Measure], depths: Sequence[int], rounds: int,
               counters: DeviceCounters | None = None) -> list[Measurement]:
    """Interleave tools within each round (per depth: all writes, then all reads) so that
    disk drift shared with other users of the machine hits every tool alike."""
    results = []
    for r in range(1, rounds + 1):
        for depth in depths:
            for op in OPS:
                for name, measure in tools.items():
                    before = counters.read() if counters else None
                    nbytes, seconds = measure(op, depth)
                    queue, kib = DeviceCounters.summary(
                        before, counters.read() if counters else None, op)
                    m = Measurement(r, name, depth, op, nbytes, seconds, queue, kib)
                    results.append(m)
                    seen = (f"  device: {queue:5.2f} in flight, {kib:6.0f} KiB/request"
                            if queue is not None and kib is not None else "")
                    print(f"round {r}/{rounds}  qd {depth:<3} {op:<5}  {name:<16} "
                          f"{m.gbps:6.2f} GB/s{seen}", flush=True)
    return results


def summarize(results: Sequence[Measurement]) -> list[dict[str, Any]]:
    """Median GB/s per (tool, depth, op), with ratios to fio and DeepSpeed at the same
    depth and op, and whether tiermem met its goals."""
    groups: dict[tuple[str, int, str], list[float]] = {}
    queues: dict[tuple[str, int, str], list[float]] = {}
    sizes: dict[tuple[str, int, str], list[float]] = {}
    for m in results:
        groups.setdefault((m.tool, m.depth, m.op), []).append(m.gbps)
        if m.queue is not None:
            queues.setdefault((m.tool, m.depth, m.op), []).append(m.queue)
        if m.request_kib is not None:
            sizes.setdefault((m.tool, m.depth, m.op), []).append(m.request_kib)
    medians = {k: statistics.median(v) for k, v in groups.items()}
    rows = []
    for (tool, depth, op), gbps in medians.items():
        fio = medians.get((FIO, depth, op))
        ds = medians.get((DEEPSPEED, depth, op))
        row = {"tool": tool, "depth": depth, "op": op, "gbps_median": gbps,
               "gbps_rounds": groups[tool, depth, op],
               "vs_fio": ratio(gbps, fio), "vs_deepspeed": ratio(gbps, ds),
               "device_queue_median": (statistics.median(queues[tool, depth, op])
                                       if (tool, depth, op) in queues else None),
               "request_kib_median": (statistics.median(sizes[tool, depth, op])
                                      if (tool, depth, op) in sizes else None)}
        if tool in ENGINE_TOOLS:
            row["meets_fio_goal"] = row["vs_fio"] is not None and row["vs_fio"] >= GOAL_VS_FIO
            row["meets_deepspeed_goal"] = (None if ds is None
                                           else row["vs_deepspeed"] >= GOAL_VS_DEEPSPEED)
        rows.append(row)
    order = {name: i for i, name in enumerate((FIO, URING, THREADS, DEEPSPEED))}
    rows.sort(key=lambda r: (r["depth"], OPS.index(r["op"]), order[r["tool"]]))
    return rows


def _ratio_cell(ratio: float | None, goal: float, is_engine: bool, missing: str) -> str:
    if ratio is None:
        return missing
    return ratio_text(ratio) + ("" if not is_engine else " ok" if ratio >= goal else " MISS")


def show_results(summary: Sequence[dict[str, Any]], deepspeed_status: str) -> str:
    """The markdown table printed and pasted into docs/dev/io-benchmark.md."""
    ds_missing = "n/a" if deepspeed_status == "measured" else deepspeed_status
    rows = [[r["tool"], r["depth"], r["op"], f"{r['gbps_median']:.2f}",
             _ratio_cell(r["vs_fio"], GOAL_VS_FIO, r["tool"] in ENGINE_TOOLS, "n/a"),
             _ratio_cell(r["vs_deepspeed"], GOAL_VS_DEEPSPEED, r["tool"] in ENGINE_TOOLS,
                         ds_missing),
             "n/a" if r["device_queue_median"] is None else f"{r['device_queue_median']:.2f}",
             "n/a" if r["request_kib_median"] is None else f"{r['request_kib_median']:.0f}"]
            for r in summary]
    print()
    return show_table(
        ["backend/tool", "depth", "op", "GB/s (median)", f"vs fio (goal >= {GOAL_VS_FIO})",
         f"vs DeepSpeed aio (goal >= {GOAL_VS_DEEPSPEED})", "in flight at device",
         "KiB/request"], rows)


def fill_file(engine: IOEngine, path: Path, size: int,
              buffers: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Write the file once, untimed in the results, so every measured write overwrites
    written blocks rather than converting preallocated ones."""
    seconds = engine_pass(engine, path, "write", size, buffers, buffers[0].numel())
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"tool": URING, "depth": engine.queue_depth, "gbps": size / seconds / 1e9}


def file_system_facts(directory: Path) -> dict[str, Any]:
    mnt = mount_of(str(directory))
    return {"directory": str(directory), "fs_type": mnt.fstype, "fs_source": mnt.source,
            "mountpoint": mnt.mountpoint}


def thp_setting() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return None


def max_chunk(args: argparse.Namespace) -> int:
    return max(chunk_for(args, d) for d in args.depths)


def measure_all(args: argparse.Namespace, aio: Any, facts: dict[str, Any]) -> list[Measurement]:
    """Reserve huge pages and the data file around the run; the count is restored even
    when the run fails or is interrupted."""
    hp = meminfo_hugepages()["size"]
    engine_pages = pages_for(max_chunk(args), hp) * args.inflight
    fio_pages = pages_for(args.block_size * max(args.depths), hp) + FIO_SLACK_PAGES
    reservation = HugePageReservation(engine_pages + fio_pages)
    facts["nr_hugepages_before"] = read_nr_hugepages()
    try:
        with reservation, data_file(args.directory, args.size) as path:
            results = run_with_tools(args, aio, path, reservation, facts)
            gc.collect()  # unmap the hugetlb buffers before the pool shrinks
    finally:
        facts["nr_hugepages_reserved"] = reservation.pages
        facts["nr_hugepages_peak"] = reservation.peak
        facts["nr_hugepages_changed_by_others"] = reservation.changed_by_others
        facts["nr_hugepages_after"] = read_nr_hugepages()
    return results


def run_with_tools(args: argparse.Namespace, aio: Any, path: Path,
                   reservation: HugePageReservation, facts: dict[str, Any]) -> list[Measurement]:
    """Allocate buffers (while the huge pages are reserved), open every tool, fill the
    file, run the rounds; buffers and engines are gone when this returns."""
    with contextlib.ExitStack() as stack:
        buffers = allocate_engine_buffers(args.inflight, max_chunk(args))
        engines, registered = open_engines(stack, args.depths, args.block_size, buffers)
        facts["engine_buffers"] = {**describe_buffers(buffers), "registered_io_uring": registered}
        deepspeed = None
        if aio is not None:
            deepspeed = open_deepspeed(stack, aio, args.depths, args.block_size,
                                       {d: min(args.deepspeed_chunk, args.size)
                                        for d in args.depths},
                                       args.inflight, args.deepspeed_threads)
            facts["deepspeed_buffers"] = ("new_cpu_locked_tensor: posix_memalign + mlock, "
                                          "4 KiB pages")
        print(f"engine buffers: {args.inflight} x {format_size(max_chunk(args))}, "
              f"pages={facts['engine_buffers']['pages']}, registered={registered}", flush=True)
        facts["fill"] = fill_file(engines[URING, max(args.depths)], path, args.size, buffers)
        tools = build_tools(args, path, engines, deepspeed, buffers, reservation)
        return run_rounds(tools, args.depths, args.rounds, DeviceCounters(args.directory))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    header = run_header("io_vs_fio", argv)
    aio, ds_info = (None, {"status": "skipped (--no-deepspeed)"}) if args.no_deepspeed \
        else load_deepspeed_aio()  # before reserving pages: it may compile for minutes
    facts = header["machine"]  # what the run finds out about the machine goes there too
    facts.update(**file_system_facts(args.directory), thp=thp_setting(), fio=fio_version(),
                 deepspeed=ds_info,
                 fio_buffers="--mem=mmaphuge: anonymous MAP_HUGETLB mapping")
    try:
        with terminate_as_interrupt():
            results = measure_all(args, aio, facts)
    except KeyboardInterrupt:
        print(f"\ninterrupted; nr_hugepages back to {facts.get('nr_hugepages_after')}, "
              "data file removed, no results written", file=sys.stderr)
        return 130
    summary = summarize(results)
    table = show_results(summary, ds_info["status"])
    print(f"\nGB/s = 1e9 bytes/s; median of {args.rounds} round(s); "
          f"{format_size(args.size)} per pass, {format_size(args.block_size)} "
          f"blocks; engine buffers: {facts['engine_buffers']['pages']} pages; "
          f"DeepSpeed aio: {ds_info['status']}")
    save(args.json, header, settings=settings(args),
         goals={"vs_fio": GOAL_VS_FIO, "vs_deepspeed": GOAL_VS_DEEPSPEED},
         rounds=[{**asdict(m), "gbps": m.gbps} for m in results], medians=summary,
         table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
