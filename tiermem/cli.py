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
    from tiermem.probe import format_report, run_probe

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiermem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
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
    v = sub.add_parser("validate", help="check a YAML config; --reference prints every key")
    v.add_argument("config", nargs="?", help="YAML config file")
    v.add_argument("--reference", action="store_true",
                   help="print the config reference (markdown) instead")
    v.set_defaults(func=_cmd_validate)
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
