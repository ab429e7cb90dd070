"""Tiered SGD-momentum and Adagrad steps against their floors, measured in one run.

A synthetic fp32 model (default 300M parameters: 1.2 GB of weights, 1.2 GB of state
per optimizer) keeps all its optimizer state on NVMe (host tier 0). Per optimizer:

- tiermem step time (median of the steps after the first, which only writes);
- the I/O floor: fio reading and writing the same bytes as one step, concurrently,
  same block size and queue depth (bench/pipeline.py's floor);
- the compute floor: the plain optimizer's step with all state in memory, with the
  same implementation flags (--impl: torch's default for-loop, foreach, or fused);
- step / max(floors), goal <= 1.10.

Each phase runs in its own process so peak RSS and page cache are its own.
Usage: python bench/optimizers.py [--params 300M] [--steps 4] [--optimizers sgd,adagrad]
       [--impl fused] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from _harness import (add_phase_args, add_pipeline_args, goal_text, offload_config,
                      parse_count, parser, peak_rss, run_header, run_phase, save, serve_phase,
                      settings, show_table, stat_medians, steady, time_calls)
from pipeline import _model, phase_fio

OPTIMIZERS = {  # name -> (torch.optim class name, keyword arguments)
    "sgd": ("SGD", dict(lr=1e-3, momentum=0.9, weight_decay=1e-4)),
    "adagrad": ("Adagrad", dict(lr=1e-2, weight_decay=1e-4)),
    "rmsprop": ("RMSprop", dict(lr=1e-3, momentum=0.9, centered=True)),
}
IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _optimizer(args: argparse.Namespace, params):
    import torch

    cls_name, kw = OPTIMIZERS[args.optimizer]
    return getattr(torch.optim, cls_name)(params, **kw, **IMPLS[args.impl])


def phase_memory(args: argparse.Namespace) -> dict:
    """Compute floor: the plain optimizer with all state in RAM."""
    opt = _optimizer(args, _model(args.params))
    times = time_calls(opt.step, args.steps)["seconds"]
    return {"step_seconds": times, "steady": statistics.median(steady(times))}


def phase_tiermem(args: argparse.Namespace) -> dict:
    """The offloaded step, state on NVMe."""
    import tiermem

    params = _model(args.params)
    opt = _optimizer(args, params)
    with tiermem.offload(opt, offload_config(args), name=f"bench-opt-{args.optimizer}") as tm:
        plan = tm.plan()
        times = time_calls(opt.step, args.steps)["seconds"]
        stats = tm.stats()
        peak = peak_rss()
        tm.discard()
    med = stat_medians(steady(stats), ("read_bytes", "write_bytes", "stall_seconds",
                                       "update_seconds", "overlap"))
    return {"plan": plan, "step_seconds": times, "stats": stats,
            "state_bytes": plan["state_bytes"]["nvme"],
            "steady": statistics.median(steady(times)),
            "read_bytes": med["read_bytes"], "write_bytes": med["write_bytes"],
            "stall": med["stall_seconds"], "update": med["update_seconds"],
            "overlap": med["overlap"], "peak_rss": peak}


def _fio_floor(args: argparse.Namespace, tm: dict, tries: int = 3) -> dict:
    """pipeline.py's fio floor; fio at times reports a job that never ran (0 ms) on a busy
    machine: measured again rather than taken."""
    for attempt in range(tries):
        try:
            return phase_fio(args, int(tm["read_bytes"]), int(tm["write_bytes"]))
        except (ZeroDivisionError, subprocess.CalledProcessError) as exc:
            print(f"fio floor failed ({type(exc).__name__}), try {attempt + 2} of {tries}",
                  flush=True)
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, json_name="optimizers.json", quick={"params": "50M", "steps": 3})
    p.add_argument("--params", default="300M", help="parameter count, e.g. 300M")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--optimizers", default="sgd,adagrad",
                   help="comma list of " + ", ".join(OPTIMIZERS))
    p.add_argument("--optimizer", help=argparse.SUPPRESS)  # one phase's
    p.add_argument("--impl", choices=list(IMPLS), default="fused",
                   help="the optimizer's implementation flags, the same for tiermem and the "
                        "in-memory floor (default fused)")
    add_pipeline_args(p, swap_dir="/tmp/tiermem-bench-opt", partition_size="64MiB",
                      buffers=8, prefetch=4, kernels=("match", "fused"))
    p.set_defaults(kernel="match")
    add_phase_args(p)
    a = p.parse_args(argv)
    a.params_text, a.params = a.params, parse_count(a.params)
    a.optimizers = [o for o in a.optimizers.split(",") if o]
    for o in a.optimizers:
        if o not in OPTIMIZERS:
            p.error(f"--optimizers: {o!r} is not one of {', '.join(OPTIMIZERS)}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if serve_phase(args, {"memory": phase_memory, "tiermem": phase_tiermem}):
        return 0
    header = run_header("optimizers", argv)
    raw = sys.argv[1:] if argv is None else list(argv)
    os.makedirs(args.swap_dir, exist_ok=True)
    results, rows = {}, []
    try:
        for name in args.optimizers:
            tm = run_phase(__file__, "tiermem", raw + ["--optimizer", name])
            print(f"{name}: tiermem steps {[round(t, 3) for t in tm['step_seconds']]} s",
                  flush=True)
            mem = run_phase(__file__, "memory", raw + ["--optimizer", name])
            print(f"{name}: in-memory steps {[round(t, 3) for t in mem['step_seconds']]} s",
                  flush=True)
            fio = _fio_floor(args, tm)
            floor = max(fio["seconds"], mem["steady"])
            ratio = tm["steady"] / floor
            results[name] = {"tiermem": tm, "memory": mem, "fio": fio, "ratio": ratio}
            rows += [
                [f"{name}: tiermem step (NVMe)", f"{tm['steady']:.3f} s",
                 f"{(tm['read_bytes'] + tm['write_bytes']) / 1e9:.2f} GB moved, stall "
                 f"{tm['stall']:.3f} s, update {tm['update']:.3f} s, overlap "
                 f"{tm['overlap']:.2f}"],
                [f"{name}: I/O floor (fio r+w)", f"{fio['seconds']:.3f} s",
                 f"read {fio['read_gbps']:.2f} GB/s, write {fio['write_gbps']:.2f} GB/s"],
                [f"{name}: in-memory step ({args.impl})", f"{mem['steady']:.3f} s", ""],
                [f"{name}: step / max(floors)", f"{ratio:.3f}",
                 "goal <= 1.10: " + goal_text(ratio, 1.10)],
            ]
    finally:
        try:
            os.rmdir(args.swap_dir)
        except OSError:
            pass
    table = show_table(["what", "time", "detail"], rows, title=(
        f"\n{args.params_text} fp32 parameters, state on NVMe, {args.backend}, "
        f"bs {args.block_size}, qd {args.queue_depth}, partitions {args.partition_size}, "
        f"{args.buffers} buffers, prefetch {args.prefetch}\n"))
    print()
    save(args.json, header, args=settings(args), results=results,
         ratios={k: v["ratio"] for k, v in results.items()}, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
