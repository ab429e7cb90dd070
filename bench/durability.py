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
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import markdown_table, parse_size, write_json  # noqa: E402
from pipeline import _model  # noqa: E402  (bench/pipeline.py: the same synthetic params)

MODES = ("scratch", "crash_consistent")


def phase(args: argparse.Namespace) -> dict:
    """One mode, in this process: train `steps` steps and time them."""
    import torch

    import tiermem
    import tiermem.tiers.manager

    params = _model(args.params)
    opt = torch.optim.AdamW(params, lr=1e-3)
    cfg = {"swap": {"paths": [args.swap], "durability": args.mode},
           "tiers": {"host": {"capacity": args.host}},
           "pipeline": {"partition_size": "128MiB", "buffer_count": 8, "prefetch_depth": 6},
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
    later = stats[1:] or stats
    return {"mode": args.mode, "setup_s": setup, "swap_bytes": plan["swap_bytes"],
            "step_s": statistics.median(s["step_seconds"] for s in later),
            "write_bytes": statistics.median(sum(s["write_bytes"].values()) for s in later),
            "read_bytes": statistics.median(sum(s["read_bytes"].values()) for s in later),
            "commit_s": statistics.median(commit_s[2:]) if len(commit_s) > 2 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="250M", help="parameter count, e.g. 250M, 1B")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--host", default="512MiB", help="pinned host tier (written through "
                    "every step in crash-consistent mode)")
    ap.add_argument("--swap", default=str(Path.home() / ".cache/tiermem/bench-durability"))
    ap.add_argument("--json", default=str(HERE / "results" / "durability.json"))
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    parse_size(args.host)  # a bad size fails here, not in a child
    from tiermem.tools.cli import _count
    text, args.params = args.params, _count(args.params)
    if args.mode:
        print(json.dumps(phase(args)))
        return
    rows, results = [], {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--params", text,
               "--steps", str(args.steps), "--host", args.host, "--swap", args.swap]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results[mode] = r
    base = results["scratch"]["step_s"]
    for mode in MODES:
        r = results[mode]
        rows.append([mode, f"{r['setup_s']:.2f}", f"{r['step_s']:.2f}",
                     f"{r['step_s'] / base:.2f}", f"{r['write_bytes'] / 1e9:.2f}",
                     f"{r['read_bytes'] / 1e9:.2f}",
                     "-" if r["commit_s"] is None else f"{r['commit_s']:.3f}",
                     f"{r['swap_bytes'] / 2**30:.1f}"])
    print(f"{args.params / 1e6:g}M fp32 parameters, host tier {args.host}, rest on NVMe "
          f"({args.swap}); median of steps 2..{args.steps}")
    print(markdown_table(["durability", "set-up s", "step s", "vs scratch", "written GB/step",
                          "read GB/step", "commit s", "swap GiB"], rows))
    path = write_json(args.json, {"params": args.params, "host": args.host,
                                  "steps": args.steps, "results": results,
                                  "crash_over_scratch": results["crash_consistent"]["step_s"]
                                  / base})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
