"""What every benchmark script shares, so that each script holds only what it measures.

- arguments: `parser()` (description from the script's docstring, `--json`, and
  `--quick` where a script names its quick sizes), counts ("250M") and sizes ("1MiB")
  parsed one way, the tiermem pipeline settings and the config built from them;
- the run header written into every JSON (`run_header`): when, the command, the
  git revision, torch's version and the machine's facts;
- one table printer (`show_table`) and one JSON writer (`save`);
- ratios against a same-run reference (`ratio`, `ratio_text`), and the median over
  paired rounds (`paired`, `median_over_rounds`);
- timing (`time_calls`), per-step medians of tiermem's stats (`stat_medians`), and a
  phase run in a child process of its own (`run_phase`, `serve_phase`).

Sizes use tiermem's own parser; nothing else imports tiermem, so a benchmark can still
report on a machine where the package fails to load.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
# A benchmark measures the checkout it sits in, not whichever tiermem is installed.
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


# -- counts and sizes ------------------------------------------------------------------------

def parse_count(text: str) -> int:
    """'1B' -> 10**9, '250M', '1.5B', '4096' (tiermem's own parser, as the CLI's)."""
    try:
        return _tiermem_sizes().parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def count_list(text: str) -> list[tuple[str, int]]:
    """'100M,400M' -> [('100M', 10**8), ('400M', 4 * 10**8)]: each count with its spelling."""
    out = [(t.strip(), parse_count(t)) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: no count (example: 100M,400M)")
    return out


def format_count(n: int) -> str:
    """The shortest exact spelling parse_count reads back: 10**9 -> '1B', 6_000_000 -> '6M'."""
    return _tiermem_sizes().format_count(n)


def parse_size(text: str) -> int:
    """Bytes in "4GiB", "512MiB", "1M" or "4096" (tiermem's own parser, one rule everywhere)."""
    return _tiermem_sizes().parse_size(text)


def format_size(nbytes: int) -> str:
    """The shortest exact IEC spelling of `nbytes`, e.g. 4294967296 -> "4GiB"."""
    return _tiermem_sizes().yaml_size(nbytes)


def _tiermem_sizes():
    # Imported on use, so the table and JSON helpers still work where tiermem does not load.
    from tiermem import sizes
    return sizes


# -- arguments -------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose `--quick` swaps in the script's quick sizes, as defaults:
    an option given on the command line still wins."""

    quick: dict[str, Any] = {}

    def parse_known_args(self, args=None, namespace=None):
        if self.quick:
            if not hasattr(self, "_full"):  # the defaults the options were added with
                self._full = {k: self.get_default(k) for k in self.quick}
            seen, _ = super().parse_known_args(args, argparse.Namespace())
            self.set_defaults(**(self.quick if seen.quick else self._full))
        return super().parse_known_args(args, namespace)


def parser(doc: str, *, json_name: str | None, quick: Mapping[str, Any] | None = None,
           json_flags: Sequence[str] = ("--json",)) -> argparse.ArgumentParser:
    """The script's parser: described by the first paragraph of its docstring (the rest
    is the --help epilog), `--json` (default bench/results/<json_name>) and, when
    `quick` maps option names (dest form) to values, `--quick` to use them."""
    head, _, rest = doc.strip().partition("\n\n")
    p = _Parser(description=head, epilog=rest or None,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_flags:  # run_all.py writes a folder of results instead
        default = str(RESULTS / json_name) if json_name else None
        p.add_argument(*json_flags, dest="json", default=default,
                       help=f"where the results go (default {os.path.relpath(default, REPO)})"
                       if default else "where the results go")
    if quick:
        p.add_argument("--quick", action="store_true",
                       help="small sizes for a smoke test: " + " ".join(
                           f"--{k.replace('_', '-')} {v}" for k, v in quick.items()))
        p.quick = dict(quick)
    return p


def add_pipeline_args(p: argparse.ArgumentParser, *, swap_dir: str, partition_size: str,
                      buffers: int, prefetch: int, kernels: Sequence[str]) -> None:
    """tiermem's swap, I/O and pipeline settings, for a benchmark that offloads to NVMe."""
    p.add_argument("--swap-dir", default=swap_dir)
    p.add_argument("--backend", default="io_uring", choices=["io_uring", "threads"])
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--block-size", default="1MiB")
    p.add_argument("--partition-size", default=partition_size)
    p.add_argument("--buffers", type=int, default=buffers)
    p.add_argument("--prefetch", type=int, default=prefetch)
    p.add_argument("--kernel", default="fused", choices=list(kernels),
                   help="optimizer.kernel")
    p.add_argument("--checksums", choices=["on", "off"], default="on",
                   help="swap.checksums (default on, as shipped)")


def offload_config(args: argparse.Namespace, *, host: int = 0,
                   pipeline: Mapping[str, Any] | None = None, **optimizer: Any) -> dict:
    """The tiermem config `add_pipeline_args` describes: all state on NVMe unless `host`
    bytes may stay in the host tier; `pipeline` and `optimizer` add to those sections."""
    return {"swap": {"paths": [args.swap_dir], "checksums": args.checksums == "on"},
            "io": {"backend": args.backend, "queue_depth": args.queue_depth,
                   "block_size": args.block_size},
            "tiers": {"host": {"capacity": host}},
            "pipeline": {"partition_size": args.partition_size, "buffer_count": args.buffers,
                         "prefetch_depth": args.prefetch, **(pipeline or {})},
            "optimizer": {"kernel": args.kernel, **optimizer}}


def settings(args: argparse.Namespace) -> dict:
    """The parsed arguments as JSON values (paths as text), internal ones left out."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if not k.startswith("phase")}


# -- the run header --------------------------------------------------------------------------


def run_header(benchmark: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every JSON starts with: which benchmark, when (UTC), the command, the code
    (git revision, torch) and the machine, so that a figure can be judged later."""
    script = f"bench/{benchmark}.py" if (HERE / f"{benchmark}.py").exists() else benchmark
    return {
        "benchmark": benchmark,
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", script, *(sys.argv[1:] if argv is None else argv)]),
        "revision": git_revision(REPO),
        "torch": _torch_version(),
        "machine": machine_facts(),
    }


def _torch_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("torch")
    except Exception:  # noqa: BLE001 - an odd install reports no version rather than fail
        return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (platform.processor() is often empty)."""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_total_bytes() -> int | None:
    """Physical memory, from /proc/meminfo."""
    m = re.search(r"^MemTotal:\s+(\d+) kB", _read("/proc/meminfo"), re.M)
    return int(m.group(1)) * 1024 if m else None


def git_revision(repo: str | os.PathLike) -> str | None:
    """HEAD of the repository at `repo`, with "+dirty" when the tree has changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge figures from another machine: kernel, CPU, memory."""
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "os": _read("/etc/os-release").partition('PRETTY_NAME="')[2].partition('"')[0] or None,
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "mem_total_bytes": mem_total_bytes(),
        "python": platform.python_version(),
    }


def peak_rss() -> int:
    """This process's peak resident set, bytes (VmHWM: getrusage's ru_maxrss survives
    execve, and a phase would report the size of the process that started it)."""
    from tiermem.tools.stress import peak_rss as vm_hwm

    return vm_hwm()


# -- output ----------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table with padded columns, readable as plain text too."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def show_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               title: str | None = None) -> str:
    """Print `title` (if any) and the table; return the table, for the JSON's "table"
    (run_all.py puts it in its report)."""
    table = markdown_table(headers, rows)
    if title:
        print(title)
    print(table, flush=True)
    return table


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as indented JSON, creating parent folders; atomic, so a reader never
    sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def save(path: str | os.PathLike | None, header: Mapping[str, Any], quiet: bool = False,
         **data: Any) -> Path | None:
    """The run's JSON at `path`: the header, then `data`. No path, no file."""
    if not path:
        return None
    out = write_json(path, {**header, **data})
    if not quiet:
        print(f"wrote {out}")
    return out


# -- ratios ----------------------------------------------------------------------------------


def ratio(figure: float | None, reference: float | None) -> float | None:
    """figure / reference from the same run; None when either is missing or the reference
    is zero (a ratio to nothing says nothing)."""
    return None if figure is None or not reference else figure / reference


def ratio_text(figure: float | None, reference: float | None = 1.0, digits: int = 2) -> str:
    """ratio() for a table: "n/a" where there is none. With one argument, a ratio already
    computed."""
    r = ratio(figure, reference)
    return "n/a" if r is None else f"{r:.{digits}f}"


def goal_text(value: float, goal: float, at_most: bool = True) -> str:
    """'met' or 'NOT met' for a ratio against its goal."""
    return "met" if (value <= goal if at_most else value >= goal) else "NOT met"


def paired(samples: Iterable[float], references: Iterable[float],
           floor: float = 0.0) -> list[float]:
    """Each sample over the reference timed just before it (or `floor`, when larger): the
    machine's speed drifts by 10-20% over seconds, so only figures of one moment compare."""
    return [s / max(r, floor) for s, r in zip(samples, references)]


def median_over_rounds(rounds: Sequence[Sequence[float]]) -> tuple[float, list[float]]:
    """(median over every paired ratio of every round, each round's median)."""
    return (statistics.median(x for r in rounds for x in r),
            [statistics.median(r) for r in rounds])


# -- measuring -------------------------------------------------------------------------------


def elapsed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Background:
    """While open, a thread calling `work` over and over (torch releases the GIL inside an
    op, so it loads a core and the memory bus, not the caller); `calls` and `seconds` say
    how many calls it made and for how long. `warm`: seconds it runs before the block."""

    def __init__(self, work: Callable[[], Any], warm: float = 0.0) -> None:
        self.work, self.warm = work, warm
        self.calls, self.seconds = 0, 0.0

    def __enter__(self) -> "Background":
        import threading

        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if self.warm:
            time.sleep(self.warm)
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            self.work()
            self.calls += 1
        self.seconds = time.perf_counter() - t0

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def time_calls(fn: Callable[[], Any], n: int, warmup: int = 0) -> dict[str, list[float]]:
    """Wall and CPU seconds (every thread of the process) of n calls after `warmup`
    untimed ones."""
    times, cpu = [], []
    for _ in range(warmup):
        fn()
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"seconds": times, "cpu_seconds": cpu}


def shuffled_rounds(runs: Mapping[str, Callable[[], float]], rounds: int,
                    seed: int = 0) -> dict[str, list[float]]:
    """Each run's figure in each of `rounds` rounds, the runs taken in a shuffled order
    each round (seeded), so that the machine's drift hits all alike."""
    import random

    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        order = list(runs)
        rng.shuffle(order)
        for name in order:
            times[name].append(runs[name]())
    return times


def steady(items: Sequence[Any]) -> Sequence[Any]:
    """The steps after the first (which only writes fresh records), or all if one."""
    return items[1:] or items


def stat_medians(stats: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, float]:
    """Per key, the median over steps of tiermem's stats; per-tier byte counts (dicts)
    summed first. A key a step lacks counts as 0."""
    def value(s: Mapping[str, Any], k: str) -> float:
        v = s.get(k, 0.0)
        return sum(v.values()) if isinstance(v, Mapping) else v
    return {k: statistics.median(value(s, k) for s in stats) for k in keys}


def add_phase_args(p: argparse.ArgumentParser) -> None:
    """The hidden options a script's child process is started with (`run_phase`)."""
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--phase-out", help=argparse.SUPPRESS)


def run_phase(script: str | os.PathLike, phase: str, argv: Sequence[str]) -> dict:
    """Run `script --phase NAME` in a process of its own (its peak RSS and page cache its
    own, and what one phase leaks cannot slow the next) and return the dict it served."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(script), *argv, "--phase", phase,
                        "--phase-out", out.name], check=True)
        return json.loads(Path(out.name).read_text())


def serve_phase(args: argparse.Namespace, phases: Mapping[str, Callable[..., dict]]) -> bool:
    """In a child started by run_phase: run the phase asked for, write its dict, and say
    so; in the parent: False."""
    if not getattr(args, "phase", None):
        return False
    Path(args.phase_out).write_text(json.dumps(phases[args.phase](args), default=str))
    return True


def fio_layout(path: str | os.PathLike, nbytes: int) -> None:
    """Write `nbytes` to `path` with fio (O_DIRECT, io_uring): a file for fio jobs to read,
    or to overwrite in place (O_DIRECT writes that extend a file are slow on ext4)."""
    subprocess.run(["fio", "--name=prep", f"--filename={path}", "--rw=write",
                    f"--size={nbytes}", "--ioengine=io_uring", "--direct=1", "--bs=4M",
                    "--iodepth=8", "--output-format=json"], check=True, capture_output=True)
