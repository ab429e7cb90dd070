"""Sharded tiermem with 1 and 2 ranks on this machine, measured in one run.

A synthetic fp32 model (default 64M parameters, 512 MB of Adam moments) keeps all
its optimizer state on NVMe (host tier 0); ranks are spawned processes joined by
gloo, every rank's swap directory on the same disk (`--swap-dir/rank{rank}`).
Gradients are fixed synthetic tensors, reduce-scattered every step (the
default `distributed.grads`); updated weights are all-gathered. Per world size:

- step time (median of the steps after the first, the slowest rank);
- NVMe GB/s per rank and in total (bytes read + written per step / step time);
- communication time (packing + collectives, per rank) and the part spent waiting
  (exposed), in total and for the weight all-gather alone, and how many weight windows
  were launched while the update still ran;
- stall on NVMe reads;
- step(2 ranks) / step(1 rank), from the same run.

Usage: python bench/distributed.py [--params 64M] [--steps 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _harness import (format_count, parse_count, parser, ratio, run_header, save, settings,
                      show_table, stat_medians, steady)
from pipeline import _model

TENSOR_ELEMS = 1 << 22  # 4M-element parameters


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import tiermem

    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    params = _model(args.params, tensor_elems=TENSOR_ELEMS)  # as bench/pipeline.py's
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    cfg = {"swap": {"paths": [os.path.join(args.swap_dir, "rank{rank}")], "checksums": True},
           "io": {"backend": args.backend, "queue_depth": 32, "block_size": "1MiB"},
           "tiers": {"host": {"capacity": 0}},
           "pipeline": {"partition_size": args.partition_size, "buffer_count": 4,
                        "prefetch_depth": 2},
           "distributed": {"bucket_size": args.bucket_size}}
    walls = []
    with tiermem.offload(opt, cfg, name=f"bench-w{world}") as tm:
        tm.discard()
        for _ in range(args.steps):
            dist.barrier()  # every rank starts the step together: the wall is the step's
            t0 = time.perf_counter()
            opt.step()
            walls.append(time.perf_counter() - t0)
        stats = tm.stats()
        plan = tm.plan()
    out.put((rank, {"walls": walls, "stats": stats, "plan": plan}))
    out.close()
    out.join_thread()
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, args, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=args.timeout) for _ in range(world))
        for p in procs:
            p.join(timeout=60)
    return [got[r] for r in range(world)]


def summarise(ranks: list[dict]) -> dict:
    """Steady figures: the steps after the first, the slowest rank's wall per step."""
    wall = statistics.median(steady([max(step) for step in zip(*(r["walls"] for r in ranks))]))
    names = {"comm": "comm_seconds", "comm_wait": "comm_wait_seconds",
             "comm_bytes": "comm_bytes", "stall": "stall_seconds",
             "weights": "weights_seconds", "weights_wait": "weights_wait_seconds",
             "windows_early": "windows_early", "update": "update_seconds"}
    per_rank = []
    for r in ranks:
        stats = steady(r["stats"])
        # Bytes read and written in the same step, summed before the median.
        moved = statistics.median(sum(s["read_bytes"].values()) + sum(s["write_bytes"].values())
                                  for s in stats)
        med = stat_medians(stats, names.values())
        per_rank.append({"bytes": moved, "gbps": moved / wall / 1e9,
                         **{k: med[v] for k, v in names.items()},
                         "state_bytes": r["plan"]["state_bytes"]["nvme"]})
    return {"step": wall, "ranks": per_rank,
            "total_gbps": sum(p["bytes"] for p in per_rank) / wall / 1e9}


def main(argv=None) -> int:
    p = parser(__doc__, json_name="distributed.json", quick={"params": "8M", "steps": 3})
    p.add_argument("--params", type=parse_count, default="64M")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--swap-dir", default="/var/tmp/tiermem-bench-dist")
    p.add_argument("--backend", default="io_uring", choices=["io_uring", "threads"])
    p.add_argument("--partition-size", default="16MiB")
    p.add_argument("--bucket-size", default="16MiB")
    p.add_argument("--timeout", type=float, default=1200)
    args = p.parse_args(argv)
    header = run_header("distributed", argv)
    os.makedirs(args.swap_dir, mode=0o700, exist_ok=True)
    results = {}
    for world in (1, 2):
        results[world] = summarise(run_world(world, args))
        print(f"{world} rank(s): step {results[world]['step']:.2f} s", flush=True)
    one, two = results[1], results[2]
    rows = []
    for world, res in results.items():
        for r, pr in enumerate(res["ranks"]):
            rows.append([world, r, f"{res['step']:.2f}", f"{pr['state_bytes'] / 1e9:.2f}",
                         f"{pr['gbps']:.2f}", f"{res['total_gbps']:.2f}",
                         f"{pr['comm']:.2f}", f"{pr['comm_wait']:.2f}",
                         f"{pr['weights']:.2f}", f"{pr['weights_wait']:.2f}",
                         f"{pr['windows_early']:.0f}",
                         f"{pr['comm_bytes'] / 1e9:.2f}", f"{pr['stall']:.2f}",
                         f"{pr['update']:.2f}"])
    table = show_table(["ranks", "rank", "step s", "state GB", "NVMe GB/s (rank)",
                          "NVMe GB/s (total)", "comm s", "comm wait s", "weights s",
                          "weights wait s", "windows early", "comm GB",
                          "stall s", "update s"], rows, title=(
        f"\n{format_count(args.params)} fp32 parameters, all state on NVMe, one disk shared "
        f"by the ranks, {args.backend}, partitions {args.partition_size}\n"))
    two_over_one = ratio(two["step"], one["step"])
    # One NVMe drive per rank: each rank moves its half of the bytes at the bandwidth one
    # rank reached alone; communication and the update (per rank) stay as measured.
    per_rank_bytes = statistics.mean(pr["bytes"] for pr in two["ranks"])
    own_drive = per_rank_bytes / (one["total_gbps"] * 1e9)
    projected = max(own_drive, statistics.mean(pr["update"] for pr in two["ranks"])) + \
        statistics.mean(pr["comm"] for pr in two["ranks"])
    print(f"\nstep(2 ranks) / step(1 rank) = {two_over_one:.2f} on one shared disk "
          f"(total NVMe GB/s {one['total_gbps']:.2f} -> {two['total_gbps']:.2f})")
    print(f"with one drive per rank (each as fast as this one alone): NVMe time per rank "
          f"{own_drive:.2f} s (1 rank: {one['ranks'][0]['bytes'] / (one['total_gbps'] * 1e9):.2f}"
          f" s), so about {projected:.2f} s per step with this communication = "
          f"{projected / one['step']:.2f} x the 1-rank step")
    print()
    save(args.json, header, args=settings(args),
         results={str(k): v for k, v in results.items()}, ratio=two_over_one,
         projected_own_drive_step=projected, projected_own_drive_nvme_seconds=own_drive,
         table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
