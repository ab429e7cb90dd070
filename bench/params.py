"""A training iteration with the model's weights and grads on NVMe, against the I/O floor.

A synthetic model (tiermem.tools.synthetic, built on the meta device) trains with
parameters.offload: nvme and all optimizer state on NVMe. Per iteration (median
over --iters after one warm-up iteration, which also teaches the fetch order) the
script records the forward, backward and step times and the bytes the iteration
moved: parameter records (weights read for forward, backward and the step,
gradients written and read back, weights written back) and optimizer state read
and written. In the same run it measures the I/O floor of those bytes with fio
(a read job and a write job at once, the engine's block size and queue depth,
O_DIRECT io_uring, on files laid out first) after each of --rounds rounds of --iters
iterations, and sets each round's iterations against that round's floor (the disk
drifts by tens of percent within a minute; the ratio is the median over rounds), the
I/O engine alone moving them
(reads, then writes), and the same iteration in memory (plain AdamW with
fused=True, torch's fastest CPU AdamW; no tiermem). It reports iteration / max(I/O
floor, in-memory iteration) against the goal 1.2, and the iteration over the I/O floor
alone.

--overlap: the tiered iteration with pipeline.overlap_backward off (the step after
backward), on (each partition's update during backward, from the gradients backward
left in memory), or both in turn (the default); each against the floor of the bytes
it moved itself, and the plain one's too.

Usage: python bench/params.py [--params 50M --window 128MiB --threads 1 --rounds 3]
       [--overlap both|on|off] [--quick]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _harness import (add_pipeline_args, fio_layout, goal_text, offload_config, parse_count,
                      parse_size, parser, run_header, save, settings, show_table)
from pipeline import _fio_concurrent, fio_variants

GOAL = 1.2


def io_floor(args, read_bytes: int, write_bytes: int) -> float:
    """Seconds the engine takes to read then write these many bytes, in --block-size
    requests at --queue-depth, through one buffer of --partition-size."""
    from tiermem.io import IOEngine
    from tiermem.io.buffers import aligned_empty

    chunk = parse_size(args.partition_size)
    buf = aligned_empty(chunk)
    buf.fill_(1)
    eng = IOEngine(args.backend, args.queue_depth, parse_size(args.block_size))
    total = max(read_bytes, write_bytes, chunk)
    path = os.path.join(tempfile.mkdtemp(dir=args.swap_dir), "floor.bin")
    try:
        with eng.open(path, "w", direct="auto") as f:
            for off in range(0, total, chunk):  # lay the file down first (not timed)
                eng.write(f, buf, off).wait()
            os.fsync(f.fd)
            t0 = time.perf_counter()
            for kind, nbytes in (("read", read_bytes), ("write", write_bytes)):
                reqs = []
                for off in range(0, nbytes, chunk):
                    reqs.append(getattr(eng, kind)(f, buf, off % total))
                    if len(reqs) >= 4:
                        reqs.pop(0).wait()
                for r in reqs:
                    r.wait()
            return time.perf_counter() - t0
    finally:
        eng.close()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


PHASES = ("forward", "backward", "step")


def fio_floor(args, read_bytes: int, write_bytes: int) -> dict:
    """fio moving the iteration's bytes at the engine's block size (O_DIRECT, io_uring):
    a read job and a write job at once, each at the full queue depth and each at half
    of it; the faster is the floor. Both files are laid out first, so the writes
    overwrite in place as the records do (a write that extends a file is slower on ext4)
    and no job is timed while fio makes its file."""
    from io_vs_fio import HugePageReservation, pages_for

    d = os.path.join(args.swap_dir, "fio-floor")
    os.makedirs(d, exist_ok=True)
    files = [os.path.join(d, "read.bin"), os.path.join(d, "write.bin")]
    bs = parse_size(args.block_size)
    # fio moves whole blocks (and counts a job short of its size as failed): the bytes
    # rounded up to the block
    read_bytes, write_bytes = (-(-n // bs) * bs for n in (read_bytes, write_bytes))
    results = {}
    try:
        for f, n in zip(files, (read_bytes, write_bytes)):
            if n:
                fio_layout(f, n)
        need = 2 * pages_for(bs * args.queue_depth, 2 << 20) + 8
        with HugePageReservation(need) as pages:
            for name, depth in fio_variants(read_bytes, write_bytes,
                                            args.queue_depth).items():
                for attempt in range(3):
                    # the last fio's pages come back only once its ring is torn down
                    pages.ensure_available(need)
                    try:
                        r = _fio_concurrent(*map(Path, files), read_bytes, write_bytes, bs,
                                            depth)
                    except subprocess.CalledProcessError as exc:
                        # fio 3.33 can abort with --mem=mmaphuge before printing results
                        print(f"fio floor failed ({name}), try {attempt + 1} of 3: "
                              f"{str(exc.stderr or exc)[-200:]}", flush=True)
                        time.sleep(1.0)
                        continue
                    # a job that moved bytes in no time did not run (fio 3.33 sometimes
                    # reports one so): not a floor; run it again
                    if all(r["per_job_seconds"].get(k) for k, n in
                           (("read", read_bytes), ("write", write_bytes)) if n):
                        results[name] = r
                        break
    finally:
        for f in files:
            if os.path.exists(f):
                os.unlink(f)
        os.rmdir(d)
    if not results:
        raise RuntimeError("fio gave no complete run for the floor")
    best = min(results, key=lambda k: results[k]["seconds"])
    return {**results[best], "variant": best, "variants": results}


def run(args, offload: bool, overlap: bool = False) -> dict:
    """Per timed iteration (after the warm-up): its phases' seconds, and with `offload` the
    bytes it moved (parameter records and optimizer state apart, counted over the first
    round) and the tier's counters; `overlap`: pipeline.overlap_backward (the updates run
    during backward). With `offload`, --rounds rounds of --iters iterations, each followed
    by fio's floor of those bytes (the disk drifts by tens of percent within a minute, so
    each round's iterations are set against the floor measured right after them)."""
    import torch

    import tiermem
    from tiermem.tools.synthetic import build_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build_model(args.params, dtype=dtype, seed=0, meta=offload)
    # In memory, torch's fused CPU AdamW: the fastest plain torch has (its default, foreach,
    # takes several times as long and would make the in-memory bound a lenient one); the
    # tiered iteration runs the kernel --kernel names per partition.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not offload)
    gen = torch.Generator().manual_seed(0)

    def iteration() -> dict[str, float]:
        tokens = torch.randint(0, 1 << 30, (args.batch, args.seq), generator=gen)
        t0 = time.perf_counter()
        loss = model(tokens)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0}

    if not offload:
        iteration()
        return {"times": [iteration() for _ in range(args.iters)]}
    cfg = offload_config(args, pipeline={"overlap_backward": overlap})
    cfg["parameters"] = {"offload": "nvme", "prefetch": args.param_prefetch,
                         "window": args.window}
    n = args.iters
    rounds = []
    with tiermem.offload(opt, cfg, model=model, name="bench-params") as tm:
        tm.discard()
        iteration()  # learns the fetch order; the state records are built fresh
        for r in range(args.rounds):
            before = tm.param_stats()
            state0 = tm.stats()
            times = [iteration() for _ in range(n)]
            if r == 0:
                after = tm.param_stats()
                state = tm.stats()[len(state0):]
                moved = {
                    "param_read": (after["bytes_read"] - before["bytes_read"]) // n,
                    "param_written": (after["bytes_written"] - before["bytes_written"]) // n,
                    "state_read": sum(sum(s["read_bytes"].values()) for s in state) // n,
                    "state_written": sum(sum(s["write_bytes"].values()) for s in state) // n,
                }
                # .get: the same script measures a tree from before grads_held/grads_spilled
                counters = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in (
                    "fetches", "prefetched", "on_demand", "out_of_order", "evictions",
                    "grads_stored", "grads_held", "grads_spilled")}
                reads = moved["param_read"] + moved["state_read"]
                writes = moved["param_written"] + moved["state_written"]
            rounds.append({"times": times, "fio": fio_floor(args, reads, writes)})
        plan = tm.plan()
    weights = plan["parameters"]["weight_bytes"]
    return {"times": [t for r in rounds for t in r["times"]], "rounds": rounds, "moved": moved,
            "counters": counters, "weight_bytes": weights, "reads": reads, "writes": writes}


def main() -> None:
    p = parser(__doc__, json_name="params.json",
               quick={"params": "4M", "iters": 2, "rounds": 1, "window": "24MiB"})
    p.add_argument("--params", type=parse_count, default=parse_count("50M"))
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--window", default="128MiB", help="parameters.window")
    p.add_argument("--param-prefetch", type=int, default=2, help="parameters.prefetch")
    p.add_argument("--iters", type=int, default=3, help="timed iterations a round")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of --iters iterations, each followed by fio's floor")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default torch's); 1 on a machine shared with other "
                        "work, where spinning OpenMP threads cost the compute several times")
    p.add_argument("--overlap", choices=["off", "on", "both"], default="both",
                   help="pipeline.overlap_backward for the tiered iteration (both: each in turn)")
    add_pipeline_args(p, swap_dir=os.path.join(tempfile.gettempdir(), "tiermem-bench-params"),
                      # 4 MiB partitions: an update can start as soon as backward has
                      # finished a few layers. 32 buffers (128 MiB, half of what the
                      # shipped 4 x 64 MiB hold): the next step's reads fill them during
                      # forward, which reads only weights otherwise; 4 left most of the
                      # state to be read during backward, behind backward's own reads.
                      # Prefetch 8 (32 MiB, one I/O queue's worth, as the fill keeps in
                      # flight): the weight reads backward waits for queue behind that
                      # much; 16 measured 7-10% slower alternated in one sitting
                      partition_size="4MiB", buffers=32, prefetch=8,
                      kernels=["auto", "fused", "match", "native"])
    p.set_defaults(kernel="auto")  # what tiermem ships (native for AdamW on the CPU)
    args = p.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    os.makedirs(args.swap_dir, exist_ok=True)
    header = run_header("params")
    plain = run(args, offload=False)
    mem = {k: statistics.median(t[k] for t in plain["times"]) for k in (*PHASES, "total")}
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
    mib = 2 ** 20
    rows = [["in-memory iteration (plain AdamW, fused)", f"{mem['total']:.3g} s",
             ", ".join(f"{k} {mem[k]:.3g} s" for k in PHASES)]]
    results, notes, first_floor = {}, [], None
    for overlap in modes:
        name = "overlap" if overlap else "plain"
        tiered = run(args, offload=True, overlap=overlap)
        moved = tiered["moved"]
        reads, writes = tiered["reads"], tiered["writes"]
        engine = io_floor(args, reads, writes)
        med = {k: statistics.median(t[k] for t in tiered["times"]) for k in (*PHASES, "total")}
        per_round = [(statistics.median(t["total"] for t in r["times"]), r["fio"])
                     for r in tiered["rounds"]]
        ratios = [it_r / max(f["seconds"], mem["total"]) for it_r, f in per_round]
        alone = [it_r / f["seconds"] for it_r, f in per_round]
        round_floors = [f["seconds"] for _, f in per_round]
        floor = statistics.median(round_floors)
        fio = min((f for _, f in per_round), key=lambda f: abs(f["seconds"] - floor))
        first_floor = floor if first_floor is None else first_floor
        it = med["total"]
        ratio = statistics.median(ratios)
        what = ("step after backward" if not overlap else
                "pipeline.overlap_backward: updates during backward")
        how = "concurrent r+w" if reads and writes else ("writes" if writes else "reads")
        rows += [[f"I/O floor: fio, the {name} iteration's bytes ({how})",
                  f"{floor:.3g} s",
                  f"median of rounds {', '.join(f'{x:.3g}' for x in round_floors)}; read "
                  f"{reads / mib:.1f} MiB, write {writes / mib:.1f} MiB; {fio['variant']}, "
                  f"{fio['read_gbps']:.2f} / {fio['write_gbps']:.2f} GB/s"],
                 ["the I/O engine alone, same bytes (reads, then writes)", f"{engine:.3g} s", ""],
                 [f"iteration on NVMe, {what}", f"{it:.3g} s",
                  ", ".join(f"{k} {med[k]:.3g} s" for k in PHASES)
                  + f" (median of {len(tiered['times'])}; rounds "
                  + ", ".join(f"{x:.3g}" for x, _ in per_round) + ")"],
                 [f"{name} iteration / max(its I/O floor, in-memory)", f"{ratio:.2f}x",
                  f"median of rounds (min {min(ratios):.2f}, max {max(ratios):.2f}); "
                  + goal_text(ratio, GOAL)],
                 [f"{name} iteration / its I/O floor alone", f"{statistics.median(alone):.2f}x",
                  "median of rounds"]]
        if overlap and len(modes) > 1:
            rows.append(["overlap iteration / max(plain's I/O floor, in-memory)",
                         f"{it / max(first_floor, mem['total']):.2f}x",
                         "the floor of the bytes the plain iteration moves"])
        w = tiered["weight_bytes"]
        notes.append(f"{name}: bytes per iteration: " + ", ".join(
            f"{k} {v / mib:.1f} MiB" for k, v in moved.items())
            + (f" (weights {w / mib:.1f} MiB)" if w else ""))
        notes.append(f"{name}: parameter tier per iteration: " + ", ".join(
            f"{k} {v:g}" for k, v in tiered["counters"].items()))
        results[name] = dict(tiered=tiered["times"], moved=moved, counters=tiered["counters"],
                             weight_bytes=w, read_bytes=reads, write_bytes=writes,
                             io_floor=floor, fio=[f for _, f in per_round],
                             round_ratios=ratios, engine_floor=engine, ratio=ratio)
    table = show_table(["what", "seconds", "note"], rows,
                       title=f"{args.params:,} parameters, {args.dtype}, window {args.window}, "
                             f"prefetch {args.param_prefetch}, {args.backend} "
                             f"{'' if not args.threads else f'{args.threads} thread(s), '}"
                             f"qd {args.queue_depth} bs {args.block_size}")
    for line in notes:
        print(line)
    last = results["overlap" if modes[-1] else "plain"]
    save(args.json, header, settings=settings(args), table=table, plain=plain["times"],
         runs=results, ratio=last["ratio"], goal=GOAL)


if __name__ == "__main__":
    main()
