"""What `swap.durability: crash_consistent` costs per step, against scratch, in one run.

A synthetic fp32 model keeps its optimizer state on NVMe (and part of it in the
pinned host tier, which crash-consistent mode writes through every step). Each
mode runs in its own process; reported per mode: median step time of the steps
after the first, bytes written and read per step, the time of the commit
(every write landed + fdatasync + manifest), and the ratio crash/scratch.

Usage: python bench/durability.py [--params 250M] [--steps 4] [--host 512MiB]
                                  [--swap DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _harness import (add_phase_args, format_count, parse_count, parse_size, parser, ratio,
                      run_header, run_phase, save, serve_phase, show_table, stat_medians,
                      steady)
from pipeline import _model  # bench/pipeline.py: the same synthetic params

MODES = ("scratch", "crash_consistent")


def phase(args: argparse.Namespace) -> dict:
    """One mode, in this process: train `steps` steps and time them."""
    import torch

    import tiermem
    import tiermem.tiers.manager

    params = _model(args.params)
    opt = torch.optim.AdamW(params, lr=1e-3)
    cfg = {"swap": {"paths": [args.swap], "durability": args.phase},
           "tiers": {"host": {"capacity": args.host}},
           "pipeline": {"partition_size": args.partition_size, "buffer_count": args.buffers,
                        "prefetch_depth": args.buffers - 2},
           "optimizer": {"kernel": "fused"}}
    commit_s: list[float] = []
    real_commit = tiermem.tiers.manager.TierManager.commit

    def timed_commit(self, **kw):
        t = time.perf_counter()
        try:
            return real_commit(self, **kw)
        finally:
            commit_s.append(time.perf_counter() - t)
    tiermem.tiers.manager.TierManager.commit = timed_commit
    t0 = time.perf_counter()
    with tiermem.offload(opt, cfg) as tm:
        setup = time.perf_counter() - t0
        for _ in range(args.steps):
            opt.step()
        stats = tm.stats()
        plan = tm.plan()
        tm.discard()
    med = stat_medians(steady(stats), ("step_seconds", "write_bytes", "read_bytes"))
    return {"mode": args.phase, "setup_s": setup, "swap_bytes": plan["swap_bytes"],
            "step_s": med["step_seconds"], "write_bytes": med["write_bytes"],
            "read_bytes": med["read_bytes"],
            "commit_s": statistics.median(commit_s[2:]) if len(commit_s) > 2 else None}


def main(argv=None) -> int:
    ap = parser(__doc__, json_name="durability.json",
                quick={"params": "16M", "steps": 3, "host": "32MiB"})
    ap.add_argument("--params", type=parse_count, default="250M",
                    help="parameter count, e.g. 250M, 1B")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--host", default="512MiB", help="pinned host tier (written through "
                    "every step in crash-consistent mode)")
    ap.add_argument("--partition-size", default="128MiB", help="pipeline.partition_size")
    ap.add_argument("--buffers", type=int, default=8,
                    help="pipeline.buffer_count (prefetch depth: 2 fewer); at least 3")
    ap.add_argument("--swap-dir", "--swap", dest="swap",
                    default=str(Path.home() / ".cache/tiermem/bench-durability"))
    add_phase_args(ap)  # each mode runs in a child process of its own
    args = ap.parse_args(argv)
    parse_size(args.host)  # a bad size fails here, not in a child
    parse_size(args.partition_size)
    if args.buffers < 3:
        ap.error("--buffers: at least 3 (the prefetch depth is 2 fewer, at least 1)")
    if serve_phase(args, {mode: phase for mode in MODES}):
        return 0
    header = run_header("durability", argv)
    raw = sys.argv[1:] if argv is None else list(argv)
    results = {mode: run_phase(__file__, mode, raw) for mode in MODES}
    base = results["scratch"]["step_s"]
    rows = []
    for mode in MODES:
        r = results[mode]
        rows.append([mode, f"{r['setup_s']:.2f}", f"{r['step_s']:.2f}",
                     f"{ratio(r['step_s'], base):.2f}", f"{r['write_bytes'] / 1e9:.2f}",
                     f"{r['read_bytes'] / 1e9:.2f}",
                     "-" if r["commit_s"] is None else f"{r['commit_s']:.3f}",
                     f"{r['swap_bytes'] / 2**30:.1f}"])
    table = show_table(
        ["durability", "set-up s", "step s", "vs scratch", "written GB/step", "read GB/step",
         "commit s", "swap GiB"], rows,
        title=f"{format_count(args.params)} fp32 parameters, host tier {args.host}, rest on "
              f"NVMe ({args.swap}); {args.buffers} x {args.partition_size} buffers; median of "
              f"steps 2..{args.steps}")
    save(args.json, header, params=args.params, host=args.host, steps=args.steps,
         partition_size=args.partition_size, buffers=args.buffers,
         results=results, crash_over_scratch=ratio(results["crash_consistent"]["step_s"], base),
         table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
