"""The `tiermem` command line. Argument errors exit 2 with one line; failures exit 1."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from tiermem.sizes import parse_size


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 4096 or n % 4096:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a multiple of 4096 bytes, >= 4KiB")
    return n


def _sizes(text: str) -> list[int]:
    return [_size(t) for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not out or any(not 1 <= d <= 4096 for d in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each depth must be in 1..4096")
    return out


def _cmd_probe(args: argparse.Namespace) -> int:
    from tiermem.config import load_config, swap_dir
    from tiermem.tools.probe import format_report, run_probe

    path = args.path or swap_dir(load_config(args.config))
    backends = None if args.backend == "auto" else [args.backend]
    report = run_probe(path, size=args.size, block_sizes=args.block_sizes, depths=args.depths,
                       backends=backends)
    if args.json:
        text = json.dumps(report.to_json(), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print(format_report(report))
    return 0 if report.measurements else 1


def _count(text: str) -> int:
    """'1.5B' -> 1_500_000_000; K, M, B (or G), T are powers of 1000."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    t = text.strip().upper()
    try:
        n = float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 50M, 1.5B)") from None
    if n < 1 or n != int(n):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole count")
    return int(n)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return n


def _cmd_stress(args: argparse.Namespace) -> int:
    from tiermem.config import load_config
    from tiermem.tools.stress import StressArgs, run_stress, step_table, to_json

    if args.params is None and (args.layers is None or args.hidden is None):
        print("tiermem stress: error: give --params, or both --layers and --hidden",
              file=sys.stderr)
        return 2
    settings = load_config(args.config)
    result = run_stress(StressArgs(
        settings=settings, params=args.params, layers=args.layers, hidden=args.hidden,
        dtype=args.dtype, steps=args.steps, grad_accum=args.grad_accum, verify=args.verify,
        synthetic_grads=args.synthetic_grads, seed=args.seed,
        record_events=bool(args.trace or args.plot), progress=not args.no_progress))
    print(step_table(result["steps"]))
    print(f"peak RSS {result['peak_rss'] / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(result) + "\n")
    if args.trace:
        from tiermem.telemetry.trace import write_chrome_trace
        write_chrome_trace(args.trace, result["events"])
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
    if args.plot:
        from tiermem.telemetry.plot import plot_run
        plot_run(args.plot, result["events"], result["steps"])
        print(f"plot: {args.plot}")
    verify = result.get("verify")
    if verify is not None:
        if not verify["ok"]:
            for line in verify["mismatches"]:
                print(f"tiermem stress: verification failed: {line}", file=sys.stderr)
            return 1
        print(f"verified {verify['partitions_checked']} partition updates: bitwise equal to "
              "the in-memory reference")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from tiermem.config import ConfigError, load_config, reference_markdown

    if args.reference:
        print(reference_markdown())
        return 0
    if not args.config:
        print("tiermem validate: give a config file (or --reference)", file=sys.stderr)
        return 2
    try:
        settings = load_config(args.config)
    except ConfigError as exc:
        print(f"tiermem validate: {args.config}: {exc}", file=sys.stderr)
        return 2
    print(f"{args.config}: valid\n{settings}")
    return 0


def _cmd_recover(args: argparse.Namespace) -> int:
    import os

    from tiermem.swap.recover import recover
    from tiermem.sizes import format_size

    run_dir = os.path.abspath(args.dir)
    out = args.output or os.path.join(os.getcwd(),
                                      f"{os.path.basename(run_dir)}-recovered.pt")
    info = recover(run_dir, out)
    weights = "model weights and " if info["has_model"] else ""
    print(f"{run_dir}: step {info['step']} ({info['durability']}), {weights}optimizer state "
          f"of {info['with_state']}/{info['parameters']} parameters, "
          f"{format_size(info['bytes'])} -> {info['path']}")
    if not info["has_model"]:
        print("  (no model weights: a scratch-mode run keeps fp32 weights in the model itself)")
    return 0


class _Parser(argparse.ArgumentParser):
    """Argument errors: one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiermem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("probe", help="check a swap directory and measure its throughput")
    p.add_argument("path", nargs="?", help="swap directory (default: the config's first swap path)")
    p.add_argument("--config", help="YAML config whose swap path to probe (default: built-in)")
    p.add_argument("--size", type=_size, default=256 << 20, help="test file size (default 256MiB)")
    p.add_argument("--block-sizes", type=_sizes, default=[256 << 10, 1 << 20, 4 << 20],
                   help="comma-separated block sizes (default 256KiB,1MiB,4MiB)")
    p.add_argument("--depths", type=_ints, default=[8, 32],
                   help="comma-separated queue depths (default 8,32)")
    p.add_argument("--backend", choices=["auto", "io_uring", "threads"], default="auto",
                   help="measure one backend only (default: every one that works)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-' = stdout only)")
    p.set_defaults(func=_cmd_probe)
    s = sub.add_parser("stress", help="train a synthetic model through tiermem and check it")
    s.add_argument("--config", help="YAML config (default: built-in)")
    s.add_argument("--params", type=_count, help="parameter count, e.g. 50M, 1.5B")
    s.add_argument("--layers", type=_positive, help="transformer-like blocks")
    s.add_argument("--hidden", type=_positive, help="block width")
    s.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="model weights and grads (state: fp32, or bf16 moments with optimizer.state_dtype)")
    s.add_argument("--steps", type=_positive, default=3)
    s.add_argument("--grad-accum", type=_positive, default=1, help="micro-batches per step")
    s.add_argument("--verify", action="store_true",
                   help="recompute sampled partitions in memory and compare bit for bit")
    s.add_argument("--synthetic-grads", action="store_true",
                   help="fill gradients from a seeded generator instead of forward/backward")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", metavar="OUT", help="write plan, per-step stats, verification")
    s.add_argument("--trace", metavar="OUT.json", help="Chrome/Perfetto trace of every step")
    s.add_argument("--plot", metavar="OUT.png", help="timeline and throughput plot")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_cmd_stress)
    v = sub.add_parser("validate", help="check a YAML config; --reference prints every key")
    v.add_argument("config", nargs="?", help="YAML config file")
    v.add_argument("--reference", action="store_true",
                   help="print the config reference (markdown) instead")
    v.set_defaults(func=_cmd_validate)
    r = sub.add_parser("recover", help="write a run directory's committed state to a torch "
                       "checkpoint file")
    r.add_argument("dir", help="run directory (<swap path>/tiermem-<name>) with a manifest.json")
    r.add_argument("-o", "--output", help="checkpoint file (default: ./<dir name>-recovered.pt)")
    r.set_defaults(func=_cmd_recover)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # one clear line, not a traceback, for the user's mistakes
        from tiermem.errors import TierMemError
        if isinstance(exc, TierMemError):
            print(f"tiermem {args.command}: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ValueError) else 1
        raise


if __name__ == "__main__":
    sys.exit(main())
