"""The user guide's figures, from small runs of the benchmarks on this machine.

Writes into docs/guide/img/ (or --out), each figure from its own quick run:

- step-floors.png: the offloaded step (fp32 and bf16 state) against its I/O floor
  (fio moving the same bytes) and compute floor (the same step in memory), from
  bench/pipeline.py;
- io-grid.png: read and write GB/s by block size x queue depth, from
  `tiermem probe --json` on the swap directory;
- bf16-error.png: how far bf16 optimizer state (stochastic and nearest rounding) takes
  the weights from fp32 AdamW over the steps of a noisy quadratic, and a second moment
  left with no gradient (the case stochastic rounding is for), on tiermem's kernel;
- durability-cost.png: step and commit time of swap.durability scratch and
  crash_consistent, from bench/durability.py;
- pipeline-timeline.png: `tiermem stress --plot` of a 20M-parameter model whose state
  streams through 4 buffers (tracing.md explains how to read it).

The JSON of each run goes to --results (default bench/results/docs-plots/); --replot
draws the figures from those files without measuring again. Sizes are small so the
whole script takes a few minutes; the figures say what was run and on what machine,
and compare only figures from one run.

    flock /tmp/tiermem-heavy.lock python3 bench/docs_plots.py --swap-dir /var/tmp/tm-plots
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _harness import HERE, REPO, RESULTS, cpu_model, parser, run_header, save

FIGURES = ("step", "io", "bf16", "durability", "timeline")
COLORS = {"fp32": "tab:blue", "bf16 nearest": "tab:orange", "bf16 stochastic": "tab:green"}


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=REPO)
    print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)


def _load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def _machine() -> str:
    import os
    return f"{cpu_model()}, {os.cpu_count()} CPUs"


# -- measurements --------------------------------------------------------------------------


def measure_step(args, out: Path) -> None:
    # Small partitions and few buffers, so that most of even the bf16 state is read from
    # NVMe every step, as in a run whose state is far larger than its buffers.
    _run([sys.executable, str(HERE / "pipeline.py"), "--params", args.step_params,
          "--steps", "3", "--state-dtype", "fp32,bf16", "--partition-size", "32MiB",
          "--buffers", "4", "--prefetch", "2",
          "--swap-dir", str(Path(args.swap_dir) / "pipeline"), "--json", str(out)])


def measure_io(args, out: Path) -> None:
    d = Path(args.swap_dir) / "probe"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    _run([sys.executable, "-m", "tiermem", "probe", str(d), "--size", args.probe_size,
          "--block-sizes", "64KiB,256KiB,1MiB,4MiB", "--depths", "1,4,16,32",
          "--backend", args.backend, "--json", str(out)])


def measure_durability(args, out: Path) -> None:
    _run([sys.executable, str(HERE / "durability.py"), "--params", args.durability_params,
          "--steps", "4", "--host", "64MiB", "--partition-size", "32MiB", "--buffers", "4",
          "--swap-dir", str(Path(args.swap_dir) / "dur"),
          "--json", str(out)])


def measure_bf16(args, out: Path) -> None:
    """AdamW on a noisy quadratic (curvatures spread over two decades): fp32 state against
    bf16 state stored nearest and stochastically, every step through
    tiermem.kernels.adam.adam_update as the pipeline calls it; and a second moment with
    no gradient (v = 1e-3, g = 0), which only stochastic rounding lets decay."""
    import torch

    from tiermem.kernels.adam import adam_update
    from tiermem.kernels.native_adam import state_seed

    n, steps = args.bf16_elements, args.bf16_steps
    gen = torch.Generator().manual_seed(0)
    curv = torch.logspace(-1, 1, n)[torch.randperm(n, generator=gen)]
    target = torch.randn(n, generator=gen)
    w0 = torch.zeros(n)
    modes = {"fp32": None, "bf16 nearest": "nearest", "bf16 stochastic": "stochastic"}
    runs = {}
    for name, rounding in modes.items():
        dt = torch.float32 if rounding is None else torch.bfloat16
        runs[name] = dict(w=w0.clone(), m=torch.zeros(n, dtype=dt), v=torch.zeros(n, dtype=dt),
                          step=torch.tensor(0.0), rounding=rounding)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                 maximize=False, decoupled_weight_decay=True, max_exp_avg_sqs=[])

    def one_step(r, g):
        r["step"] += 1
        extra = {}
        if r["rounding"] is not None:
            extra = dict(rounding=r["rounding"], offsets=[0],
                         seeds=[state_seed(step=r["step"], partition=0)])
        adam_update(kernel="native", params=[r["w"]], grads=[g], exp_avgs=[r["m"]],
                    exp_avg_sqs=[r["v"]], steps=[r["step"]], **hyper, **extra)

    every = max(1, steps // 100)
    curve = {name: [] for name in modes if name != "fp32"}
    xs = []
    noise = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        eps = torch.randn(n, generator=noise)  # the same noisy gradient field for all
        for r in runs.values():
            one_step(r, curv * (r["w"] - target) + 0.5 * eps)
        if t % every == 0 or t == steps:
            ref = runs["fp32"]["w"]
            travelled = float((ref - w0).norm())
            xs.append(t)
            for name in curve:
                curve[name].append(float((runs[name]["w"] - ref).norm()) / travelled)

    # A second moment with no gradient: fp32 decays by beta2 a step; nearest rounding
    # hands back the old value (the change is under half an ulp); stochastic follows.
    k, idle = 1 << 16, args.bf16_idle_steps
    decay = {}
    for name, rounding in modes.items():
        dt = torch.float32 if rounding is None else torch.bfloat16
        r = dict(w=torch.zeros(k), m=torch.zeros(k, dtype=dt),
                 v=torch.full((k,), 1e-3, dtype=dt), step=torch.tensor(0.0), rounding=rounding)
        zeros, seq = torch.zeros(k), []
        for t in range(idle):
            one_step(r, zeros)
            seq.append(float(r["v"].float().mean()))
        decay[name] = seq
    save(out, run_header("docs_plots"), elements=n, steps=xs, relative_distance=curve,
         idle_steps=idle, idle_v_mean=decay, quiet=True)


TIMELINE_CONFIG = """\
swap: {{paths: ['{swap}']}}
io: {{backend: {backend}}}
tiers: {{host: {{capacity: 16MiB}}}}
pipeline: {{partition_size: 8MiB, buffer_count: 4, prefetch_depth: 2, zigzag: false}}
"""


def measure_timeline(args, out: Path) -> None:
    swap = Path(args.swap_dir) / "timeline"
    swap.mkdir(parents=True, exist_ok=True, mode=0o700)
    cfg = out.with_suffix(".yaml")
    cfg.write_text(TIMELINE_CONFIG.format(swap=swap, backend=args.backend))
    _run([sys.executable, "-m", "tiermem", "stress", "--config", str(cfg), "--params", "20M",
          "--steps", "4", "--synthetic-grads", "--no-progress", "--json", str(out),
          "--plot", str(args.out / "pipeline-timeline.png")])


def plot_timeline(data: dict, png: Path) -> None:
    """`tiermem stress --plot` drew it during the run (the plot needs the run's events,
    which the JSON does not keep)."""


# -- figures -------------------------------------------------------------------------------


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _footer(fig, data: dict, what: str) -> None:
    machine = data.get("machine") or {}
    cpu = machine.get("cpu") or machine.get("cpu_model") or _machine()
    fig.text(0.01, 0.01, f"{what}; {cpu}", fontsize=7, color="0.4")


def plot_step(data: dict, png: Path) -> None:
    plt = _plt()
    by = data["tiermem_by_state_dtype"]
    labels, values, colors = [], [], []
    for dt, r in by.items():
        labels.append(f"tiermem step\n{dt} state")
        values.append(r["steady"])
        colors.append("tab:blue" if dt == "fp32" else "tab:cyan")
    labels += ["I/O floor\n(fio, same bytes)", "compute floor\n(in-memory AdamW)"]
    values += [data["fio"]["seconds"], data["memory"]["steady"]]
    colors += ["0.55", "0.75"]
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    bars = ax.bar(labels, values, color=colors)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.2f} s", (b.get_x() + b.get_width() / 2, v), ha="center",
                    va="bottom", fontsize=9)
    a = data["args"]
    ax.set_ylim(0, max(values) * 1.12)
    ax.set_ylabel("seconds per opt.step()")
    ax.set_title(f"{a['params_text'] if 'params_text' in a else a['params']} fp32 parameters, "
                 f"all state on NVMe: step against its floors (step / max(floors) "
                 f"{data['ratio']:.2f})", fontsize=10)
    fig.subplots_adjust(bottom=0.2)
    _footer(fig, data, f"bench/pipeline.py, {a['backend']}, median of steps 2-3")
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_io(data: dict, png: Path) -> None:
    plt = _plt()
    reports = data if isinstance(data, list) else [data]
    ms = [m for r in reports for m in r["measurements"]]
    blocks = sorted({m["block_size"] for m in ms})
    depths = sorted({m["queue_depth"] for m in ms})
    backend = ms[0]["backend"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax, key, title in zip(axes, ("read_gbps", "write_gbps"), ("read", "write")):
        grid = [[next((m[key] for m in ms if m["block_size"] == b and m["queue_depth"] == d
                       and m["backend"] == backend), float("nan")) for d in depths]
                for b in blocks]
        im = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if v < max(max(r) for r in grid) * 0.6 else "black")
        ax.set_xticks(range(len(depths)), [str(d) for d in depths])
        ax.set_yticks(range(len(blocks)), [f"{b >> 10} KiB" if b < 1 << 20 else
                                           f"{b >> 20} MiB" for b in blocks])
        ax.set_xlabel("queue depth")
        ax.set_ylabel("block size")
        ax.set_title(f"{title} GB/s ({backend}, O_DIRECT)", fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.subplots_adjust(bottom=0.22, wspace=0.45)
    fs = reports[0].get("fstype", "?")
    _footer(fig, {}, f"tiermem probe --json, {fs}")
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_bf16(data: dict, png: Path) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, ys in data["relative_distance"].items():
        a1.plot(data["steps"], [100 * y for y in ys], label=name, color=COLORS.get(name))
    a1.set_xlabel("step")
    a1.set_ylabel("% of the distance fp32 travelled")
    a1.set_title("weights: bf16 state against fp32 AdamW", fontsize=10)
    a1.legend(fontsize=8)
    for name, ys in data["idle_v_mean"].items():
        a2.plot(range(1, len(ys) + 1), ys, label=name, color=COLORS.get(name),
                linestyle="--" if name == "fp32" else "-", zorder=3 if name == "fp32" else 2)
    a2.set_xlabel("steps with no gradient")
    a2.set_ylabel("mean exp_avg_sq")
    a2.set_title("a second moment left to decay", fontsize=10)
    a2.legend(fontsize=8)
    fig.subplots_adjust(bottom=0.22, wspace=0.35)
    _footer(fig, data, f"{data['elements']:,} elements, AdamW lr 1e-2, native kernel")
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_durability(data: dict, png: Path) -> None:
    plt = _plt()
    res = data["results"]
    modes = list(res)
    step = [res[m]["step_s"] for m in modes]
    commit = [res[m]["commit_s"] or 0.0 for m in modes]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.4))
    a1.bar(modes, [s - c for s, c in zip(step, commit)], color="tab:blue", label="step")
    a1.bar(modes, commit, bottom=[s - c for s, c in zip(step, commit)], color="tab:red",
           label="commit")
    for i, s in enumerate(step):
        a1.annotate(f"{s:.2f} s", (i, s), ha="center", va="bottom", fontsize=9)
    a1.set_ylabel("seconds per opt.step()")
    a1.set_title(f"step time (x{data['crash_over_scratch']:.2f} for crash_consistent)",
                 fontsize=10)
    a1.legend(fontsize=8, loc="upper left")
    a1.set_ylim(0, max(step) * 1.25)
    width = 0.38
    xs = range(len(modes))
    a2.bar([x - width / 2 for x in xs], [res[m]["write_bytes"] / 1e9 for m in modes], width,
           label="written")
    a2.bar([x + width / 2 for x in xs], [res[m]["read_bytes"] / 1e9 for m in modes], width,
           label="read")
    a2.set_xticks(list(xs), modes)
    a2.set_ylabel("GB per step")
    a2.set_title("bytes moved per step", fontsize=10)
    a2.legend(fontsize=8)
    fig.subplots_adjust(bottom=0.22, wspace=0.35)
    _footer(fig, data, f"bench/durability.py, {data['params'] / 1e6:.0f}M fp32 parameters, "
                       f"host tier {data['host']}, {data.get('buffers', 8)} x "
                       f"{data.get('partition_size', '128MiB')} buffers")
    fig.savefig(png, dpi=110)
    plt.close(fig)


STEPS = {
    "step": ("pipeline.json", measure_step, plot_step, "step-floors.png"),
    "io": ("probe.json", measure_io, plot_io, "io-grid.png"),
    "bf16": ("bf16.json", measure_bf16, plot_bf16, "bf16-error.png"),
    "durability": ("durability.json", measure_durability, plot_durability,
                   "durability-cost.png"),
    "timeline": ("timeline.json", measure_timeline, plot_timeline, "pipeline-timeline.png"),
}


def main(argv=None) -> int:
    p = parser(__doc__, json_name=None, json_flags=(),
               quick={"step_params": "64M", "durability_params": "16M", "probe_size": "32MiB",
                      "bf16_steps": 300, "bf16_elements": 1 << 16})
    p.add_argument("--out", type=Path, default=REPO / "docs" / "guide" / "img")
    p.add_argument("--results", type=Path, default=RESULTS / "docs-plots")
    p.add_argument("--swap-dir", default="/var/tmp/tiermem-docs-plots",
                   help="scratch directory for the runs (removed afterwards)")
    p.add_argument("--backend", default="io_uring", choices=["io_uring", "threads"])
    p.add_argument("--only", default=",".join(FIGURES),
                   help=f"comma list of {', '.join(FIGURES)}")
    p.add_argument("--replot", action="store_true",
                   help="draw from the JSON in --results without measuring")
    p.add_argument("--step-params", default="96M")
    p.add_argument("--durability-params", default="64M")
    p.add_argument("--probe-size", default="64MiB")
    p.add_argument("--bf16-steps", type=int, default=600)
    p.add_argument("--bf16-elements", type=int, default=1 << 16)
    p.add_argument("--bf16-idle-steps", type=int, default=1000)
    args = p.parse_args(argv)
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    bad = [f for f in only if f not in STEPS]
    if bad:
        p.error(f"--only: unknown {bad}; choose from {', '.join(FIGURES)}")
    args.results.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    created = not Path(args.swap_dir).exists()
    try:
        for name in only:
            json_name, measure, plot, png = STEPS[name]
            src = args.results / json_name
            if not args.replot:
                measure(args, src)
            plot(_load(src), args.out / png)
            print(f"wrote {args.out / png}", flush=True)
    finally:
        if created and not args.replot:
            shutil.rmtree(args.swap_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
