"""Mixed reads and writes at once: the bare IOEngine against fio's two jobs.

Why: one optimizer step over NVMe moves reads and writes at the same time (bench/
optimizers.py at 300M: 10 reads and 18 writes of 64 MiB per step); pure reads or pure
writes match fio (bench/io_vs_fio.py), so this measures the engine on the mix alone, with
no pipeline and no update. Each round submits every read and every write to the engine at
once (reads first), waits for all of them, and times that; fio moves the same bytes as a
read job and a write job running together (the floor of bench/optimizers.py: one ring
each, at the engine's depth per job and at half of it, the faster counts). The engine
reads the file fio reads and overwrites the file fio writes (both laid out beforehand).

Each engine runs in a child process of its own, so `--trees` can put builds of two
checkouts side by side in one run (e.g. main and a branch): each child imports tiermem
from its tree, and the rounds alternate fio and every (tree, backend) pair, so the disk's
drift hits all alike. Reported per tool: median seconds and its ratio to fio's median;
per engine also when its last read and its last write landed.

With `--burn`, a thread of the measuring process (fio's parent, each engine child)
streams memory with torch the whole time a tool runs (an optimizer update's kind of load:
it reads and writes 256 MiB over and over), so the table shows how much the same transfers
slow down while a step computes next to them.

Usage: flock /tmp/tiermem-heavy.lock python3 bench/io_mixed.py [--rounds 9]
       [--reads 10 --writes 18 --size 64MiB] [--backends io_uring,threads]
       [--trees /work/main-build,.] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _harness import (REPO, Background, parse_size, parser, ratio_text, run_header, save,
                      settings, show_table)
from io_vs_fio import DeviceCounters
from pipeline import FioFloor

FIO = "fio r+w"


def _burner(on: bool) -> Background | contextlib.nullcontext:
    """With --burn, a thread reading and writing 256 MiB with torch, over and over, while
    open (an optimizer update's kind of load); without, nothing."""
    if not on:
        return contextlib.nullcontext()
    import torch

    buf = torch.ones(64 << 20)
    return Background(lambda: buf.mul_(1.0000001))


def serve(args: argparse.Namespace) -> None:
    """Child: engines on `args.tree`'s tiermem; one JSON line per request line on stdin."""
    sys.path.insert(0, args.serve)
    from tiermem.io import IOEngine
    from tiermem.io.buffers import aligned_empty

    size = parse_size(args.size)
    bufs = [aligned_empty(size) for _ in range(args.reads + args.writes)]
    for b in bufs:
        b.fill_(1)  # first touch here, not in a timed pass
    engines = {}
    for backend in args.backends:
        eng = IOEngine(backend=backend, queue_depth=args.queue_depth,
                       block_size=parse_size(args.block_size))
        eng.register_buffers(bufs)
        engines[backend] = (eng, eng.open(args.rfile, "r+"), eng.open(args.wfile, "r+"))
    disk = DeviceCounters(Path(args.rfile).parent)
    print(json.dumps({"ready": True, "pages": bufs[0].tiermem_info.pages}), flush=True)
    for line in sys.stdin:
        eng, rf, wf = engines[line.strip()]
        before = disk.read()
        with _burner(args.burn):
            t0 = time.monotonic()
            reqs = [eng.read(rf, bufs[i], i * size) for i in range(args.reads)]
            reqs += [eng.write(wf, bufs[args.reads + i], i * size) for i in range(args.writes)]
            for r in reqs:
                r.wait()
            t1 = time.monotonic()
        after = disk.read()
        last = {op: max(r.interval()[1] for r in reqs if r.op == op) - t0
                for op in ("read", "write")}
        print(json.dumps({"seconds": t1 - t0, "last_read": last["read"],
                          "last_write": last["write"], "disk": disk_summary(before, after)}),
              flush=True)
    for eng, _, _ in engines.values():
        eng.close()


def disk_summary(before, after) -> dict:
    """The disk's own view of a pass: requests in flight while busy, KiB per request."""
    out = {}
    for op in ("read", "write"):
        queue, kib = DeviceCounters.summary(before, after, op)
        out[f"{op}_kib"] = kib
        out["queue"] = queue
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, json_name="io_mixed.json",
               quick={"rounds": 2, "reads": 2, "writes": 3, "size": "16MiB"})
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reads", type=int, default=10, help="reads per round")
    p.add_argument("--writes", type=int, default=18, help="writes per round")
    p.add_argument("--size", default="64MiB", help="bytes per read or write")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--block-size", default="1MiB")
    p.add_argument("--backends", default="io_uring,threads")
    p.add_argument("--trees", default=str(REPO),
                   help="comma list of checkouts (built in place) whose engines to run")
    p.add_argument("--burn", action="store_true",
                   help="stream memory on one thread while each tool runs (see above)")
    p.add_argument("--dir", default="/tmp/tiermem-io-mixed", help="where the files go")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--rfile", help=argparse.SUPPRESS)
    p.add_argument("--wfile", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.backends = [b for b in a.backends.split(",") if b]
    a.trees = [os.path.abspath(t) for t in a.trees.split(",") if t]
    for t in a.trees:
        if not os.path.isdir(os.path.join(t, "tiermem")):
            p.error(f"--trees: {t} is no tiermem checkout (no tiermem/ in it)")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    header = run_header("io_mixed", argv)
    size = parse_size(args.size)
    raw = [a for a in (sys.argv[1:] if argv is None else list(argv))]
    names = {t: (Path(t).name if len(args.trees) > 1 else "") for t in args.trees}
    times: dict[str, list[dict]] = {FIO: []}
    os.makedirs(args.dir, exist_ok=True)
    children = {}
    try:
        with FioFloor(args.dir, parse_size(args.block_size), args.queue_depth,
                      args.reads * size, args.writes * size) as floor:
            for tree in args.trees:
                child = subprocess.Popen(
                    [sys.executable, __file__, *raw, "--serve", tree, "--rfile",
                     str(floor.rfile), "--wfile", str(floor.wfile)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                ready = json.loads(child.stdout.readline())
                print(f"{tree}: engine buffers on {ready['pages']} pages", flush=True)
                children[tree] = child
            disk = DeviceCounters(floor.dir)
            for r in range(args.rounds):
                before = disk.read()
                with _burner(args.burn):
                    fio = floor.measure()
                times[FIO].append({"seconds": fio["seconds"], "detail": fio,
                                   "disk": disk_summary(before, disk.read())})
                line = [f"round {r + 1}: fio {fio['seconds']:.3f} s"]
                for tree, child in children.items():
                    for backend in args.backends:
                        child.stdin.write(backend + "\n")
                        child.stdin.flush()
                        got = json.loads(child.stdout.readline())
                        tool = f"{names[tree]} {backend}".strip()
                        times.setdefault(tool, []).append(got)
                        line.append(f"{tool} {got['seconds']:.3f} s")
                print(", ".join(line), flush=True)
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait()
        try:
            os.rmdir(args.dir)
        except OSError:
            pass
    fio_med = statistics.median(t["seconds"] for t in times[FIO])
    rows = []
    for tool, ts in times.items():
        med = statistics.median(t["seconds"] for t in ts)
        detail = ", ".join(f"{t['seconds']:.3f}" for t in ts)
        d = {k: statistics.median(t["disk"][k] or 0 for t in ts) for k in ts[0]["disk"]}
        detail = (f"disk: {d['read_kib']:.0f}/{d['write_kib']:.0f} KiB per read/write, "
                  f"queue {d['queue']:.1f}; ") + detail
        if tool != FIO:
            detail = (f"last read {statistics.median(t['last_read'] for t in ts):.3f} s, last "
                      f"write {statistics.median(t['last_write'] for t in ts):.3f} s; " + detail)
        rows.append([tool, f"{med:.3f} s", ratio_text(med, fio_med), detail])
    total = (args.reads + args.writes) * size
    table = show_table(["tool", "median", "x fio", "per round"], rows, title=(
        f"\n{args.reads} reads + {args.writes} writes of {args.size} at once "
        f"({total / 1e9:.2f} GB){', memory streamed meanwhile' if args.burn else ''}, qd {args.queue_depth}, bs {args.block_size}; "
        f"{args.rounds} rounds\n"))
    save(args.json, header, args=settings(args), times=times, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
