"""A training iteration with the update overlapped with backward, against its floors.

A transformer-like synthetic model (embedding, N blocks of attention and MLP
Linear layers, an untied output head; fp32 or bf16, on the CPU or with
`--device cuda` on a GPU, whose state is then updated on the host or, with
`--step-device device`, streamed through the GPU) keeps all its optimizer state
on NVMe. One process measures, in rounds so that a slow spell
of the machine hits every variant alike, the per-iteration median of:

- fwd+bwd alone (zero_grad, forward, backward: no update);
- plain in-memory AdamW (fused=True): fwd+bwd+step;
- the tiermem step alone, back to back with gradients in place: update + I/O;
- tiermem without overlap: fwd+bwd+step;
- tiermem with pipeline.overlap_backward: fwd+bwd+step, the update running
  during backward, each timed iteration paired with a fwd+bwd alone timed just
  before it (the machine's speed drifts by 10-20% within seconds; the ratio is
  the median over the pairs);
- fwd+bwd beside fio moving the overlapped step's bytes at the overlapped
  iteration's rate, each paired with a fwd+bwd alone just before it (needs
  fio): what the disk traffic alone costs the computation (on a virtual
  machine the host copies every block into or out of guest memory);
- the same with all state in host memory (no I/O, no checksums): what
  overlapping costs on these cores when the update is nothing but Adam, the
  reference for how much of the gap is the update's own CPU work.

and reports overlap / max(fwd+bwd, update+I/O) against the goal 1.15, and beside
it the CPU floor: the CPU seconds (all threads) of fwd+bwd and of the step alone
spread over the machine's cores. When backward keeps every core busy, the update's
own CPU work has to come out of backward's time and that floor is the bound;
`--threads 1` leaves a core to tiermem, as a GPU backward leaves the host. Size
the model (--dim, --layers) and the batch (--batch, --seq) so that the two
floors are comparable on your machine, or pass `--batch auto`: the step alone is
timed first, then the batch doubles from 1 until fwd+bwd takes at least as long (on
a GPU, where the right batch is not known in advance). --trace writes a Perfetto
trace of the overlapped iterations (docs/guide/tracing.md).

Usage: python bench/train_loop.py [--dim 1024 --layers 8 --tokens 2x64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _disk_load import DiskLoad, have_fio
from _harness import (add_pipeline_args, goal_text, median_over_rounds, offload_config,
                      paired, parse_size, parser, run_header, save, settings, show_table,
                      stat_medians, time_calls)

GOAL = 1.15


def build_model(args: argparse.Namespace):
    """Embedding -> `layers` pre-norm blocks (causal self-attention, 4x GELU MLP) -> head."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads
                                                  ).transpose(1, 3).unbind(2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(args.vocab, args.dim)
            self.blocks = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.layers))
            self.ln = nn.LayerNorm(args.dim)
            self.head = nn.Linear(args.dim, args.vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    model = Model()
    return model.to(torch.bfloat16) if args.dtype == "bf16" else model


class Loop:
    """One model and a fixed batch; each variant is a fresh optimizer over it."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.device = torch.device(args.device)
        self.model = build_model(args).to(self.device)
        self.set_batch(1 if args.batch == "auto" else int(args.batch))
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def set_batch(self, batch: int) -> None:
        import torch

        self.batch = batch
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, self.args.vocab, (batch, self.args.seq + 1),
                                    generator=g).to(self.device)

    def sync(self) -> None:
        """Wait for the GPU's queued work, so that a timer read next covers it (a no-op on
        the CPU, whose ops return finished)."""
        if self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)

    def fwd_bwd(self) -> None:
        import torch.nn.functional as F

        self.model.zero_grad(set_to_none=True)
        x, y = self.tokens[:, :-1], self.tokens[:, 1:]
        logits = self.model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        # As a loop reading its loss would: step() then starts after backward's kernels.
        self.sync()

    def optimizer(self, **kw):
        import torch

        return torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.1, **kw)

    def config(self, overlap: bool, host: int = 0) -> dict:
        return offload_config(self.args, host=host, pipeline={"overlap_backward": overlap},
                              step_device=self.args.step_device)

    # -- variants: each returns per-iteration seconds (warm-up dropped) ------------

    def run_fwd_bwd(self, n: int) -> dict:
        return time_calls(self.fwd_bwd, n, self.args.warmup)

    def run_fwd_bwd_io(self, n: int, load: DiskLoad, read_bps: float,
                       write_bps: float) -> dict:
        """n pairs of (fwd+bwd alone, fwd+bwd while fio reads and writes at these rates)."""
        alone, seconds = [], []
        for _ in range(n):
            alone.append(time_calls(self.fwd_bwd, 1)["seconds"][0])
            with load.running(read_bps, write_bps):
                seconds.append(time_calls(self.fwd_bwd, 1)["seconds"][0])
        return {"seconds": seconds, "alone": alone, "fio": load.moved[-n:],
                "asked_gbps": [read_bps / 1e9, write_bps / 1e9]}

    def run_plain(self, n: int) -> dict:
        opt = self.optimizer(fused=True)

        def it():
            self.fwd_bwd()
            opt.step()
            self.sync()  # a CUDA step returns with its kernels queued
        out = time_calls(it, n, self.args.warmup)
        opt.state.clear()
        return out

    def run_tiermem(self, n: int, *, overlap: bool, step_only: bool = False,
                    trace: str | None = None, in_host: bool = False) -> dict:
        import tiermem

        opt = self.optimizer()
        split = []  # (fwd+bwd, step) seconds of each iteration
        # in_host: room for every record in the host tier. A record is 8 B/param for a CPU
        # fp32 model, 12 with an fp32 master (a CUDA or bf16 model), plus footer and
        # alignment per partition; the capacity is a cap, not an allocation.
        host = 24 * self.n_params if in_host else 0
        with tiermem.offload(opt, self.config(overlap, host), model=self.model,
                             name="bench-train-loop") as tm:
            if trace:
                tm.record_events()

            def it():
                t0 = time.perf_counter()
                self.fwd_bwd()
                t1 = time.perf_counter()
                opt.step()
                self.sync()
                split.append((t1 - t0, time.perf_counter() - t1))

            if step_only:
                self.fwd_bwd()  # gradients in place; the step alone, back to back
                out = time_calls(lambda: (opt.step(), self.sync()), n, self.args.warmup)
            elif overlap:
                out = self._paired(n, tm, it)
            else:
                out = time_calls(it, n, self.args.warmup)
            stats = tm.stats()[self.args.warmup:]
            if trace:
                from tiermem.telemetry.trace import write_chrome_trace
                write_chrome_trace(trace, tm.events())
            plan = tm.plan()
            tm.discard()
        # The timed iterations': paired runs time every second one after the warm-up.
        steady = split[self.args.warmup + 1::2] if overlap and not step_only else (
            split[self.args.warmup:])
        med = stat_medians(stats, ("read_bytes", "write_bytes", "update_seconds",
                                   "stall_seconds", "io_seconds", "early_partitions"))
        out.update(
            plan=plan, read_bytes=med["read_bytes"], write_bytes=med["write_bytes"],
            update=med["update_seconds"], stall=med["stall_seconds"], io=med["io_seconds"],
            early=med["early_partitions"], partitions=plan["partitions"],
            fwd_bwd_part=statistics.median(a for a, _ in steady) if steady else None,
            step_part=statistics.median(b for _, b in steady) if steady else None)
        return out

    def _paired(self, n: int, tm, it) -> dict:
        """n pairs of (fwd+bwd alone, one overlapped iteration), seconds apart, so that each
        ratio compares figures of the same moment on a machine whose speed drifts.

        fwd+bwd alone runs inside tm.accumulating() (no update starts) once tm.stats() has
        waited for the worker and every write: nothing of tiermem runs under it. Then two
        overlapped iterations: the first picks up where the wait left the pipeline, the
        second, timed, is the steady state: its forward runs under the run-ahead reads of
        the first's step(), as in a training loop."""
        for _ in range(self.args.warmup):
            it()
        alone, seconds, cpu = [], [], []
        for _ in range(n):
            tm.stats()  # waits for the worker and the last write-backs
            t0 = time.perf_counter()
            with tm.accumulating():
                self.fwd_bwd()
            alone.append(time.perf_counter() - t0)
            it()
            t0, c0 = time.perf_counter(), time.process_time()
            it()
            seconds.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return {"seconds": seconds, "cpu_seconds": cpu, "alone": alone}


VARIANTS = ("fwd_bwd", "plain", "step_only", "no_overlap", "overlap", "fwd_bwd_io",
            "overlap_host")


def _batch(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive count or auto")
    return text


def auto_batch(loop: Loop, args: argparse.Namespace, most: int = 4096) -> dict:
    """Double the batch from 1 until fwd+bwd takes at least as long as the step alone
    (timed once here), so that neither side of max(fwd+bwd, update+I/O) is negligible.
    Where a batch runs out of GPU memory, the last one that fit is kept."""
    import torch

    step = statistics.median(loop.run_tiermem(args.iters, overlap=False,
                                              step_only=True)["seconds"])
    tried: dict[int, float] = {}
    batch = 1
    while True:
        loop.set_batch(batch)
        try:
            tried[batch] = statistics.median(loop.run_fwd_bwd(max(2, args.iters))["seconds"])
        except torch.cuda.OutOfMemoryError:
            loop.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if batch == 1:
                raise SystemExit("--batch auto: a batch of 1 does not fit on the GPU") from None
            batch //= 2
            break
        if tried[batch] >= step or batch >= most:
            break
        batch *= 2
    loop.set_batch(batch)
    print(f"--batch auto: step alone {step:.3f} s; fwd+bwd "
          + ", ".join(f"batch {b} {t:.3f} s" for b, t in tried.items()) + f" -> batch {batch}",
          flush=True)
    return {"step_seconds": step, "fwd_bwd_seconds": tried, "batch": batch}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, json_name="train_loop.json", quick={
        "dim": 512, "layers": 4, "vocab": 4096, "partition_size": "8MiB", "iters": 2,
        "rounds": 2})
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", default="2", type=_batch,
                   help="sequences per batch, or auto: the smallest power of two whose "
                        "fwd+bwd takes at least as long as the step alone")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model, forward and backward run")
    p.add_argument("--step-device", choices=["cpu", "device"], default="cpu",
                   help="optimizer.step_device: update a CUDA model's records on the host "
                        "(ZeRO-Offload) or streamed through the GPU")
    p.add_argument("--iters", type=int, default=4, help="timed iterations per variant and round")
    p.add_argument("--warmup", type=int, default=2,
                   help="iterations dropped per variant and round (the first step only writes)")
    p.add_argument("--rounds", type=int, default=2)
    add_pipeline_args(p, swap_dir="/var/tmp/tiermem-train-loop", partition_size="32MiB",
                      buffers=8, prefetch=3, kernels=("fused", "native", "match"))
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default, one per core)")
    p.add_argument("--only", default="",
                   help="comma-separated variants to run (default all); step_only and "
                        "overlap are needed for the ratio")
    p.add_argument("--trace", help="write a Perfetto trace of the overlapped iterations here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    header = run_header("train_loop", argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    Path(args.swap_dir).mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    loop = Loop(args)
    sizing = auto_batch(loop, args) if args.batch == "auto" else None
    variants = [v for v in VARIANTS if not args.only or v in args.only.split(",")]
    load = None
    if "fwd_bwd_io" in variants:
        if "overlap" not in variants or not have_fio():
            print("fwd_bwd_io skipped: it needs fio and the overlap variant (its rates)")
            variants.remove("fwd_bwd_io")
        else:
            load = DiskLoad(args.swap_dir, block_size=parse_size(args.block_size))
            load.prepare()
    runs: dict[str, list[dict]] = {v: [] for v in variants}

    def io_rates() -> tuple[float, float]:
        """Bytes per second of the latest round's overlapped iterations, read and written."""
        o = runs["overlap"][-1]
        it = statistics.median(o["seconds"])
        return o["read_bytes"] / it, o["write_bytes"] / it

    try:
        for r in range(args.rounds):
            last = r == args.rounds - 1
            run = {"fwd_bwd": lambda: loop.run_fwd_bwd(args.iters),
                   "plain": lambda: loop.run_plain(args.iters),
                   "step_only": lambda: loop.run_tiermem(args.iters, overlap=False, step_only=True),
                   "no_overlap": lambda: loop.run_tiermem(args.iters, overlap=False),
                   "overlap": lambda: loop.run_tiermem(args.iters, overlap=True,
                                                       trace=args.trace if last else None),
                   "fwd_bwd_io": lambda: loop.run_fwd_bwd_io(args.iters, load, *io_rates()),
                   "overlap_host": lambda: loop.run_tiermem(args.iters, overlap=True, in_host=True)}
            for v in variants:
                runs[v].append(run[v]())
            print(f"round {r + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{v} {statistics.median(runs[v][-1]['seconds']):.3f} s" for v in variants),
                flush=True)
    finally:
        if load is not None:
            load.remove()
    med = {v: statistics.median(t for run in runs[v] for t in run["seconds"]) for v in variants}

    def write(**figures) -> None:
        """args.json: the run's set-up, `figures`, and every timing behind them."""
        save(args.json, header, args=settings(args), params=loop.n_params, batch=loop.batch,
             batch_sizing=sizing, **figures, runs=runs)

    def pair_ratios(v: str, r: int, floor: float = 0.0) -> list[float]:
        """Round r of variant v (overlap, overlap_host or fwd_bwd_io): each of its samples
        over max(the fwd+bwd alone timed just before it, the round's step alone for overlap,
        floor)."""
        step = (statistics.median(runs["step_only"][r]["seconds"]) if v == "overlap" else 0.0)
        return paired(runs[v][r]["seconds"], runs[v][r]["alone"], max(step, floor))

    if len(variants) < len(VARIANTS):  # a partial run (--only): figures, no table
        if {"step_only", "overlap"} <= set(variants):
            med["ratio"], med["ratio_per_round"] = median_over_rounds(
                [pair_ratios("overlap", r) for r in range(args.rounds)])
        if "fwd_bwd_io" in variants:
            med["io_slowdown"] = median_over_rounds(
                [pair_ratios("fwd_bwd_io", r) for r in range(args.rounds)])[0]
            if "ratio" in med:
                med["ratio_beside_io"] = med["ratio"] / med["io_slowdown"]
        print(json.dumps(med))
        write(median_seconds=med, **{k: med[k] for k in ("ratio", "ratio_per_round") if k in med})
        return 0

    def detail(v: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[v])

    # The machine's speed drifts by 10-20% over seconds: each ratio compares an overlapped
    # iteration with the fwd+bwd alone timed just before it; the headline is the median of
    # every pair's.
    def over_rounds(v: str, floor: float = 0.0) -> tuple[float, list[float]]:
        return median_over_rounds([pair_ratios(v, r, floor) for r in range(args.rounds)])

    ratio, per_round = over_rounds("overlap")
    ratio_host, per_round_host = over_rounds("overlap_host")
    # What the cores allow: overlap cannot beat the CPU time of fwd+bwd and of the step
    # spread over every core (the step's Adam, checksums and I/O bookkeeping take cores
    # from backward when backward uses them all).
    cores = len(os.sched_getaffinity(0))
    cpu = {v: statistics.median(c for run in runs[v] for c in run["cpu_seconds"])
           for v in ("fwd_bwd", "step_only", "overlap")}
    cpu_floor = (cpu["fwd_bwd"] + cpu["step_only"]) / cores
    ratio_cpu = over_rounds("overlap", cpu_floor)[0]
    alone = statistics.median(a for run in runs["overlap"] for a in run["alone"])
    io_rows, io_figures = [], {}
    if "fwd_bwd_io" in variants:
        # What the disk traffic alone costs fwd+bwd (each with fio over the one just before).
        slow = over_rounds("fwd_bwd_io")[0]
        moved = [m for run in runs["fwd_bwd_io"] for m in run["fio"]]
        gbps = {k: statistics.median([m[f"{k}_bytes"] / m[f"{k}_seconds"] / 1e9
                                      for m in moved if m[f"{k}_seconds"]] or [0.0])
                for k in ("read", "write")}
        asked = [statistics.median(run["asked_gbps"][i] for run in runs["fwd_bwd_io"])
                 for i in (0, 1)]
        io_figures = dict(io_slowdown=slow, ratio_beside_io=ratio / slow, fio_gbps=gbps)
        io_rows = [
            ["fwd+bwd beside fio moving the overlap's bytes", f"{med['fwd_bwd_io']:.3f} s",
             f"fio read {gbps['read']:.2f} GB/s, write {gbps['write']:.2f} GB/s (asked "
             f"{asked[0]:.2f}, {asked[1]:.2f}: the overlapped iteration's); / fwd+bwd alone "
             f"just before: {slow:.3f}"],
            ["overlap / max(fwd+bwd beside that traffic, update+I/O)", f"{ratio / slow:.3f}",
             "the gap left once the disk traffic's own cost to the computation is counted"]]
    plan = runs["overlap"][-1]["plan"]
    rows = [
        ["fwd+bwd alone", f"{med['fwd_bwd']:.3f} s", f"{loop.batch}x{args.seq} tokens"
         + (" (--batch auto)" if sizing else "")],
        ["plain AdamW (fused, in memory)", f"{med['plain']:.3f} s", "fwd+bwd+step"],
        ["tiermem step alone (update+I/O)", f"{med['step_only']:.3f} s",
         f"read {detail('step_only', 'read_bytes') / 1e9:.2f} GB, write "
         f"{detail('step_only', 'write_bytes') / 1e9:.2f} GB, update "
         f"{detail('step_only', 'update'):.3f} s, stall {detail('step_only', 'stall'):.3f} s"],
        ["tiermem, no overlap", f"{med['no_overlap']:.3f} s",
         f"fwd+bwd {detail('no_overlap', 'fwd_bwd_part'):.3f} s + step "
         f"{detail('no_overlap', 'step_part'):.3f} s"],
        ["tiermem, overlap_backward", f"{med['overlap']:.3f} s",
         f"fwd+bwd {detail('overlap', 'fwd_bwd_part'):.3f} s + rest of step "
         f"{detail('overlap', 'step_part'):.3f} s; {detail('overlap', 'early'):.0f} of "
         f"{plan['partitions']} partitions updated during backward"],
        ["fwd+bwd alone, paired", f"{alone:.3f} s",
         "timed just before each overlapped iteration (tiermem idle)"],
        ["overlap / max(fwd+bwd, update+I/O)", f"{ratio:.3f}",
         f"goal <= {GOAL}: " + goal_text(ratio, GOAL)
         + f"; median of {args.rounds} x {args.iters} pairs; per round "
         f"{', '.join(f'{x:.3f}' for x in per_round)}"],
        ["CPU floor: (fwd+bwd + step CPU time) / cores", f"{cpu_floor:.3f} s",
         f"fwd+bwd {cpu['fwd_bwd']:.3f} CPU-s, step {cpu['step_only']:.3f} CPU-s, {cores} "
         f"cores; overlap used {cpu['overlap']:.3f} CPU-s"],
        ["overlap / max(fwd+bwd, update+I/O, CPU floor)", f"{ratio_cpu:.3f}",
         "how close overlap comes to what these cores allow"],
        *io_rows,
        ["overlap / no overlap", f"{med['overlap'] / med['no_overlap']:.3f}", ""],
        ["reference: overlap, state in host memory", f"{med['overlap_host']:.3f} s",
         f"no I/O, no checksums: / fwd+bwd = {ratio_host:.3f} (per round "
         f"{', '.join(f'{x:.3f}' for x in per_round_host)}): the update's own CPU work "
         "taken from backward"],
    ]
    table = show_table(["what", "per iteration (median)", "detail"], rows, title=(
        f"\n{loop.n_params / 1e6:.0f}M {args.dtype} parameters on {loop.device} "
        f"({args.layers} blocks, d "
        f"{args.dim}, vocab {args.vocab}), state on NVMe: "
        f"{plan['state_bytes']['nvme'] / 1e9:.2f} GB in {plan['partitions']} partitions, "
        f"pinned {plan['pinned_bytes'] / 2**30:.2f} GiB, {args.backend}, kernel "
        f"{args.kernel}, checksums {args.checksums}, torch threads {torch.get_num_threads()}"
        + (f", step_device {args.step_device}" if loop.device.type == "cuda" else "") + "\n"))
    print()
    write(median_seconds=med, ratio=ratio, ratio_per_round=per_round, ratio_host=ratio_host,
          fwd_bwd_paired=alone, cpu_seconds=cpu, cores=cores, cpu_floor=cpu_floor,
          ratio_cpu_floor=ratio_cpu, ratio_host_per_round=per_round_host,
          loadavg_before=load_before, loadavg_after=os.getloadavg(), goal=GOAL,
          table=table, **io_figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
