"""What a weight edited between steps costs the next step of a low-precision model.

Where the step starts from a record's fp32 master (a bf16/fp16 model), a change made to
the model's weights since the step before is taken into the master first (one native
pass over the edited parameters, kernels/edits.py). This times the tiered step of a
bf16 (or fp16) model with every record in the host tier three ways in one run: with no
edit; after an in-place clamp of every weight that changes no value (the pass runs over
every parameter and takes nothing: the most it costs); and after a clamp that changes
one element in a thousand (the pass takes those). Each of --rounds rounds times a block
of --steps steps of each, in a shuffled order; the table gives the median block's time
per step, per parameter, and its ratio to the no-edit step (median of the rounds' paired
ratios). torch's fused AdamW stepping the same low-precision model (no master, the edits
are its weights) is shown beside, as a reference measured in the same run.

Usage: python bench/edits.py [--params 50M] [--dtype bf16|fp16] [--rounds 5] [--steps 3]
       [--quick] [--json out.json]
"""

from __future__ import annotations

import contextlib
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (parse_count, parser, run_header, save, settings,  # noqa: E402
                      show_table, shuffled_rounds)

SETUPS = ("no edit", "every weight written", "1 in 1000 changed", "torch fused, same model")
TENSOR = 1 << 22  # elements per parameter


def _model(n: int, dtype: Any) -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    params = []
    for start in range(0, n, TENSOR):
        k = min(TENSOR, n - start)
        p = torch.nn.Parameter((torch.randn(k, generator=g) * 0.02).to(dtype))
        p.grad = (torch.randn(k, generator=g) * 1e-3).to(dtype)
        params.append(p)
    return params


def measure(args) -> dict[str, Any]:
    import torch

    import tiermem

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    models = {s: _model(args.n, dtype) for s in SETUPS}
    opts = {s: torch.optim.AdamW(models[s], lr=1e-3, weight_decay=0.01,
                                 fused=s == SETUPS[-1]) for s in SETUPS}
    # whole-element changes: one element in a thousand set past the clamp below
    for p in models[SETUPS[2]]:
        p.data[::1000] = 0.5

    def edit(s: str) -> None:
        with torch.no_grad():
            if s == SETUPS[1]:
                for p in models[s]:
                    p.clamp_(-1.0, 1.0)  # (weights of 0.02 or so: no value changes)
            elif s == SETUPS[2]:
                for p in models[s]:
                    p.clamp_(-0.25, 0.25)  # the 0.5s, set again after each step
                    p[::1000] = 0.5

    with contextlib.ExitStack() as stack:
        handles = {}
        for s in SETUPS[:3]:
            cfg = {"swap": {"paths": [args.swap_dir]},
                   "tiers": {"host": {"capacity": 12 * args.n + (256 << 20)}}}
            with contextlib.redirect_stderr(io.StringIO()):  # the memlock warning, once
                handles[s] = stack.enter_context(tiermem.offload(
                    opts[s], cfg, name=f"bench-edits-{SETUPS.index(s)}"))

        def block(s: str) -> Callable[[], float]:
            def run() -> float:
                total = 0.0
                for _ in range(args.steps):
                    edit(s)  # (untimed: the user's own work)
                    t0 = time.perf_counter()
                    opts[s].step()
                    total += time.perf_counter() - t0
                return total / args.steps
            return run

        runs = {s: block(s) for s in SETUPS}
        for _ in range(2):  # warm-up: the first step writes the records
            for s in SETUPS:
                runs[s]()
        taken0 = {s: handles[s].offloaded.edits_taken for s in SETUPS[:3]}
        times = shuffled_rounds(runs, args.rounds)
        taken = {s: handles[s].offloaded.edits_taken - taken0[s] for s in SETUPS[:3]}
        for h in handles.values():
            h.discard()
    out: dict[str, Any] = {"params": args.n, "dtype": args.dtype}
    for s in SETUPS:
        out[s] = {"step": statistics.median(times[s]), "steps": times[s],
                  "ratio": statistics.median(a / b for a, b in zip(times[s],
                                                                    times[SETUPS[0]]))}
        if s in taken:
            out[s]["parameters_taken_per_step"] = taken[s] / (args.rounds * args.steps)
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, json_name="edits.json", quick={"params": "4M", "rounds": 2, "steps": 2})
    p.add_argument("--params", default="50M", help="parameters of the model (e.g. 50M)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--swap-dir", default="/tmp/tiermem-bench-edits")
    args = p.parse_args(argv)
    if getattr(args, "quick", False):
        for k, v in p.quick.items():
            setattr(args, k, v)
    args.n = parse_count(args.params)
    r = measure(args)
    rows = [[s, f"{r[s]['step'] * 1e3:.1f}", f"{r[s]['step'] / args.n * 1e9:.3f}",
             f"{r[s]['ratio']:.2f}", f"{r[s].get('parameters_taken_per_step', 0):.0f}"
             if s in SETUPS[:3] else "n/a"] for s in SETUPS]
    table = show_table(["step", "ms/step", "ns/param", "/ no edit", "parameters taken"],
                       rows, title=f"tiered AdamW step of a {args.dtype} model, "
                                   f"{args.n / 1e6:.0f}M parameters in the host tier, "
                                   f"median of {args.rounds} rounds x {args.steps} steps "
                                   "(ratios paired)")
    save(args.json, run_header("edits", argv), settings=settings(args), results=r,
         table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
