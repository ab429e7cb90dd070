"""The offloaded step against its floors, measured in one run.

A synthetic fp32 model (default 1B parameters, 8 GB of Adam moments) keeps all
its optimizer state on NVMe (host tier 0, pinned buffers <= 1 GiB). Reported:

- tiermem step time (median of the steps after the first, which only writes);
- the I/O floor: fio reading and writing the same bytes as one step,
  concurrently, same block size and queue depth, huge-page buffers;
- the compute floor: the same step with all state in memory
  (torch.optim.AdamW(fused=True));
- step / max(floors), goal <= 1.10, and peak RSS against
  weights + grads + host tier + buffers + 10%;
- with `--state-dtype fp32,bf16,int8`, the same step with each optimizer.state_dtype
  (the floors are measured for the first) and each one's step time against the
  first's: bf16 moments halve the bytes an fp32 model's step moves, goal <= 0.6;
  int8 moments quarter them, goal <= 0.35;
- with `--model-dtype bf16 --master-weights fp32,kahan,none` (and int8 in
  --state-dtype) a bf16 model, each optimizer.master_weights with int8 moments too:
  none + int8 against the fp32-master, fp32-state step, goal <= 0.25.

Each phase runs in its own process so peak RSS and page cache are its own.
Usage: python bench/pipeline.py [--params 1B] [--steps 4] [--state-dtype fp32,bf16,int8]
       [--model-dtype bf16 --master-weights fp32,kahan,none] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from _harness import (add_phase_args, add_pipeline_args, fio_layout, goal_text,
                      offload_config, parse_count, parse_size, parser, peak_rss, run_header,
                      run_phase, save, serve_phase, settings, show_table, stat_medians,
                      steady, time_calls)

TENSOR_ELEMS = 1 << 24  # 16M-element parameters: large enough that per-tensor overhead is nil


def _model(n_params: int, seed: int = 0, tensor_elems: int = TENSOR_ELEMS,
           dtype: str = "fp32"):
    """Parameters (fp32 or bf16) with fixed gradients; the values do not change the timing."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(seed)
    params = []
    left = n_params
    while left > 0:
        n = min(tensor_elems, left)
        p = torch.nn.Parameter(torch.empty(n).uniform_(-1, 1, generator=g).to(dt))
        p.grad = torch.empty(n).uniform_(-1e-3, 1e-3, generator=g).to(dt)
        params.append(p)
        left -= n
    return params


def phase_memory(args: argparse.Namespace) -> dict:
    """Compute floor: torch's fused AdamW with all state in RAM."""
    import torch

    params = _model(args.params, dtype=args.model_dtype)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    times = time_calls(opt.step, args.steps)["seconds"]
    return {"step_seconds": times, "steady": statistics.median(steady(times))}


def phase_tiermem(args: argparse.Namespace) -> dict:
    """The offloaded step, state on NVMe."""
    import torch

    import tiermem

    params = _model(args.params, dtype=args.model_dtype)
    base_rss = peak_rss()
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    cfg = offload_config(args, state_dtype=args.state_dtype[0],
                         master_weights=args.master_weights[0])
    with tiermem.offload(opt, cfg, name="bench-pipeline") as tm:
        plan = tm.plan()
        times = time_calls(opt.step, args.steps)["seconds"]
        stats = tm.stats()
        peak = peak_rss()
        tm.discard()  # the state is not needed: skip gathering 8 GB back into RAM
    med = stat_medians(steady(stats), ("read_bytes", "write_bytes", "stall_seconds",
                                       "update_seconds", "overlap"))
    return {
        "plan": plan, "step_seconds": times, "stats": stats,
        "state_bytes": plan["state_bytes"]["nvme"],
        "steady": statistics.median(steady(times)),
        "read_bytes": med["read_bytes"], "write_bytes": med["write_bytes"],
        "stall": med["stall_seconds"], "update": med["update_seconds"],
        "overlap": med["overlap"], "peak_rss": peak, "rss_before_offload": base_rss,
    }


def phase_fio(args: argparse.Namespace, read_bytes: int, write_bytes: int) -> dict:
    """I/O floor: fio reads `read_bytes` and writes `write_bytes` concurrently, once."""
    with FioFloor(args.swap_dir, parse_size(args.block_size), args.queue_depth,
                  read_bytes, write_bytes, layout_write=False) as floor:
        return floor.measure()


def fio_variants(read_bytes: int, write_bytes: int, depth: int) -> dict[str, int]:
    """The floor's two tries, named by the jobs fio runs (a step that reads nothing runs
    the write job alone): each job at the full depth, and sharing it (the engine's total)."""
    jobs = "2 jobs" if read_bytes and write_bytes else "1 job"
    return {f"{jobs} x depth": depth, f"{jobs} x depth/2": max(1, depth // 2)}


class FioFloor:
    """The I/O floor of one step: fio reading `read_bytes` and writing `write_bytes`
    concurrently (io_uring, O_DIRECT, `block_size` requests, huge-page buffers), the
    read from a file written beforehand.

    Tried as two jobs at the full depth each, and as two jobs sharing it (the engine's
    own total); the faster is the floor, so the ratio never flatters tiermem. The files
    are laid out once, so measure() may run many times (interleaved with the steps it is
    the floor of); `layout_write` also writes the write job's file first, so fio
    overwrites written blocks as tiermem's steps do (its records were written the step
    before), rather than extending a file."""

    def __init__(self, swap_dir: str | os.PathLike, block_size: int, queue_depth: int,
                 read_bytes: int, write_bytes: int, *, layout_write: bool = True) -> None:
        self.dir = Path(swap_dir) / "fio-floor"
        self.rfile, self.wfile = self.dir / "read.bin", self.dir / "write.bin"
        self.bs, self.depth = block_size, queue_depth
        # fio moves whole blocks only: a tail under one block (a record's footer) is
        # left out of the floor rather than rounded up into it.
        self.read_bytes = int(read_bytes) // block_size * block_size
        self.write_bytes = int(write_bytes) // block_size * block_size
        self.layout_write = layout_write
        self._pages = None
        self._need = 0

    def __enter__(self) -> "FioFloor":
        from io_vs_fio import HugePageReservation, pages_for

        if self.read_bytes == self.write_bytes == 0:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.read_bytes:
                fio_layout(self.rfile, self.read_bytes)
            if self.write_bytes and self.layout_write:
                fio_layout(self.wfile, self.write_bytes)
            self._need = 2 * pages_for(self.bs * self.depth, 2 << 20) + 8
            self._pages = HugePageReservation(self._need)
            self._pages.__enter__()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._pages is not None:
                self._pages.__exit__(*exc)
        finally:
            self._remove()

    def _remove(self) -> None:
        if self.dir.exists():
            for f in (self.rfile, self.wfile):
                f.unlink(missing_ok=True)
            self.dir.rmdir()

    def measure(self, tries: int = 5) -> dict:
        """One measurement: seconds (the slower job of the faster variant), per-job
        seconds, GB/s each way, and every variant's figures."""
        if self.read_bytes == self.write_bytes == 0:  # every record stayed in the buffers
            return {"seconds": 0.0, "per_job_seconds": {}, "depth": 0, "read_gbps": 0.0,
                    "write_gbps": 0.0, "variant": "no I/O", "variants": {}}
        variants = fio_variants(self.read_bytes, self.write_bytes, self.depth)
        results = {name: self._run(depth, tries) for name, depth in variants.items()}
        best = min(results, key=lambda k: results[k]["seconds"])
        return {**results[best], "variant": best, "variants": results}

    def measure_paced(self, free: dict, tries: int = 5) -> dict:
        """The floor of a run of steps rather than of one step: fio again at the depth
        `free` (a measure()) won, its read job paced (fio --rate) to end when the free run's
        write job did. A pipeline reads a record only into a buffer a write-back freed, so
        over many steps its reads go at the writes' pace; the free floor lets them race
        ahead and end early, which this disk rewards (docs/dev/benchmarks.md). When the
        reads were not the shorter job, pacing changes nothing: `free` is returned."""
        jobs = free.get("per_job_seconds", {})
        if not (self.read_bytes and self.write_bytes) or jobs.get("read", 0) >= jobs.get(
                "write", 0):
            return {**free, "paced": False}
        rate = max(1, int(self.read_bytes / jobs["write"]))
        return {**self._run(free["depth"], tries, read_rate=rate), "paced": True,
                "read_rate": rate}

    def measure_beside(self, free: dict, work: Callable[[], float], tries: int = 5) -> dict:
        """The floor with an update's memory traffic beside the transfers: fio again at the
        depth `free` (a measure()) won, and `work` (one in-memory optimizer step, returning
        its seconds) run once as soon as fio's transfers have begun. On a virtual machine
        whose disk is emulated by copies in the host's memory, a thread streaming memory
        slows the disk (docs/dev/benchmarks.md, the eighteenth session); a tiered step
        must move its bytes while its update streams the same weights, gradients and
        state, so this is what the disk gives it. `work_seconds` says how long the work
        took, `work_ended_first` whether it was all beside the transfers."""
        if self.read_bytes == self.write_bytes == 0:
            return {**free, "work_seconds": work(), "work_ended_first": False}
        return self._run(free["depth"], tries, beside=work)

    def _run(self, depth: int, tries: int, read_rate: int | None = None,
             beside: Callable[[], float] | None = None) -> dict:
        # fio at times reports a job that never ran (0 ms) on a busy machine: measured
        # again rather than taken.
        for attempt in range(tries):
            # The pages of the last fio come back only once its ring is torn down, and
            # tiermem's buffers may hold some: without enough, a job fails with EFAULT.
            try:
                self._pages.ensure_available(self._need)
            except OSError as exc:  # EINVAL while another process resizes the pool
                print(f"huge pages could not be added ({exc}), try {attempt + 1} of {tries}",
                      flush=True)
                time.sleep(1.0)
                continue
            try:
                return _fio_concurrent(self.rfile, self.wfile, self.read_bytes,
                                       self.write_bytes, self.bs, depth, read_rate, beside)
            except (ZeroDivisionError, subprocess.CalledProcessError) as exc:
                why = getattr(exc, "stderr", None) or type(exc).__name__
                print(f"fio floor failed, try {attempt + 1} of {tries}: {str(why)[-300:]}",
                      flush=True)
                if attempt == tries - 1:
                    raise
        raise RuntimeError(f"fio floor: no measurement in {tries} tries (see above)")


def _fio_started(proc: subprocess.Popen, bs: int) -> bool:
    """Whether fio (run with --thread: one process) has begun its transfers, or ended (a
    job too small to see, or a failure its output reports): a block written, or more read
    than loading its own libraries reads (well under 4 MiB)."""
    if proc.poll() is not None:
        return True
    try:
        with open(f"/proc/{proc.pid}/io") as f:
            io = dict(line.split(": ") for line in f.read().splitlines() if line)
    except OSError:  # gone between the two looks: it ended
        return True
    return int(io["write_bytes"]) >= bs or int(io["read_bytes"]) >= max(4 << 20, 4 * bs)


def _fio_beside(cmd: list[str], bs: int, work: Callable[[], float]
                ) -> tuple[subprocess.CompletedProcess, dict]:
    """Run fio (`cmd`) and, once its transfers have begun, `work` beside them."""
    proc = subprocess.Popen(cmd[:1] + ["--thread"] + cmd[1:], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        while not _fio_started(proc, bs):
            time.sleep(0.0005)
        seconds = work()
        ended_first = proc.poll() is None
        out, err = proc.communicate()
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return done, {"work_seconds": seconds, "work_ended_first": ended_first}


def _fio_concurrent(rfile: Path, wfile: Path, read_bytes: int, write_bytes: int, bs: int,
                    depth: int, read_rate: int | None = None,
                    beside: Callable[[], float] | None = None) -> dict:
    common = ["--ioengine=io_uring", "--direct=1", f"--bs={bs}", f"--iodepth={depth}",
              "--mem=mmaphuge"]
    # A job only for a direction with bytes: fio refuses --size=0, and a step whose
    # records all stayed in the buffers reads nothing.
    sizes = {"read": (rfile, read_bytes), "write": (wfile, write_bytes)}
    cmd = ["fio", "--output-format=json", *common]
    for name, (path, nbytes) in sizes.items():
        if nbytes:
            cmd += [f"--name={name}", f"--filename={path}", f"--rw={name}", f"--size={nbytes}"]
            if name == "read" and read_rate:  # bytes per second
                cmd.append(f"--rate={read_rate}")
    work: dict = {}
    if beside is None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    else:
        proc, work = _fio_beside(cmd, bs, beside)
    out = proc.stdout
    try:
        jobs = json.loads(out[out.index("{"):])["jobs"]
    except ValueError:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, proc.stderr) from None
    # fio 3.33 can abort in its exit path with --mem=mmaphuge ("double free") after it
    # printed complete results: those still count; a run without them does not.
    runtimes = {j["jobname"]: j[j["jobname"]]["runtime"] / 1e3 for j in jobs}
    # A job that failed (EFAULT when its huge-page buffers ran short) reports 0 ms and
    # fewer bytes: that is no floor.
    for j in jobs:
        name = j["jobname"]
        if j.get("error") or j[name]["io_bytes"] < sizes[name][1]:
            raise subprocess.CalledProcessError(
                proc.returncode, cmd, out, f"fio job {name}: error {j.get('error')}, moved "
                f"{j[name]['io_bytes']} of {sizes[name][1]} bytes; {proc.stderr[-500:]}")
    # fio reports whole milliseconds: a tiny job (a --quick smoke run) can take "0"
    gbps = {name: nbytes / runtimes[name] / 1e9 if runtimes.get(name) else 0.0
            for name, (_, nbytes) in sizes.items()}
    return {"seconds": max(runtimes.values()), "per_job_seconds": runtimes, "depth": depth,
            "read_gbps": gbps["read"], "write_gbps": gbps["write"], **work}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, json_name="pipeline.json", quick={"params": "200M", "steps": 3})
    p.add_argument("--params", default="1B", help="parameter count, e.g. 1B, 250M")
    p.add_argument("--steps", type=int, default=4)
    # bf16 state always runs the native kernel.
    add_pipeline_args(p, swap_dir="/var/tmp/tiermem-bench", partition_size="128MiB",
                      buffers=8, prefetch=4, kernels=("fused", "native"))
    p.add_argument("--checksum-cost", action="store_true",
                   help="also run the tiermem step with checksums off and report the cost")
    p.add_argument("--state-dtype", default="fp32",
                   help="optimizer.state_dtype, or a comma list (fp32,bf16,int8) to time each "
                        "in this run; the floors are measured for the first")
    p.add_argument("--model-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the synthetic model's weights and grads (default fp32)")
    p.add_argument("--master-weights", default="fp32",
                   help="optimizer.master_weights of a bf16 model, or a comma list "
                        "(fp32,kahan,none); kahan and none are timed with int8 state only")
    add_phase_args(p)
    a = p.parse_args(argv)
    a.params_text, a.params = a.params, parse_count(a.params)
    a.state_dtype = a.state_dtype.split(",")
    a.master_weights = a.master_weights.split(",")
    for dt in a.state_dtype:
        if dt not in ("fp32", "bf16", "int8"):
            p.error(f"--state-dtype: {dt!r} is not fp32, bf16 or int8")
    for mw in a.master_weights:
        if mw not in ("fp32", "kahan", "none"):
            p.error(f"--master-weights: {mw!r} is not fp32, kahan or none")
    if a.master_weights != ["fp32"] and a.model_dtype != "bf16":
        p.error("--master-weights kahan/none are for a bf16 model: add --model-dtype bf16")
    return a


def variants(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, state_dtype, master_weights) of each timed step, in order; the first is the
    reference the others are compared with."""
    out = []
    for mw in args.master_weights:
        for dt in args.state_dtype:
            if mw != "fp32" and dt != "int8":
                continue  # master-less weights run with int8 moments only
            out.append((dt if mw == "fp32" else f"{mw}+{dt}", dt, mw))
    return out


# (model dtype, reference label, label) -> the goal for the ratio of their steps
GOALS = {("fp32", "fp32", "bf16"): 0.6, ("fp32", "fp32", "int8"): 0.35,
         ("bf16", "fp32", "none+int8"): 0.25}


def main(argv=None) -> int:
    args = parse_args(argv)
    if serve_phase(args, {"memory": phase_memory, "tiermem": phase_tiermem}):
        return 0
    header = run_header("pipeline", argv)
    raw = sys.argv[1:] if argv is None else list(argv)
    os.makedirs(args.swap_dir, exist_ok=True)
    by_dtype = {}
    for label, dt, mw in variants(args):
        by_dtype[label] = run_phase(__file__, "tiermem",
                                    raw + ["--state-dtype", dt, "--master-weights", mw])
        print(f"tiermem steps, {label} state: "
              f"{[round(t, 2) for t in by_dtype[label]['step_seconds']]} s", flush=True)
    first = variants(args)[0][0]
    tm = by_dtype[first]
    bare = None
    if args.checksum_cost:
        bare = run_phase(__file__, "tiermem", [a for a in raw if a != "--checksum-cost"]
                          + ["--checksums", "off", "--state-dtype", variants(args)[0][1],
                             "--master-weights", variants(args)[0][2]])
        print(f"tiermem steps, checksums off: {[round(t, 2) for t in bare['step_seconds']]} s",
              flush=True)
    mem = run_phase(__file__, "memory", raw)
    print(f"in-memory steps: {[round(t, 2) for t in mem['step_seconds']]} s", flush=True)
    fio = phase_fio(args, int(tm["read_bytes"]), int(tm["write_bytes"]))
    floor = max(fio["seconds"], mem["steady"])
    ratio = tm["steady"] / floor
    weights = grads = args.params * (4 if args.model_dtype == "fp32" else 2)
    buffers = tm["plan"]["pinned_bytes"]
    rss_bound = (weights + grads + buffers) * 1.10
    def step_row(what: str, r: dict) -> list[str]:
        return [what, f"{r['steady']:.2f} s",
                f"read {r['read_bytes'] / r['steady'] / 1e9:.2f} GB/s, write "
                f"{r['write_bytes'] / r['steady'] / 1e9:.2f} GB/s "
                f"({(r['read_bytes'] + r['write_bytes']) / 1e9:.2f} GB moved), "
                f"stall {r['stall']:.2f} s, update {r['update']:.2f} s, "
                f"overlap {r['overlap']:.2f}"]

    dtype_ratios = {dt: r["steady"] / tm["steady"] for dt, r in by_dtype.items() if dt != first}
    goals = {dt: g for (model, ref, dt), g in GOALS.items()
             if (model, ref) == (args.model_dtype, first)}
    rows = [
        step_row(f"tiermem step (NVMe, {first} state)", tm),
        *(row for dt, ratio in dtype_ratios.items() for row in (
            step_row(f"tiermem step (NVMe, {dt} state)", by_dtype[dt]),
            [f"{dt} / {first} state step", f"{ratio:.3f}",
             f"state bytes {by_dtype[dt]['state_bytes'] / tm['state_bytes']:.2f}x"
             + (f"; goal <= {goals[dt]}: " + goal_text(ratio, goals[dt])
                if dt in goals else "")])),
        ["I/O floor (fio, concurrent r+w)", f"{fio['seconds']:.2f} s",
         f"read {fio['read_gbps']:.2f} GB/s, write {fio['write_gbps']:.2f} GB/s "
         f"({fio['variant']}; " + ", ".join(f"{k}: {v['seconds']:.2f} s"
                                            for k, v in fio["variants"].items()) + ")"],
        ["compute floor (in-memory fused AdamW)", f"{mem['steady']:.2f} s", ""],
        ["step / max(floors)", f"{ratio:.3f}", "goal <= 1.10: " + goal_text(ratio, 1.10)],
        *([["checksums cost", f"{tm['steady'] / bare['steady'] - 1:+.1%}",
            f"step {bare['steady']:.2f} s with checksums off, {tm['steady']:.2f} s on "
            f"(goal < 5%)"]] if bare else []),
        ["peak RSS", f"{tm['peak_rss'] / 2**30:.2f} GiB",
         f"bound weights+grads+buffers+10% = {rss_bound / 2**30:.2f} GiB: "
         + goal_text(tm["peak_rss"], rss_bound)],
    ]
    table = show_table(["what", "time", "detail"], rows, title=(
        f"\n{args.params_text} {args.model_dtype} parameters, {first} state on NVMe: "
        f"{tm['plan']['state_bytes']['nvme'] / 1e9:.2f} GB in {tm['plan']['partitions']} "
        f"partitions, pinned {buffers / 2**30:.2f} GiB, {args.backend}, "
        f"bs {args.block_size}, qd {args.queue_depth}\n"))
    print()
    save(args.json, header, args=settings(args), tiermem=tm, tiermem_no_checksums=bare,
         tiermem_by_state_dtype=by_dtype, state_dtype_ratios=dtype_ratios, memory=mem,
         fio=fio, ratio=ratio, rss_bound=rss_bound, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
