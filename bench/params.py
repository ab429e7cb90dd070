"""A training iteration with the model's weights and grads on NVMe, against the I/O floor.

A synthetic model (tiermem.tools.synthetic) trains with parameters.offload: nvme
and all optimizer state on NVMe. Per iteration (median over --iters after one
warm-up iteration, which also teaches the fetch order) the script records the
wall time and the bytes the iteration moved: weights read for forward and
backward, gradients written (and read back by the step), weights written back,
optimizer state read and written. In the same run it times the I/O engine
moving that many bytes alone (reads then writes of a scratch file, same block
size, queue depth and backend), and the same iteration in memory (plain AdamW,
no tiermem). It reports iteration / max(I/O floor, in-memory iteration) against
the goal 1.2.

Usage: python bench/params.py [--params 50M --dtype bf16 --window 64MiB] [--quick]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from _harness import (add_pipeline_args, goal_text, offload_config, parse_count,
                      parse_size, parser, run_header, save, settings, show_table)

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


def run(args, offload: bool) -> tuple[list[float], int, int]:
    """Iteration times (after the warm-up) and the bytes one timed iteration moved."""
    import torch

    import tiermem
    from tiermem.tools.synthetic import build_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build_model(args.params, dtype=dtype, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def iteration() -> None:
        tokens = torch.randint(0, 1 << 30, (args.batch, args.seq), generator=gen)
        model(tokens).backward()
        opt.step()
        opt.zero_grad()

    times: list[float] = []
    if not offload:
        for i in range(args.iters + 1):
            t0 = time.perf_counter()
            iteration()
            if i:
                times.append(time.perf_counter() - t0)
        return times, 0, 0
    cfg = offload_config(args)
    cfg["parameters"] = {"offload": "nvme", "prefetch": args.param_prefetch,
                         "window": args.window}
    with tiermem.offload(opt, cfg, model=model, name="bench-params") as tm:
        tm.discard()
        iteration()
        before = tm.param_stats()
        read0 = sum(sum(s["read_bytes"].values()) for s in tm.stats())
        write0 = sum(sum(s["write_bytes"].values()) for s in tm.stats())
        for _ in range(args.iters):
            t0 = time.perf_counter()
            iteration()
            times.append(time.perf_counter() - t0)
        after = tm.param_stats()
        stats = tm.stats()
        reads = (after["bytes_read"] - before["bytes_read"]
                 + sum(sum(s["read_bytes"].values()) for s in stats) - read0)
        writes = (after["bytes_written"] - before["bytes_written"]
                  + sum(sum(s["write_bytes"].values()) for s in stats) - write0)
    return times, reads // args.iters, writes // args.iters


def main() -> None:
    p = parser(__doc__, json_name="params.json",
               quick={"params": "4M", "iters": 2, "window": "24MiB"})
    p.add_argument("--params", type=parse_count, default=parse_count("50M"))
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--window", default="128MiB", help="parameters.window")
    p.add_argument("--param-prefetch", type=int, default=2, help="parameters.prefetch")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    add_pipeline_args(p, swap_dir=os.path.join(tempfile.gettempdir(), "tiermem-bench-params"),
                      partition_size="4MiB", buffers=4, prefetch=2,
                      kernels=["fused", "match", "native"])
    args = p.parse_args()
    os.makedirs(args.swap_dir, exist_ok=True)
    header = run_header("params")
    plain, _, _ = run(args, offload=False)
    tiered, reads, writes = run(args, offload=True)
    floor = io_floor(args, reads, writes)
    it, mem = statistics.median(tiered), statistics.median(plain)
    bound = max(floor, mem)
    rows = [["in-memory iteration (plain AdamW)", f"{mem:.3g} s", ""],
            ["I/O floor of the iteration's bytes", f"{floor:.3g} s",
             f"read {reads / 2**20:.1f} MiB, write {writes / 2**20:.1f} MiB"],
            ["iteration, weights+grads+state on NVMe", f"{it:.3g} s",
             f"{it / bound:.2f}x max(floor, in-memory): {goal_text(it / bound, GOAL)}"]]
    table = show_table(["what", "seconds", "note"], rows,
                       title=f"{args.params:,} parameters, {args.dtype}, window {args.window}")
    save(args.json, header, settings=settings(args), table=table, plain=plain, tiered=tiered,
         read_bytes=reads, write_bytes=writes, io_floor=floor, ratio=it / bound, goal=GOAL)


if __name__ == "__main__":
    main()
