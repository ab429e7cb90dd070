"""Simulated power losses of swap.durability: crash_consistent, the full set.

Uses the harness of tests/powerloss.py: each scenario trains a small model for
--steps steps while every write (at the I/O backend seam), sync and metadata
operation is recorded; then the run is "crashed" before every sync of the
set-up and of each step (and at the end), with --per-point disk images each
(none / all / a prefix of the unsynced operations, the last write torn, random
subsets with writes torn at 4 KiB). Every image is recovered (`tiermem
recover`) and resumed (`resume=True`) and judged bitwise against plain torch
AdamW (bf16 models with int8 moments and master_weights kahan/none, whose records
keep the bf16 weights: against an uninterrupted run of the same config). A bad recovery (a wrong state accepted, a committed step lost or
refused, recover and resume disagreeing, a non-tiermem exception) is a bug.

Then the mutation check: each sync site of the commit path switched off in
turn must make the harness report at least one bad recovery.

Usage: python bench/powerloss.py [--per-point 10] [--steps 4] [--seed 0]
                                 [--json out.json] [--quick]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _harness import markdown_table, parser, run_header, save  # noqa: E402


def scenarios(steps: int):
    from powerloss import Scenario
    from tiermem.io.engine import io_uring_status

    backends = ["threads"] + (["io_uring"] if io_uring_status()[0] else [])
    out = [Scenario(b, paths, dtype, "synthetic", steps)
           for b in backends for paths in (1, 2) for dtype in ("fp32", "bf16")]
    out += [Scenario(b, 1, "fp32", "overlap", steps) for b in backends]
    # a bf16 model with int8 moments whose records keep the bf16 weights (kahan / none)
    out += [Scenario(b, paths, "bf16", "synthetic", steps, master)
            for b in backends for paths, master in ((1, "kahan"), (2, "none"))]
    return out


def main() -> int:
    ap = parser(__doc__, json_name="powerloss.json", quick={"steps": 2, "per_point": 4})
    ap.add_argument("--per-point", type=int, default=10, help="crash images per crash point")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    header = run_header("powerloss")
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
        # fp32 state, and records holding the bf16 weights (kahan, int8 moments)
        for dtype, master in (("fp32", "fp32"), ("bf16", "kahan")):
            with tempfile.TemporaryDirectory(prefix="tiermem-powerloss-") as root:
                rep = powerloss(Scenario("threads", paths, dtype, steps=2, master=master),
                                root, per_point=args.per_point, seed=args.seed,
                                disabled=frozenset([site]))
            mutation.append({"site": site, "paths": paths, "master": master,
                             "images": rep.images, "bad": rep.bad, "detected": rep.bad > 0,
                             "first": rep.failures[:1]})
    print()
    print(markdown_table(["sync switched off", "swap paths", "master_weights", "power losses",
                          "bad", "detected"],
                         [[m["site"], m["paths"], m["master"], m["images"], m["bad"],
                           "yes" if m["detected"] else "NO"] for m in mutation]))
    sweep = manifest_sweep()
    print(f"\nmanifest sweep: {sweep['mutations']} single-field changes (every field x null, "
          f"delete, negate, path, list x damaged or re-checksummed): {sweep['refused']} refused, "
          f"{sweep['free']} free values, {sweep['accepted']} accepted, {sweep['raw']} raw "
          "exceptions")
    seconds = time.monotonic() - t0
    print(f"\n{total[1]} simulated power losses, {total[4]} bad recoveries; "
          f"{sum(m['detected'] for m in mutation)}/{len(mutation)} removed syncs detected; "
          f"{seconds:.0f} s")
    save(args.json, header, args=vars(args), scenarios=results, mutation=mutation,
         manifest_sweep=sweep, seconds=seconds)
    ok = sweep["accepted"] == sweep["raw"] == 0
    return 0 if ok and total[4] == 0 and all(m["detected"] for m in mutation) else 1


def manifest_sweep() -> dict:
    """Every field of a committed two-path run's manifest, one at a time, nulled, deleted,
    negated, replaced by a path or a list, written back damaged or re-checksummed: each must
    be refused by `tiermem recover` and by read_manifest with a TierMemError (tests/
    test_manifest_schema.py draws from the same space with hypothesis)."""
    import json

    from test_manifest_schema import Kept, free, nodes
    from tiermem.errors import TierMemError
    from tiermem.swap.manifest import encode, read_manifest
    from tiermem.swap.recover import gather

    out = {"mutations": 0, "refused": 0, "free": 0, "accepted": 0, "raw": 0, "examples": []}
    with tempfile.TemporaryDirectory(prefix="tiermem-manifest-") as root:
        kept = Kept(Path(root))
        body = kept.body
        for path in nodes(body):
            for op in ("null", "delete", "negate", "path", "list"):
                changed = json.loads(json.dumps(body))
                parent = changed
                for k in path[:-1]:
                    parent = parent[k]
                old = parent[path[-1]]
                if op == "negate" and (isinstance(old, bool) or
                                       not isinstance(old, (int, float))):
                    continue
                if op == "delete":
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = {"null": None, "negate": -old if op == "negate" else 0,
                                        "path": "/etc/passwd", "list": [0, "x"]}[op]
                if changed == body:
                    continue
                for crafted in (False, True):
                    ok_free = crafted and free(path, op)
                    raw = (encode(changed) if crafted and path != ("crc32c",)
                           else json.dumps(changed).encode())
                    kept.restore(raw)
                    out["mutations"] += 1
                    try:
                        gather(kept.run_dir)
                        read_manifest(kept.run_dir, None)
                    except TierMemError:
                        out["refused"] += 1
                        continue
                    except Exception as exc:  # noqa: BLE001 - a raw traceback is the finding
                        out["raw"] += 1
                        out["examples"].append(f"{path} {op} {crafted}: {exc!r}")
                        continue
                    out["free" if ok_free else "accepted"] += 1
                    if not ok_free:
                        out["examples"].append(f"{path} {op} {crafted}: accepted")
    return out


if __name__ == "__main__":
    sys.exit(main())
