"""The `tiermem` command line. Argument errors exit 2 with one line; failures exit 1."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from tiermem.errors import TierMemError
from tiermem.sizes import parse_count, parse_size


class InputError(TierMemError, ValueError):
    """A command-line input that cannot be used (exit 2, one line)."""


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
    from tiermem.config import load_config
    from tiermem.swap.paths import check_paths
    from tiermem.tools.probe import TABLE_HEAD, format_report, run_probe

    paths = [args.path] if args.path else load_config(args.config).swap.paths
    backends = None if args.backend == "auto" else [args.backend]
    text = args.json != "-"
    stripes = check_paths(paths) if len(paths) > 1 else None
    reports = []
    for path in paths:
        if text:
            print(f"probing {path}: {len(args.block_sizes) * len(args.depths)} measurements "
                  f"per backend of {args.size >> 20} MiB each", flush=True)
            print(TABLE_HEAD, flush=True)
        report = run_probe(path, size=args.size, block_sizes=args.block_sizes,
                           depths=args.depths, backends=backends,
                           progress=(lambda line: print(line, flush=True)) if text else None)
        reports.append(report)
        if text:
            print(format_report(report, table=False) + "\n", flush=True)
    if stripes is not None and text:
        for w in stripes.warnings + stripes.errors:
            print(f"stripes: {w}")
    if args.json:
        data = [r.to_json() for r in reports]
        out = json.dumps(data[0] if len(data) == 1 else data, indent=2)
        if args.json == "-":
            print(out)
        else:
            with open(args.json, "w") as f:
                f.write(out + "\n")
    return 0 if all(r.measurements for r in reports) else 1


def _count(text: str) -> int:
    """'1.5B' -> 1_500_000_000 (tiermem.sizes.parse_count), as argparse wants its errors."""
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return n


def _rate(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return x


def _optimizer(text: str) -> str:
    from tiermem.tools.optimizers import UnknownOptimizer, canonical

    try:
        return canonical(text)
    except UnknownOptimizer as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_OPTIMIZER_HELP = ("the optimizer, by name (default adamw): adamw, adam, sgd (momentum 0.9), "
                   "adagrad, rmsprop (centered, momentum 0.9), adamax, nadam, radam, adadelta, "
                   "asgd, rprop, adafactor, muon (2-D parameters), and with the thirdparty "
                   "extra lion, lamb, adan; or any torch.optim.Optimizer subclass by its "
                   "import path (bitsandbytes.optim.AdamW8bit); either with keyword "
                   "arguments: 'sgd(momentum=0.5)', "
                   "'pytorch_optimizer.SOAP(precondition_frequency=10)'")


def _model_size_given(args: argparse.Namespace, command: str) -> bool:
    """A synthetic model needs --params, or both --layers and --hidden; else say so."""
    if args.params is None and (args.layers is None or args.hidden is None):
        print(f"tiermem {command}: error: give --params, or both --layers and --hidden",
              file=sys.stderr)
        return False
    return True


def _with_param_flags(settings: Any, args: argparse.Namespace) -> Any:
    """--offload-params / --param-window over the config's parameters section."""
    import dataclasses

    ps = settings.parameters
    if args.offload_params is not None:
        ps = dataclasses.replace(ps, offload=args.offload_params)
    if args.param_window is not None:
        ps = dataclasses.replace(ps, window=args.param_window)
    return dataclasses.replace(settings, parameters=ps)
def _with_state_flags(settings, args: argparse.Namespace):
    """The config with --state-dtype / --master-weights applied (validated as the config
    keys optimizer.state_dtype and optimizer.master_weights are)."""
    from tiermem.config import load_config, as_yaml_data

    over = {k: v for k, v in (("state_dtype", args.state_dtype),
                              ("master_weights", args.master_weights)) if v is not None}
    if not over:
        return settings
    data = as_yaml_data(settings)
    data["optimizer"].update(over)
    return load_config(data)


def _model_flags(p: argparse.ArgumentParser, example: str) -> None:
    """The config and the synthetic model's size, dtype and optimizer (stress and plan)."""
    p.add_argument("--config", help="YAML config (default: built-in)")
    p.add_argument("--params", type=_count, help=f"parameter count, e.g. {example}")
    p.add_argument("--layers", type=_positive, help="transformer-like blocks")
    p.add_argument("--hidden", type=_positive, help="block width")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="model weights and grads (default fp32; the moments: --state-dtype)")
    p.add_argument("--optimizer", type=_optimizer, default="adamw", metavar="NAME",
                   help=_OPTIMIZER_HELP)
    _state_flags(p)


def _state_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"],
                   help="optimizer.state_dtype: how the moments are stored (default: the "
                        "config's)")
    p.add_argument("--master-weights", choices=["fp32", "kahan", "none"],
                   help="optimizer.master_weights of a bf16/fp16 model (kahan: a Kahan term, "
                        "none: stochastic rounding; with any --state-dtype; default: the "
                        "config's)")


def _cmd_stress(args: argparse.Namespace) -> int:
    from tiermem.config import load_config
    from tiermem.tools.stress import StressArgs, run_stress, step_table, to_json

    if not _model_size_given(args, "stress"):
        return 2
    settings = _with_param_flags(_with_state_flags(load_config(args.config), args), args)
    result = run_stress(StressArgs(
        settings=settings, params=args.params, layers=args.layers, hidden=args.hidden,
        dtype=args.dtype, steps=args.steps, grad_accum=args.grad_accum, verify=args.verify,
        synthetic_grads=args.synthetic_grads, seed=args.seed, optimizer=args.optimizer,
        record_events=bool(args.trace or args.plot), progress=not args.no_progress))
    print(step_table(result["steps"]))
    plan = result["plan"]["host_need"]
    print(f"peak RSS {result['peak_rss'] / 2**30:.2f} GiB, {result['peak_rss'] / plan:.2f}x "
          f"the plan's host figure ({plan / 2**30:.2f} GiB)")
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
    from tiermem.config import load_config, reference_markdown, to_yaml
    from tiermem.swap.paths import check_paths

    if args.reference:
        print(reference_markdown())
        return 0
    if not args.config:
        print("tiermem validate: give a config file (or --reference)", file=sys.stderr)
        return 2
    settings = load_config(args.config)  # a ConfigError is one line, exit 2 (main)
    paths = check_paths(settings.swap.paths)
    for line in paths.all_errors():
        print(f"tiermem validate: {args.config}: {line}", file=sys.stderr)
    if not paths.ok:
        return 2
    print(f"{args.config}: valid on this machine; the settings it gives, defaults included:")
    print(to_yaml(settings).rstrip())
    print("swap paths:")
    for line in paths.lines():
        print(f"  {line}")
    return 0


def _cmd_recover(args: argparse.Namespace) -> int:
    import os

    from tiermem.swap.recover import recover, run_name
    from tiermem.sizes import format_size

    run_dir, *others = [os.path.abspath(d) for d in args.dir]
    out = args.output or os.path.join(os.getcwd(), f"{run_name(run_dir)}-recovered.pt")
    info = recover(run_dir, out, *others, swap_paths=args.swap_paths)
    weights = "model weights and " if info["has_model"] else ""
    print(f"{run_dir}: step {info['step']} ({info['durability']}), {weights}optimizer state "
          f"of {info['with_state']}/{info['parameters']} parameters, "
          f"{format_size(info['bytes'])} -> {info['path']}")
    if not info["has_model"]:
        print("  (no model weights: a scratch-mode run keeps fp32 weights in the model itself)")
    if info["attributes"]:
        print(f"  values the optimizer keeps on itself, under 'optimizer_attributes' (no "
              f"state_dict() holds them; set them on the optimizer): "
              f"{', '.join(info['attributes'])}")
    if info["unkept"]:
        print(f"  not recovered (the manifest kept only their digest): "
              f"{', '.join(info['unkept'])}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from tiermem.config import load_config
    from tiermem.tools.doctor import diagnose

    report = diagnose(load_config(args.config))
    print("\n".join(report.lines()))
    return 1 if report.errors else 0


def _param_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offload-params", choices=["none", "host", "nvme"],
                   help="weights and grads in the tiers (parameters.offload; default: config)")
    p.add_argument("--param-window", type=_size, metavar="SIZE",
                   help="bytes of materialised weights at most (parameters.window)")


def _cmd_plan(args: argparse.Namespace) -> int:
    from tiermem.config import load_config
    from tiermem.tools.estimate import (UpdateCost, estimate_step, kernel_for,
                                        measure_plain_update, measure_update)
    from tiermem.tools.optimizers import choice
    from tiermem.tools.stress import PlanError, check_plan, make_plan
    from tiermem.tools.synthetic import choose_shape, param_shapes

    if not _model_size_given(args, "plan"):
        return 2
    settings = _with_param_flags(_with_state_flags(load_config(args.config), args), args)
    rates = _probe_rates(args)
    shape = choose_shape(args.params, args.layers, args.hidden)
    plan = make_plan(shape.params, args.dtype, settings, synthetic_grads=args.no_activations,
                     hidden=shape.hidden, layers=shape.layers, optimizer=args.optimizer,
                     shapes=param_shapes(shape), embed_rows=shape.embed_rows,
                     on_gpu=args.on_gpu)
    for line in plan.lines():
        print(line)
    chosen = choice(args.optimizer)
    adam = (chosen.module, chosen.cls) in (("torch.optim", "Adam"), ("torch.optim", "AdamW"))
    if args.update_ns is not None:
        update = UpdateCost(args.update_ns, kernel_for(settings) if adam else
                            f"{chosen.cls}'s own step", "given")
    elif adam:
        update = measure_update(settings, args.dtype)
    elif settings.optimizer.state_dtype == "fp32":
        # every other optimizer steps as its plain self does, per partition
        update = measure_plain_update(args.optimizer)
    else:  # refused when the offload starts: only Adam keeps other moment dtypes
        update = None
    read, write = rates
    for line in estimate_step(plan, settings, read_gbps=read, write_gbps=write, update=update):
        print(line)
    try:
        check_plan(plan)
    except PlanError as exc:
        print(f"does not fit on this machine: {exc}")
        return 1
    print("fits on this machine")
    return 0


def _probe_rates(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """(read, write) GB/s: given, or the best of a `tiermem probe --json` file."""
    read, write = args.read_gbps, args.write_gbps
    if args.probe:
        try:
            with open(args.probe) as f:
                data = json.load(f)
        except OSError as exc:
            raise InputError(f"--probe {args.probe}: {exc.strerror}") from None
        except ValueError as exc:
            raise InputError(f"--probe {args.probe}: not JSON ({exc})") from None
        data = data if isinstance(data, list) else [data]
        ms = [m for d in data if isinstance(d, dict) for m in d.get("measurements", [])]
        if not ms:
            raise InputError(f"--probe {args.probe}: no measurements in it (write it with "
                             "tiermem probe --json FILE)")
        best = min(ms, key=lambda m: 1 / m["read_gbps"] + 1 / m["write_gbps"])
        read, write = read or best["read_gbps"], write or best["write_gbps"]
    return read, write


def _runs(args: argparse.Namespace) -> list:
    from tiermem.config import load_config
    from tiermem.swap.runs import list_runs

    where = args.dirs or load_config(args.config).swap.paths
    runs = list_runs(where)
    if args.name:
        runs = [r for r in runs if r.name == args.name]
    return runs


def _cmd_ls(args: argparse.Namespace) -> int:
    runs = _runs(args)
    if not runs:
        where = ", ".join(args.dirs) if args.dirs else "the config's swap paths"
        print(f"no run directories under {where}")
    for r in runs:
        print(r.line())
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from tiermem.sizes import format_size
    from tiermem.swap.runs import remove

    doomed = {"stale", "removing"} | ({"kept", "committed"} if args.kept else set())
    freed = 0
    for r in _runs(args):
        if r.state not in doomed:
            why = ("in use" if r.state == "in use" else
                   f"{r.state} state: give --kept to remove it too")
            print(f"kept    {r.path} ({why})")
            continue
        if not args.dry_run:
            try:
                remove(r)
            except (OSError, RuntimeError) as exc:
                print(f"tiermem clean: {r.path}: {exc}", file=sys.stderr)
                continue
        freed += r.bytes
        print(f"{'would remove' if args.dry_run else 'removed'} {r.path} ({r.state}, "
              f"{format_size(r.bytes)})")
    print(f"{'would free' if args.dry_run else 'freed'} {format_size(freed)}")
    return 0


def _cmd_init_config(args: argparse.Namespace) -> int:
    import os

    from tiermem.config import shipped_configs

    shipped = shipped_configs()
    if args.list or not args.name:
        for name, path in shipped.items():
            with open(path) as f:
                first = f.readline().lstrip("# ").strip()
            print(f"{name:<12} {first}")
        return 0
    if args.name not in shipped:
        print(f"tiermem init-config: error: no shipped config {args.name!r}; one of "
              f"{', '.join(shipped)}", file=sys.stderr)
        return 2
    out = args.output or f"{args.name}.yaml"
    with open(shipped[args.name]) as f:
        text = f.read()
    if out == "-":
        print(text, end="")
        return 0
    if os.path.exists(out) and not args.force:
        print(f"tiermem init-config: error: {out} exists (give --force to overwrite)",
              file=sys.stderr)
        return 2
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}; check it with: tiermem validate {out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Argument errors: one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    import tiermem

    parser = _Parser(prog="tiermem", description="NVMe tiered memory for PyTorch optimizer "
                     "state. Argument and config errors exit 2 with one line; failures exit 1.")
    parser.add_argument("--version", action="version", version=f"tiermem {tiermem.__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    p = sub.add_parser("probe", help="check swap directories and measure their throughput")
    p.add_argument("path", nargs="?", help="swap directory (default: each of the config's swap "
                   "paths)")
    p.add_argument("--config", help="YAML config whose swap paths to probe (default: built-in)")
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
    _model_flags(s, "50M, 1.5B")
    s.add_argument("--steps", type=_positive, default=3, help="optimizer steps (default 3)")
    s.add_argument("--grad-accum", type=_positive, default=1, help="micro-batches per step")
    s.add_argument("--verify", action="store_true",
                   help="recompute sampled partitions in memory and compare bit for bit")
    s.add_argument("--synthetic-grads", action="store_true",
                   help="fill gradients from a seeded generator instead of forward/backward")
    s.add_argument("--seed", type=int, default=0,
                   help="seeds weights, tokens, gradients and the verified sample (default 0)")
    _param_flags(s)
    s.add_argument("--json", metavar="OUT", help="write plan, per-step stats, verification")
    s.add_argument("--trace", metavar="OUT.json", help="Chrome/Perfetto trace of every step")
    s.add_argument("--plot", metavar="OUT.png", help="timeline and throughput plot")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress bar (on a pipe or file: no per-step lines either)")
    s.set_defaults(func=_cmd_stress)
    v = sub.add_parser("validate", help="check a YAML config; --reference prints every key")
    v.add_argument("config", nargs="?", help="YAML config file")
    v.add_argument("--reference", action="store_true",
                   help="print the config reference (markdown) instead")
    v.set_defaults(func=_cmd_validate)
    r = sub.add_parser("recover", help="write a run directory's committed state to a torch "
                       "checkpoint file")
    r.add_argument("dir", nargs="+",
                   help="run directory (<swap path>/tiermem-<name>) with a manifest.json; of "
                        "a run under torch.distributed, any rank's (tiermem-<name>-rank<r>: "
                        "the others are looked for beside it) or every rank's")
    r.add_argument("-o", "--output", help="checkpoint file (default: ./<dir name>-recovered.pt)")
    r.add_argument("--swap-paths", nargs="+", metavar="PATH",
                   help="where the run's swap paths are now, in its swap.paths order (the "
                        "first the one DIR is under): needed for a run with several swap "
                        "paths whose directories were moved or copied since it wrote them")
    r.set_defaults(func=_cmd_recover)
    d = sub.add_parser("doctor", help="report what this machine offers tiermem (io_uring, "
                       "O_DIRECT per swap path, memlock, CPU features, torch/CUDA) with fixes")
    d.add_argument("--config", help="YAML config whose swap paths to check (default: built-in)")
    d.set_defaults(func=_cmd_doctor)
    pl = sub.add_parser("plan", help="the memory and disk plan of a model size and an estimated "
                        "step time; allocates nothing")
    _model_flags(pl, "7B")
    pl.add_argument("--no-activations", action="store_true",
                    help="leave activations out of the host-memory need")
    pl.add_argument("--probe", metavar="PROBE.json",
                    help="read/write GB/s from `tiermem probe --json` output")
    pl.add_argument("--read-gbps", type=_rate, help="NVMe read GB/s (instead of --probe)")
    pl.add_argument("--write-gbps", type=_rate, help="NVMe write GB/s (instead of --probe)")
    pl.add_argument("--on-gpu", action="store_true",
                    help="the model trains on a GPU: weights, grads and activations are "
                         "there, not in host memory (with --offload-params the window is "
                         "GPU memory, copied through pinned host buffers)")
    pl.add_argument("--update-ns", type=_rate, metavar="NS",
                    help="the update kernel's ns per parameter (default: measured now on a "
                         "64 MB tensor set)")
    _param_flags(pl)
    pl.set_defaults(func=_cmd_plan)
    for cmd, helptext, func in (
            ("ls", "list run directories under the swap paths: in use, kept, committed, "
                   "stale; what each holds", _cmd_ls),
            ("clean", "remove stale run directories (and kept/committed ones with --kept); "
                      "never one in use", _cmd_clean)):
        c = sub.add_parser(cmd, help=helptext)
        c.add_argument("dirs", nargs="*", help="swap paths to look in (default: the config's)")
        c.add_argument("--config", help="YAML config whose swap paths to look in")
        c.add_argument("--name", help="only the run of this name (tiermem.offload(name=))")
        if cmd == "clean":
            c.add_argument("--kept", action="store_true",
                           help="also remove kept and committed state (it cannot be resumed "
                                "afterwards)")
            c.add_argument("--dry-run", action="store_true", help="say what would go")
        c.set_defaults(func=func)
    i = sub.add_parser("init-config", help="write one of the shipped example configs to a file")
    i.add_argument("name", nargs="?", help="which (omit, or --list, to list them)")
    i.add_argument("-o", "--output", help="file to write (default ./NAME.yaml; '-' = stdout)")
    i.add_argument("--list", action="store_true", help="list the shipped configs")
    i.add_argument("--force", action="store_true", help="overwrite an existing file")
    i.set_defaults(func=_cmd_init_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `tiermem`: what it can do, not an error
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except Exception as exc:  # one clear line, not a traceback, for the user's mistakes
        if isinstance(exc, TierMemError):
            print(f"tiermem {args.command}: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ValueError) else 1
        if isinstance(exc, OSError) and exc.filename is not None:  # an output file, say
            print(f"tiermem {args.command}: {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
