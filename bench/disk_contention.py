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
from pathlib import Path
from typing import Any, Callable

from _harness import (Background, parse_size, parser, run_header, save, settings,
                      show_table)
from pipeline import FioFloor

LOADS = ("none", "spin", "in cache", "read", "write", "triad")


def _work(kind: str, big: int) -> tuple[Callable[[], Any], int]:
    """One call of `kind`'s load, and the bytes of memory that call streams (0: none)."""
    import torch

    if kind == "spin":
        def spin() -> None:
            x = 0
            for i in range(100_000):
                x += i
        return spin, 0
    if kind == "in cache":
        a, b = torch.ones(16 << 10), torch.ones(16 << 10)

        def in_cache() -> None:
            for _ in range(1000):
                a.add_(b)
        return in_cache, 0
    a = torch.ones(big // 4)
    if kind == "read":
        return a.sum, a.nbytes
    if kind == "write":
        return lambda: a.fill_(1.0), a.nbytes
    b = torch.ones_like(a)  # triad: read a and b, write a
    return lambda: a.add_(b, alpha=0.5), 3 * a.nbytes


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
    # Each load's arrays made once, not every round: a fresh array's first touch is slow.
    works = {k: _work(k, big) for k in LOADS if k != "none"}
    with FioFloor(args.swap_dir, bs, args.depth, nbytes, nbytes) as floor:
        floor.measure()  # a first run warms the files and the huge-page pool
        for r in range(args.rounds):
            order = LOADS if r % 2 == 0 else LOADS[::-1]
            for kind in order:
                rate = 0.0
                if kind == "none":
                    got = floor.measure()
                else:
                    work, streamed = works[kind]
                    with Background(work, warm=0.3) as load:  # at its pace before fio starts
                        got = floor.measure()
                    rate = streamed * load.calls / load.seconds
                seconds[kind].append(got["seconds"])
                rates[kind].append(rate)
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
