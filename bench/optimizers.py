"""Tiered SGD-momentum and Adagrad steps against their floors, measured interleaved.

A synthetic fp32 model (default 300M parameters: 1.2 GB of weights, 1.2 GB of state
per optimizer) keeps all its optimizer state on NVMe (host tier 0). The disk and the
cores of a shared machine drift by tens of percent within a minute, so each optimizer
runs in one process that alternates, for --rounds rounds:

1. the I/O floor: fio moving exactly the bytes one steady tiermem step moved (its
   median read and write bytes, plus its share of the records whose write-back was
   deferred and which the flush ending each block writes), reading and writing
   concurrently (two jobs, io_uring, O_DIRECT, huge-page buffers, the engine's block
   size), tried at the engine's queue depth per job and at half of it per job (the
   engine's own total); the faster of the two is the floor. The read job reads a file
   written beforehand and the write job overwrites one, as a steady step rewrites
   records written the step before;
2. the compute floor: the plain optimizer's step over the same parameters with its
   state in memory and the same implementation flags (--impl: torch's default
   for-loop, foreach, or fused), median of --memory-steps;
3. the tiermem step: --steps steps back to back, timed from the first step's call until
   the last step's write-backs have landed, divided by --steps (every byte those steps
   move is inside the time; nothing of theirs is left in flight);
4. the I/O floor with the update beside it: fio again (as in 1, at the depth that won),
   and one step of the plain in-memory optimizer, on as many threads as the tiered
   update last ran on, started as soon as fio's transfers have begun
   (FioFloor.measure_beside). On this machine a thread streaming memory slows the disk
   (its emulation copies every byte through the host's memory), and a tiered step's
   update streams the same weights, gradients and state while its transfers run, so
   step / max(this floor, compute floor) is what the pipeline adds to what the disk
   gives a step that updates. The goal's ratio stays against the floor of 1.

Each round's ratio is its step / max(its I/O floor, its compute floor); the table gives
the median over rounds and their spread (goal <= 1.10). Each round also measures fio with
its read job paced to end when its write job does (FioFloor.measure_paced): the floor of a
run of steps, whose reads a bounded pipeline cannot let race ahead of its writes (this
disk gives concurrent reads and writes more when the reads end early); the table gives the
step against it too, beside the goal's ratio. Two warm-up steps come first
(the first only writes fresh records; the second gives the bytes of a steady step).

With --stand-in, each round also runs --steps steps whose update is a stand-in: it
sleeps as long as that round's real update took per partition and changes nothing (the
swap store hashes each record as it writes it, as for any update that returns no
CRC). The pipeline, the engine and the disk see the same transfers at the same pace,
without the update's memory traffic and CPU beside them, so stand-in step / I/O floor is
what the I/O path alone costs, and step / stand-in step what the update costs on top.
Then --steps more whose stand-in takes no time at all: the transfers with nothing to
compute, against which the sleeping stand-in's excess is the update time the step cannot
hide behind a transfer (its first update, before anything can be written, and its last,
after the last read).
The stand-in steps leave the optimizer state as it was (a bench only), and do not count
in the update-threads measurements.

The tiermem steps run with optimizer.update_threads --update-threads (default 0: auto,
which measures transfer-bound steps on every thread and on one fewer and keeps the faster;
tiermem/optim/threads.py); each round prints its steps' counts, the table the last of each
round.

Usage: python bench/optimizers.py [--params 300M] [--rounds 5] [--steps 3]
       [--optimizers sgd,adagrad] [--impl fused] [--update-threads 0] [--stand-in]
       [--write-back deferred]
       [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _harness import (add_phase_args, add_pipeline_args, goal_text, offload_config,
                      parse_count, parse_size, parser, peak_rss, run_header, run_phase, save,
                      serve_phase, settings, show_table, stat_medians, steady, time_calls)
from pipeline import FioFloor, _model

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


def _timed_block(fn, n: int, settle) -> float:
    """Wall seconds of n calls of fn and then settle() (what they left in flight)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    settle()
    return time.perf_counter() - t0


def _stand_in(seconds: float):
    """An OffloadedOptimizer._update that waits `seconds` and leaves the record alone
    (returns no CRC: the swap store hashes the record when it writes it)."""
    def update(part, views, stats):
        time.sleep(seconds)
        return None
    return update


def _plain_step(plain, threads: int):
    """One step of the in-memory optimizer on `threads` threads; returns its seconds."""
    import torch

    def work() -> float:
        kept = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            plain.step()
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(kept)
    return work


def phase_rounds(args: argparse.Namespace) -> dict:
    """One optimizer: the I/O floor, the compute floor and the tiermem step, interleaved
    round by round (the module docstring says what each is)."""
    import tiermem

    params = _model(args.params)
    opt = _optimizer(args, params)
    plain = _optimizer(args, params)  # same parameters, its own state, in memory
    plain.step()  # its state is allocated here, not in a timed step
    cfg = offload_config(args, pipeline={"write_back": args.write_back},
                         update_threads=args.update_threads)
    with tiermem.offload(opt, cfg, name=f"bench-opt-{args.optimizer}") as tm:
        plan = tm.plan()
        warm = time_calls(opt.step, 2)["seconds"]
        tiers = tm.offloaded.tiers
        # Records whose write-back is deferred (pipeline.write_back) are written by the
        # flush that ends each timed block: their bytes are the block's, shared by its steps.
        deferred = tiers.pipeline.deferred_bytes()
        tiers.flush()
        moved = stat_medians(steady(tm.stats()), ("read_bytes", "write_bytes"))
        moved["write_bytes"] += deferred / args.steps
        moved["deferred_bytes_per_block"] = deferred
        rounds = []
        with FioFloor(args.swap_dir, parse_size(args.block_size), args.queue_depth,
                      moved["read_bytes"], moved["write_bytes"]) as floor:
            for r in range(args.rounds):
                fio = floor.measure()
                paced = floor.measure_paced(fio)
                mem = time_calls(plain.step, args.memory_steps)["seconds"]
                first = len(tm.stats())
                block = _timed_block(opt.step, args.steps, tiers.flush)
                stats = tm.stats()[first:]
                step = block / args.steps
                floor_s = max(fio["seconds"], statistics.median(mem))
                # the update's own memory traffic beside fio's transfers, on as many
                # threads as the tiered update ran on last
                beside = floor.measure_beside(
                    fio, _plain_step(plain, stats[-1]["update_threads"]))
                rounds.append({
                    "fio": fio, "fio_paced": paced, "memory_step_seconds": mem,
                    "ratio_paced": step / max(paced["seconds"], statistics.median(mem)),
                    "fio_beside": beside,
                    "ratio_beside": step / max(beside["seconds"], statistics.median(mem)),
                    "memory": statistics.median(mem), "step": step,
                    "block_seconds": block, "stats": stats, "ratio": step / floor_s,
                    **stat_medians(stats, ("read_bytes", "write_bytes", "stall_seconds",
                                           "update_seconds", "io_seconds"))})
                extra = ""
                if args.stand_in:
                    per_part = rounds[-1]["update_seconds"] / max(
                        1, statistics.median(sum(s["partitions"].values()) for s in stats))
                    tm.offloaded._update = _stand_in(per_part)
                    # the stand-in's steps must not count in update_threads' measurements
                    policy, kept = tm.offloaded.threads, tm.offloaded.threads.setting
                    policy.setting = policy.count()
                    try:
                        first = len(tm.stats())
                        io_block = _timed_block(opt.step, args.steps, tiers.flush)
                        stand_in_stats = tm.stats()[first:]
                        # and with an update that takes no time: the transfers alone
                        tm.offloaded._update = _stand_in(0.0)
                        bare_block = _timed_block(opt.step, args.steps, tiers.flush)
                    finally:
                        del tm.offloaded._update  # the class's own method again
                        policy.setting = kept
                    io_step, bare_step = io_block / args.steps, bare_block / args.steps
                    rounds[-1].update(stand_in_step=io_step, stand_in_partition_seconds=per_part,
                                      stand_in_stats=stand_in_stats,
                                      stand_in_ratio=io_step / fio["seconds"],
                                      bare_step=bare_step,
                                      bare_ratio=bare_step / fio["seconds"])
                    extra = (f", stand-in update {io_step:.3f} s "
                             f"({io_step / fio['seconds']:.3f} x fio), no-time update "
                             f"{bare_step:.3f} s ({bare_step / fio['seconds']:.3f} x fio)")
                threads = [s["update_threads"] for s in stats]
                print(f"{args.optimizer} round {r + 1}: step {step:.3f} s, fio "
                      f"{fio['seconds']:.3f} s (reads paced {paced['seconds']:.3f} s, "
                      f"update beside {beside['seconds']:.3f} s), "
                      f"in-memory {statistics.median(mem):.3f} s, "
                      f"ratio {step / floor_s:.3f}, update threads {threads}{extra}",
                      flush=True)
        peak = peak_rss()
        tm.discard()
    med = {k: statistics.median(r[k] for r in rounds) for k in (
        "step", "memory", "ratio", "read_bytes", "write_bytes", "stall_seconds",
        "update_seconds", "io_seconds", "ratio_paced", "ratio_beside")}
    med["fio"] = statistics.median(r["fio"]["seconds"] for r in rounds)
    med["fio_paced"] = statistics.median(r["fio_paced"]["seconds"] for r in rounds)
    med["fio_beside"] = statistics.median(r["fio_beside"]["seconds"] for r in rounds)
    med["beside_slowdown"] = statistics.median(
        r["fio_beside"]["seconds"] / r["fio"]["seconds"] for r in rounds)
    if args.stand_in:
        for k in ("stand_in_step", "stand_in_ratio", "bare_step", "bare_ratio"):
            med[k] = statistics.median(r[k] for r in rounds)
        med["update_cost"] = statistics.median(r["step"] / r["stand_in_step"] for r in rounds)
    return {"plan": plan, "warmup_seconds": warm, "moved": moved, "rounds": rounds,
            "median": med, "ratios": [r["ratio"] for r in rounds], "peak_rss": peak,
            "state_bytes": plan["state_bytes"]["nvme"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, json_name="optimizers.json",
               quick={"params": "50M", "rounds": 2, "steps": 2})
    p.add_argument("--params", default="300M", help="parameter count, e.g. 300M")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of (I/O floor, compute floor, tiermem steps)")
    p.add_argument("--steps", type=int, default=3,
                   help="tiermem steps per round, back to back, timed until their writes land")
    p.add_argument("--memory-steps", type=int, default=2,
                   help="in-memory steps per round (their median is the compute floor)")
    p.add_argument("--optimizers", default="sgd,adagrad",
                   help="comma list of " + ", ".join(OPTIMIZERS))
    p.add_argument("--optimizer", help=argparse.SUPPRESS)  # one phase's
    p.add_argument("--impl", choices=list(IMPLS), default="fused",
                   help="the optimizer's implementation flags, the same for tiermem and the "
                        "in-memory floor (default fused)")
    p.add_argument("--write-back", default="deferred", choices=["deferred", "immediate"],
                   help="pipeline.write_back (default deferred, as shipped)")
    p.add_argument("--update-threads", type=int, default=0,
                   help="optimizer.update_threads (default 0: auto)")
    p.add_argument("--stand-in", action="store_true",
                   help="each round also times steps whose update is a stand-in that only "
                        "waits as long (what the I/O path alone costs)")
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
    for name in ("rounds", "steps", "memory_steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if serve_phase(args, {"rounds": phase_rounds}):
        return 0
    header = run_header("optimizers", argv)
    raw = sys.argv[1:] if argv is None else list(argv)
    os.makedirs(args.swap_dir, exist_ok=True)
    results, rows = {}, []
    try:
        for name in args.optimizers:
            res = run_phase(__file__, "rounds", raw + ["--optimizer", name])
            results[name] = res
            m, ratios = res["median"], res["ratios"]
            rows += [
                [f"{name}: tiermem step (NVMe)", f"{m['step']:.3f} s",
                 f"{(m['read_bytes'] + m['write_bytes']) / 1e9:.2f} GB moved, stall "
                 f"{m['stall_seconds']:.3f} s, update {m['update_seconds']:.3f} s, "
                 f"disk busy {m['io_seconds']:.3f} s, update threads "
                 + "/".join(str(r["stats"][-1]["update_threads"]) for r in res["rounds"])],
                [f"{name}: I/O floor (fio r+w)", f"{m['fio']:.3f} s",
                 "per round " + ", ".join(f"{r['fio']['seconds']:.3f}" for r in res["rounds"])],
                [f"{name}: in-memory step ({args.impl})", f"{m['memory']:.3f} s", ""],
                [f"{name}: step / max(floors)", f"{m['ratio']:.3f}",
                 f"median of {len(ratios)} rounds (min {min(ratios):.3f}, max "
                 f"{max(ratios):.3f}); goal <= 1.10: " + goal_text(m["ratio"], 1.10)],
                [f"{name}: I/O floor, reads paced", f"{m['fio_paced']:.3f} s",
                 "fio's reads paced to end with its writes: a run of steps' floor"],
                [f"{name}: step / max(paced, memory)", f"{m['ratio_paced']:.3f}",
                 "median of rounds: the step against what a run of steps can reach"],
                [f"{name}: I/O floor, update beside", f"{m['fio_beside']:.3f} s",
                 f"{m['beside_slowdown']:.3f} x fio (median of rounds): fio while one "
                 "in-memory step runs beside it"],
                [f"{name}: step / max(beside, memory)", f"{m['ratio_beside']:.3f}",
                 "median of rounds: the step against the disk it gets while it updates"],
            ]
            if args.stand_in:
                rows += [
                    [f"{name}: step, stand-in update", f"{m['stand_in_step']:.3f} s",
                     f"{m['stand_in_ratio']:.3f} x the I/O floor (median of rounds): the "
                     "I/O path alone"],
                    [f"{name}: step / stand-in step", f"{m['update_cost']:.3f}",
                     "median of rounds: what the update beside the transfers adds"],
                    [f"{name}: step, no-time update", f"{m['bare_step']:.3f} s",
                     f"{m['bare_ratio']:.3f} x the I/O floor (median of rounds): the "
                     "transfers with nothing to compute; the stand-in's excess over it "
                     "is the update time the step cannot hide (its first and last)"],
                ]
    finally:
        try:
            os.rmdir(args.swap_dir)
        except OSError:
            pass
    table = show_table(["what", "time (median)", "detail"], rows, title=(
        f"\n{args.params_text} fp32 parameters, state on NVMe, {args.backend}, "
        f"bs {args.block_size}, qd {args.queue_depth}, partitions {args.partition_size}, "
        f"{args.buffers} buffers, prefetch {args.prefetch}, write-back {args.write_back}; "
        f"{args.rounds} rounds of {args.steps} steps\n"))
    print()
    save(args.json, header, args=settings(args), results=results,
         ratios={k: v["median"]["ratio"] for k, v in results.items()}, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
