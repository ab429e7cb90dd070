"""Third-party optimizers on tiermem's generic path: the tiered step against the plain one.

The generic path runs an optimizer's own step() on a shadow holding one partition of
whole parameters at a time, its state (lists of tensors, tensor subclasses included)
rebuilt around the record's views. What that costs is measured here against the plain
optimizer on the same model in the same run, with the state in the host tier and on
NVMe. Each optimizer runs on three copies of one synthetic model (--matrices square
fp32 matrices of --dim, and a bias vector each, with fixed gradients): plain, tiered
with every record in host memory, and tiered with every record on NVMe. After two
warm-up steps (SOAP's first step only sets up its preconditioners; torchao compiles its
step), each of --rounds rounds times a block of --steps steps of each of the three, in a
shuffled order (the machine's drift hits all alike); an NVMe block ends once its
write-backs have landed (flush), so every byte it moved is inside its time. The table
gives each median block's time per step and its ratio to the plain one (median of the
rounds' paired ratios), and the state's bytes per parameter on NVMe.

SOAP runs with precondition_frequency --steps, so that every block holds exactly one of
its eigenbasis updates. Optimizers whose package is not installed are skipped, named.

Usage: python bench/generic.py [--optimizers soap,lion,torchao_adamw8bit,bnb_adamw8bit]
       [--matrices 8] [--dim 1024] [--rounds 5] [--steps 4] [--quick] [--json out.json]
"""

from __future__ import annotations

import contextlib
import importlib
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (add_pipeline_args, offload_config, parser, run_header,  # noqa: E402
                      save, settings, show_table, shuffled_rounds)

# name -> (module, class, constructor arguments; "steps" is replaced by --steps)
OPTIMIZERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "soap": ("pytorch_optimizer", "SOAP", {"lr": 1e-3, "precondition_frequency": "steps"}),
    "lion": ("lion_pytorch", "Lion", {"lr": 1e-4, "weight_decay": 0.1}),
    "torchao_adamw8bit": ("torchao.optim", "AdamW8bit", {"lr": 1e-3}),
    "bnb_adamw8bit": ("bitsandbytes.optim", "AdamW8bit", {"lr": 1e-3}),
}
SETUPS = ("plain", "host", "nvme")


def model(matrices: int, dim: int, seed: int = 0) -> list:
    """Square fp32 matrices and a bias vector each, with fixed gradients."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(matrices):
        for shape in ((dim, dim), (dim,)):
            p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
            p.grad = torch.randn(shape, generator=g) * 1e-3
            params.append(p)
    return params


def make(name: str, params: list, steps: int):
    module, cls, kw = OPTIMIZERS[name]
    kw = {k: (steps if v == "steps" else v) for k, v in kw.items()}
    return getattr(importlib.import_module(module), cls)(params, **kw)


def measure(name: str, args) -> dict[str, Any]:
    import tiermem

    models = {s: model(args.matrices, args.dim) for s in SETUPS}  # the same values each
    n = sum(p.numel() for p in models["plain"])
    opts = {s: make(name, models[s], args.steps) for s in SETUPS}
    state = args.matrices * args.dim * (args.dim + 1) * 64  # generous: SOAP keeps ~24 B/param
    with contextlib.ExitStack() as stack:
        handles = {}
        for s, host in (("host", state), ("nvme", 0)):
            cfg = offload_config(args, host=host)  # one swap dir: a run directory each
            with contextlib.redirect_stderr(io.StringIO()):  # the memlock warning, once
                handles[s] = stack.enter_context(
                    tiermem.offload(opts[s], cfg, name=f"bench-generic-{name}-{s}"))

        def block(s: str) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    opts[s].step()
                if s != "plain":  # every write-back of these steps landed
                    handles[s].offloaded.tiers.flush()
                return (time.perf_counter() - t0) / args.steps
            return run

        runs = {s: block(s) for s in SETUPS}
        for _ in range(2):  # warm-up: set-up steps, compilation, fresh records written
            for s in SETUPS:
                opts[s].step()
        times = shuffled_rounds(runs, args.rounds)
        assert all(p.grad is not None for m in models.values() for p in m)
        on_disk = handles["nvme"].plan()["state_bytes"]["nvme"]
        for h in handles.values():
            h.discard()
    out: dict[str, Any] = {"params": n, "nvme_bytes_per_param": on_disk / n}
    for s in SETUPS:
        out[s] = {"step": statistics.median(times[s]), "steps": times[s]}
        if s != "plain":
            out[s]["ratio"] = statistics.median(
                a / b for a, b in zip(times[s], times["plain"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, json_name="generic.json",
               quick={"matrices": 2, "dim": 128, "rounds": 2, "steps": 2})
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    p.add_argument("--matrices", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    add_pipeline_args(p, swap_dir="/tmp/tiermem-bench-generic", partition_size="64MiB",
                      buffers=4, prefetch=2, kernels=("auto", "match", "fused"))
    p.set_defaults(kernel="auto")
    args = p.parse_args(argv)
    if getattr(args, "quick", False):
        for k, v in p.quick.items():
            setattr(args, k, v)
    names = [n for n in args.optimizers.split(",") if n]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        p.error(f"unknown optimizers {unknown}; known: {', '.join(OPTIMIZERS)}")
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in names:
        module = OPTIMIZERS[name][0]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            skipped[name] = f"{module} is not installed ({exc})"
            continue
        results[name] = measure(name, args)
    rows = [[name, f"{r['plain']['step'] * 1e3:.1f}", f"{r['host']['step'] * 1e3:.1f}",
             f"{r['host']['ratio']:.2f}", f"{r['nvme']['step'] * 1e3:.1f}",
             f"{r['nvme']['ratio']:.2f}", f"{r['nvme_bytes_per_param']:.2f}"]
            for name, r in results.items()]
    n = next(iter(results.values()))["params"] if results else 0
    table = show_table(["optimizer", "plain ms/step", "host tier ms/step", "/ plain",
                "NVMe ms/step", "/ plain", "NVMe B/param"], rows,
               title=f"the generic path, {n / 1e6:.2f}M fp32 parameters, {args.steps} steps "
                     f"a block, median of {args.rounds} rounds (ratios paired)")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    save(args.json, run_header("generic", argv), settings=settings(args), results=results,
         skipped=skipped, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
