"""What a busy core does to the disk: fio's I/O floor alone and beside one thread of load.

Why: a tiered step moves its records while its update runs. On this machine (a virtual
machine whose disk is emulated by copies in the host's memory) that update's memory
traffic slows the transfers, which the I/O floor of bench/optimizers.py (fio with
nothing beside it) does not see. This measures it apart from tiermem: fio's two jobs
(read and write at once, as bench/optimizers.py's floor: io_uring, O_DIRECT, huge-page
buffers, the better of full and half depth per job) with nothing else running, and with
one thread beside them doing one kind of work the whole time:

- spin: a Python loop (a core busy, no memory traffic);
- in cache: torch adds over two 64 KiB arrays (a core busy with vector work in L1/L2);
- read: torch sums a 400 MB array over and over (a memory read stream);
- write: torch fills a 400 MB array over and over (a memory write stream);
- triad: a += b over two 400 MB arrays (reads and writes, as an optimizer update does).

Rounds alternate the loads, so the disk's drift hits all alike; the table gives each
one's median seconds and its ratio to fio alone from the same rounds (median of the
per-round ratios), and the load's own rate while fio ran.

Usage: python3 bench/disk_contention.py [--gb 1.2] [--rounds 5] [--swap-dir DIR]
       [--depth 8] [--block-size 1MiB] [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from _harness import parse_size, parser, run_header, save, settings, show_table
from pipeline import FioFloor

LOADS = ("none", "spin", "in cache", "read", "write", "triad")


class Load:
    """While open, one thread doing `kind` of work over and over; `rate` is the bytes of
    memory it streamed per second while open (0 for spin and in cache)."""

    def __init__(self, kind: str, big: int) -> None:
        import torch

        self.kind, self.stop = kind, threading.Event()
        n = 16 << 10 if kind == "in cache" else big // 4
        self.a = torch.ones(n) if kind != "none" else None
        self.b = torch.ones(n) if kind in ("in cache", "triad") else None
        self.moved, self.seconds = 0, 0.0

    def _run(self) -> None:
        a, b = self.a, self.b
        t0 = time.perf_counter()
        while not self.stop.is_set():
            if self.kind == "spin":
                x = 0
                for i in range(100_000):
                    x += i
            elif self.kind == "in cache":
                for _ in range(1000):
                    a.add_(b)
            elif self.kind == "read":
                a.sum()
                self.moved += a.nbytes
            elif self.kind == "write":
                a.fill_(1.0)
                self.moved += a.nbytes
            else:  # triad: read a and b, write a
                a.add_(b, alpha=0.5)
                self.moved += 3 * a.nbytes
        self.seconds = time.perf_counter() - t0

    def __enter__(self) -> "Load":
        if self.kind != "none":
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
            time.sleep(0.3)  # running at its pace before fio starts
        return self

    def __exit__(self, *exc) -> None:
        if self.kind != "none":
            self.stop.set()
            self.thread.join()

    @property
    def rate(self) -> float:
        return self.moved / self.seconds if self.seconds else 0.0


def parse_args(argv=None):
    p = parser(__doc__, json_name="disk_contention.json",
               quick={"gb": 0.25, "rounds": 1, "big": "64MiB"})
    p.add_argument("--gb", type=float, default=1.2,
                   help="GB fio reads and, at once, writes (default 1.2: a 300M SGD step's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every load")
    p.add_argument("--depth", type=int, default=8, help="fio's queue depth per job")
    p.add_argument("--block-size", default="1MiB", help="fio's block size")
    p.add_argument("--big", default="400MB",
                   help="bytes of each array the memory loads stream over (default 400MB)")
    p.add_argument("--swap-dir", default="/tmp/tiermem-bench-contention",
                   help="directory on the disk to measure (fio's files go there)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.gb <= 0:
        p.error("--rounds must be at least 1 and --gb positive")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if shutil.which("fio") is None or os.geteuid() != 0:
        print("disk_contention: needs fio, and root for its huge-page buffers", file=sys.stderr)
        return 2
    header = run_header("disk_contention", argv)
    nbytes, bs = int(args.gb * 1e9), parse_size(args.block_size)
    big = parse_size(args.big)
    Path(args.swap_dir).mkdir(parents=True, exist_ok=True)
    seconds = {k: [] for k in LOADS}
    rates = {k: [] for k in LOADS}
    with FioFloor(args.swap_dir, bs, args.depth, nbytes, nbytes) as floor:
        floor.measure()  # a first run warms the files and the huge-page pool
        for r in range(args.rounds):
            order = LOADS if r % 2 == 0 else LOADS[::-1]
            for kind in order:
                with Load(kind, big) as load:
                    got = floor.measure()
                seconds[kind].append(got["seconds"])
                rates[kind].append(load.rate)
            print(f"round {r + 1}: " + ", ".join(f"{k} {seconds[k][-1]:.3f} s" for k in LOADS),
                  flush=True)
    try:
        Path(args.swap_dir).rmdir()
    except OSError:
        pass
    results, rows = {}, []
    for k in LOADS:
        ratios = [s / n for s, n in zip(seconds[k], seconds["none"])]
        results[k] = {"seconds": seconds[k], "median": statistics.median(seconds[k]),
                      "ratio": statistics.median(ratios), "ratios": ratios,
                      "load_bytes_per_second": statistics.median(rates[k])}
        rows.append([k, f"{results[k]['median']:.3f} s", f"{results[k]['ratio']:.3f}",
                     f"{min(ratios):.3f}-{max(ratios):.3f}",
                     f"{results[k]['load_bytes_per_second'] / 1e9:.1f} GB/s"
                     if k in ("read", "write", "triad") else ""])
    table = show_table(
        ["beside fio", "fio (median)", "x fio alone", "rounds", "load's memory rate"], rows,
        title=(f"\nfio reading and writing {args.gb:g} GB at once (depth {args.depth} per "
               f"job or half, {args.block_size}), one thread of load beside it, "
               f"{args.rounds} rounds; the memory loads stream {args.big} arrays\n"))
    save(args.json, header, args=settings(args), results=results, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
