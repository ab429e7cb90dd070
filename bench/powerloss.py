"""Simulated power losses of swap.durability: crash_consistent, the full set.

Uses the harness of tests/powerloss.py: each scenario trains a small model for
--steps steps while every write (at the I/O backend seam), sync and metadata
operation is recorded; then the run is "crashed" before every sync of the
set-up and of each step (and at the end), with --per-point disk images each
(none / all / a prefix of the unsynced operations, the last write torn, random
subsets with writes torn at 4 KiB). Every image is recovered (`tiermem
recover`) and resumed (`resume=True`) and judged bitwise against plain torch
AdamW. A bad recovery (a wrong state accepted, a committed step lost or
refused, recover and resume disagreeing, a non-tiermem exception) is a bug.

Then the mutation check: each sync site of the commit path switched off in
turn must make the harness report at least one bad recovery.

Usage: python bench/powerloss.py [--per-point 10] [--steps 4] [--seed 0]
                                 [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _report import machine_facts, markdown_table, write_json  # noqa: E402


def scenarios(steps: int):
    from powerloss import Scenario
    from tiermem.io.engine import io_uring_status

    backends = ["threads"] + (["io_uring"] if io_uring_status()[0] else [])
    out = [Scenario(b, paths, dtype, "synthetic", steps)
           for b in backends for paths in (1, 2) for dtype in ("fp32", "bf16")]
    out += [Scenario(b, 1, "fp32", "overlap", steps) for b in backends]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-point", type=int, default=10, help="crash images per crash point")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="2 steps, 4 images per point")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.per_point = 2, 4
    from powerloss import Scenario, powerloss
    from tiermem.swap.fsops import SITES

    t0 = time.monotonic()
    rows, results = [], []
    for i, s in enumerate(scenarios(args.steps)):
        with tempfile.TemporaryDirectory(prefix="tiermem-powerloss-") as root:
            rep = powerloss(s, root, per_point=args.per_point, seed=args.seed + i)
        rows.append([rep.scenario, rep.points, rep.images, rep.exact, rep.refused, rep.bad,
                     f"{rep.seconds:.1f}"])
        results.append(vars(rep))
        print(f"{rep.scenario}: {rep.images} power losses, {rep.bad} bad", flush=True)
        for f in rep.failures[:5]:
            print("  BAD", f, flush=True)
    total = [sum(r[k] for r in results) for k in ("points", "images", "exact", "refused", "bad")]
    rows.append(["total", *total, f"{time.monotonic() - t0:.1f}"])
    headers = ["scenario", "crash points", "power losses", "exact", "refused", "bad", "s"]
    print()
    print(markdown_table(headers, rows))

    mutation = []
    for site in SITES:
        if site == "resident.fsync":
            continue  # scratch mode's keep-on-disk, not a commit
        paths = 2 if site == "swap.create.dirsync" else 1
        with tempfile.TemporaryDirectory(prefix="tiermem-powerloss-") as root:
            rep = powerloss(Scenario("threads", paths, "fp32", steps=2), root,
                            per_point=args.per_point, seed=args.seed,
                            disabled=frozenset([site]))
        mutation.append({"site": site, "paths": paths, "images": rep.images, "bad": rep.bad,
                         "detected": rep.bad > 0, "first": rep.failures[:1]})
    print()
    print(markdown_table(["sync switched off", "swap paths", "power losses", "bad",
                          "detected"],
                         [[m["site"], m["paths"], m["images"], m["bad"],
                           "yes" if m["detected"] else "NO"] for m in mutation]))
    seconds = time.monotonic() - t0
    print(f"\n{total[1]} simulated power losses, {total[4]} bad recoveries; "
          f"{sum(m['detected'] for m in mutation)}/{len(mutation)} removed syncs detected; "
          f"{seconds:.0f} s")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine_facts(),
                               "scenarios": results, "mutation": mutation,
                               "seconds": seconds})
    return 0 if total[4] == 0 and all(m["detected"] for m in mutation) else 1


if __name__ == "__main__":
    sys.exit(main())
