"""Run every tiermem benchmark, then write one report of the run.

Runs bench/io_vs_fio.py, bench/pipeline.py, bench/adam.py and bench/train_loop.py
(one torch thread, as a GPU backward leaves the host's cores) one after the other,
each as its own process with its --json pointed into one results folder (default
bench/results/<UTC timestamp>/), its output shown and kept in <name>.log. Then
writes there:

- report.md: per benchmark, the command, its table, and each figure beside its
  reference from the same run with the ratio;
- report.json: the JSON results combined, with machine facts, commands,
  exit codes and durations.

Exits non-zero, naming them, when any benchmark fails (the others still run).

Full run (root):   python3 bench/run_all.py
Smoke test:        python3 bench/run_all.py --quick      (small sizes, a few minutes)
Some only:         python3 bench/run_all.py --only adam,pipeline
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from _harness import HERE, REPO, markdown_table, parser, ratio_text, run_header, write_json

BENCHMARKS = ("io", "pipeline", "adam", "overlap")
SCRIPTS = {"io": "io_vs_fio.py", "pipeline": "pipeline.py", "adam": "adam.py",
           "overlap": "train_loop.py"}
TITLES = {"io": "I/O engine against fio (bench/io_vs_fio.py)",
          "pipeline": "Offloaded step against its floors (bench/pipeline.py)",
          "adam": "Adam step on the CPU (bench/adam.py)",
          "overlap": "Update overlapped with backward (bench/train_loop.py)"}
# Each script's own flags (read from its argparse): BASE_ARGS always, then FULL_ARGS, or
# --quick (each script's own small sizes); a full run is otherwise the script's defaults.
BASE_ARGS = {"overlap": ["--threads", "1", "--batch", "1"]}
FULL_ARGS = {"overlap": ["--iters", "4", "--rounds", "5"]}
# Environment per benchmark: OpenMP threads that spin while waiting would take the core
# the overlapped update runs on (docs/dev/tuning-measurements.md measures with this).
ENV = {"overlap": {"OMP_WAIT_POLICY": "PASSIVE"}}
VARIES = ("Figures vary by up to 25% from run to run on this shared machine; only ratios "
          "between figures of one run mean anything.")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, json_name=None, json_flags=())
    p.add_argument("--quick", action="store_true",
                   help="each script with --quick: io 512MiB 1 round, pipeline 200M params "
                        "3 steps, adam 10M params, overlap a 15M-parameter model 2 rounds")
    p.add_argument("--only", default=",".join(BENCHMARKS),
                   help="comma-separated subset of io,pipeline,adam,overlap (default all)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default bench/results/<UTC timestamp>/)")
    a = p.parse_args(argv)
    a.only = [b.strip() for b in a.only.split(",") if b.strip()]
    unknown = [b for b in a.only if b not in BENCHMARKS]
    if unknown or not a.only:
        p.error(f"--only: unknown {unknown or a.only}; choose from {','.join(BENCHMARKS)}")
    a.only = [b for b in BENCHMARKS if b in a.only]  # always in the same order
    return a


# -- running ---------------------------------------------------------------------------------


def run_one(name: str, quick: bool, out: Path) -> dict[str, Any]:
    """Run one benchmark script, echoing its output and keeping it in <out>/<name>.log."""
    json_path = out / f"{Path(SCRIPTS[name]).stem}.json"
    argv = [sys.executable, str(HERE / SCRIPTS[name]), *BASE_ARGS.get(name, []),
            *(["--quick"] if quick else FULL_ARGS.get(name, [])), "--json", str(json_path)]
    shown_json = (os.path.relpath(json_path, REPO) if json_path.resolve().is_relative_to(REPO)
                  else str(json_path))
    extra_env = {k: os.environ.get(k, v) for k, v in ENV.get(name, {}).items()}
    shown = shlex.join([*(f"{k}={v}" for k, v in extra_env.items()), "python3",
                        f"bench/{SCRIPTS[name]}", *argv[2:-2], "--json", shown_json])
    env = {**os.environ, **extra_env, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYTHONUNBUFFERED": "1"}
    log_path = out / f"{name}.log"
    print(f"\n=== {name}: {shown}", flush=True)
    t0 = time.monotonic()
    tail: list[str] = []
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1)
        except OSError as exc:
            log.write(f"could not start: {exc}\n")
            return {"name": name, "command": shown, "returncode": None,
                    "error": f"could not start: {exc}", "seconds": 0.0, "log": str(log_path),
                    "json_path": str(json_path), "data": None, "output_tail": []}
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            tail = (tail + [line.rstrip("\n")])[-400:]
        rc = proc.wait()
    seconds = time.monotonic() - t0
    data, error = None, None
    if rc != 0:
        error = f"exit status {rc}"
    else:
        try:
            data = json.loads(json_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            error = f"exit status 0 but no readable JSON at {json_path}: {exc}"
    print(f"=== {name}: {'ok' if error is None else 'FAILED: ' + error} "
          f"in {seconds:.0f} s", flush=True)
    return {"name": name, "command": shown, "returncode": rc, "error": error,
            "seconds": seconds, "log": str(log_path), "json_path": str(json_path),
            "data": data, "output_tail": tail}


# -- figures beside their references ---------------------------------------------------------


def io_figures(d: dict) -> list[list[str]]:
    """Each tiermem backend beside fio (and DeepSpeed aio) at the same depth and op."""
    med = {(r["tool"], r["depth"], r["op"]): r["gbps_median"] for r in d["medians"]}
    rows = []
    for r in d["medians"]:
        if not r["tool"].startswith("tiermem"):
            continue
        for ref in ("fio", "deepspeed aio"):
            ref_v = med.get((ref, r["depth"], r["op"]))
            if ref_v is None:
                continue
            rows.append([f"{r['tool']} qd{r['depth']} {r['op']}", f"{r['gbps_median']:.2f} GB/s",
                         f"{ref} qd{r['depth']} {r['op']}", f"{ref_v:.2f} GB/s",
                         ratio_text(r["gbps_median"], ref_v)])
    return rows


def pipeline_figures(d: dict) -> list[list[str]]:
    """The offloaded step beside each floor and their max; peak RSS beside its bound."""
    tm, fio, mem = d["tiermem"]["steady"], d["fio"]["seconds"], d["memory"]["steady"]
    floor = max(fio, mem)
    step = f"{tm:.2f} s"
    return [
        ["tiermem step (NVMe)", step, "I/O floor (fio, concurrent r+w)", f"{fio:.2f} s",
         ratio_text(tm, fio)],
        ["tiermem step (NVMe)", step, "compute floor (in-memory fused AdamW)", f"{mem:.2f} s",
         ratio_text(tm, mem)],
        ["tiermem step (NVMe)", step, "max(floors), goal ratio <= 1.10", f"{floor:.2f} s",
         ratio_text(tm, floor)],
        ["peak RSS", f"{d['tiermem']['peak_rss'] / 2**30:.2f} GiB",
         "weights + grads + buffers + 10%", f"{d['rss_bound'] / 2**30:.2f} GiB",
         ratio_text(d["tiermem"]["peak_rss"], d["rss_bound"])],
    ]


def adam_figures(d: dict) -> list[list[str]]:
    """Each of tiermem's updates (torch's fused kernel through adam_update, the native one)
    beside torch fused, DeepSpeed and the memory floor, per (params, dtype)."""
    rows = []
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in d["rows"]:
        groups.setdefault((r["params"], r["dtype"]), {})[r["implementation"]] = r
    for (params, dtype), g in groups.items():
        mine = [r for k, r in g.items() if k.startswith("tiermem") and r["status"] == "measured"]
        refs = [r for k, r in g.items() if not k.startswith("tiermem")
                and k != "torch AdamW foreach" and r["status"] == "measured"]
        for tm in mine:
            for ref in refs:
                rows.append([f"{tm['implementation']} {dtype} {params}",
                             f"{tm['ns_per_param']:.3f} ns/param", ref["implementation"],
                             f"{ref['ns_per_param']:.3f} ns/param",
                             ratio_text(tm["ns_per_param"], ref["ns_per_param"])])
    return rows


def overlap_figures(d: dict) -> list[list[str]]:
    """The overlapped iteration beside the goal's max(fwd+bwd, update+I/O) and the run's other
    references. Ratios are the script's own medians over paired samples, not quotients of
    the medians shown beside them."""
    med = d["median_seconds"]
    it = f"{med['overlap']:.3f} s"
    goal = max(d["fwd_bwd_paired"], med["step_only"])
    rows = [["overlapped iteration", it,
             f"max(fwd+bwd paired, update+I/O), goal ratio <= {d['goal']}", f"{goal:.3f} s",
             f"{d['ratio']:.3f}"]]
    if "ratio_beside_io" in d:
        rows.append(["overlapped iteration", it, "max(fwd+bwd beside fio moving the same "
                     "bytes, update+I/O)", f"{max(med['fwd_bwd_io'], med['step_only']):.3f} s",
                     f"{d['ratio_beside_io']:.3f}"])
    rows += [
        ["overlapped iteration", it, "CPU floor ((fwd+bwd + step CPU time) / cores)",
         f"{d['cpu_floor']:.3f} s", f"{d['ratio_cpu_floor']:.3f}"],
        ["overlapped iteration", it, "no overlap", f"{med['no_overlap']:.3f} s",
         ratio_text(med["overlap"], med["no_overlap"])],
        ["overlap, state in host memory", f"{med['overlap_host']:.3f} s", "fwd+bwd paired",
         f"{d['fwd_bwd_paired']:.3f} s", f"{d['ratio_host']:.3f}"],
    ]
    return rows


FIGURES = {"io": io_figures, "pipeline": pipeline_figures, "adam": adam_figures,
           "overlap": overlap_figures}


# -- the report ------------------------------------------------------------------------------


def render_report(run: dict, results: list[dict]) -> str:
    m = run["machine"]
    mem = m.get("mem_total_bytes")
    out = [
        "# tiermem benchmarks",
        "",
        f"Run {run['started']} to {run['finished']} (UTC), {run['seconds'] / 60:.1f} min, "
        f"{'--quick' if run['quick'] else 'full sizes'}; command `{run['command']}`; "
        f"tiermem {run['revision']}, torch {run['torch']}.",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cpus')} CPUs, "
        f"{mem / 2**30:.1f} GiB RAM, {m.get('os')}, kernel {m.get('kernel')}, "
        f"Python {m.get('python')}." if mem else f"Machine: {m}",
        "",
        VARIES,
    ]
    failed = [r for r in results if r["error"]]
    if failed:
        out += ["", "**Failed:** " + ", ".join(f"{r['name']} ({r['error']})" for r in failed)]
    for res in results:
        out += ["", f"## {TITLES[res['name']]}", "",
                f"`{res['command']}` ({res['seconds']:.0f} s)", ""]
        if res["error"]:
            out += [f"FAILED: {res['error']}. Last lines of its output "
                    f"({os.path.basename(res['log'])}):", "", "```",
                    *res["output_tail"][-30:], "```"]
            continue
        table = (res["data"] or {}).get("table")
        out += [table if table else "(no table printed)", ""]
        try:
            rows = FIGURES[res["name"]](res["data"])
        except (KeyError, TypeError, ValueError) as exc:
            rows, note = [], f"(figures not found in its JSON: {type(exc).__name__}: {exc})"
        else:
            note = "" if rows else "(no figure with a reference in this run)"
        out += ["Each figure beside its reference from the same run:", ""]
        out += [markdown_table(["figure", "value", "reference", "value", "ratio"], rows)
                if rows else note]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run = run_header("run_all", argv)
    started = _dt.datetime.fromisoformat(run["started"])
    out = (args.out or HERE / "results" / started.strftime("%Y%m%dT%H%M%SZ")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = [run_one(name, args.quick, out) for name in args.only]
    run.update(finished=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               seconds=time.monotonic() - t0, quick=args.quick, only=args.only)
    report = render_report(run, results)
    (out / "report.md").write_text(report)
    write_json(out / "report.json", {
        **run,
        "benchmarks": {r["name"]: {k: v for k, v in r.items() if k not in ("name", "output_tail")}
                       for r in results},
        "failed": [r["name"] for r in results if r["error"]],
    })
    print("\n" + report)
    print(f"report: {out / 'report.md'}\n        {out / 'report.json'}")
    failed = [r for r in results if r["error"]]
    if failed:
        print("FAILED: " + ", ".join(f"{r['name']} ({r['error']})" for r in failed),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
