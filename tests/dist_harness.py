"""Run a function in `world` fresh processes joined by a gloo process group, with deadlines.

Starting a rank costs time (a fresh one imports torch; tests/zygote.py forks them with it
imported), so a test module starts one group and runs all its scenarios in it
(`scenario_results`), each rank reporting, per scenario, "ok" or the traceback. A rank
that hangs is killed at the deadline; its scenarios report that instead of hanging the
suite. A rank that dies (a scenario kills it on purpose) reports through a file what it
finished before: every scenario's outcome is written there as soon as it is known, since
a killed process sends nothing.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any

PG_TIMEOUT = 60  # seconds; gloo's own bound on any collective the tests issue directly
_partial: str | None = None  # this rank's file of scenario outcomes so far


def _entry(rank: int, world: int, init: str, partial: str, module: str, fn: str, args: tuple,
           results: Any) -> None:
    import torch.distributed as dist

    global _partial
    _partial = partial
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT))
    from tiermem.kernels.vml import resolve_vml_dispatch

    resolve_vml_dispatch()  # the rank's plain torch reference runs a first sqrt too
    try:
        out = getattr(importlib.import_module(module), fn)(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()  # the report is in the pipe before the process ends
    # No destroy_process_group: after a scenario that breaks the group on purpose it could
    # wait on peers that are gone; the process ends here either way.
    os._exit(0)


def launch(world: int, module: str, fn: str, *args: Any, deadline: float = 300
           ) -> dict[int, tuple[str, Any]]:
    """fn(rank, world, *args) on every rank; {rank: ("ok", result) | ("error", traceback) |
    ("lost", {"why", "exitcode", "scenarios": outcomes it finished before})}."""
    # Forked from tests/zygote.py's server: clean processes, as spawn's, without each rank
    # importing torch again (seconds a rank on a 2-core host).
    from zygote import context

    ctx = context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "store")
        partial = [os.path.join(tmp, f"partial{r}.json") for r in range(world)]
        procs = [ctx.Process(target=_entry,
                             args=(r, world, init, partial[r], module, fn, args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, tuple[str, Any]] = {}
        import time

        end = time.monotonic() + deadline
        while len(out) < world and time.monotonic() < end:
            try:
                rank, status, value = results.get(timeout=1)
                out[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for r, p in enumerate(procs):
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
            if r not in out:
                done = {}
                if os.path.exists(partial[r]):
                    with open(partial[r]) as f:
                        done = json.load(f)
                out[r] = ("lost", {"why": f"rank {r} reported nothing (exit code {p.exitcode})",
                                   "exitcode": p.exitcode, "scenarios": done})
    return out


def scenario_results(rank: int, scenarios: dict[str, Any], *args: Any) -> dict[str, str]:
    """Run every scenario in order on this rank: {name: "ok" | traceback}."""
    out = {}
    for name, fn in scenarios.items():
        try:
            fn(rank, *args)
            out[name] = "ok"
        except BaseException:
            out[name] = traceback.format_exc()
        if _partial is not None:  # replaced whole, so a rank killed now leaves a valid file
            with open(_partial + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(_partial + ".tmp", _partial)
    return out


def run_in_dirs(rank: int, base: str, table: dict[str, Any], names: list[str]
                ) -> dict[str, str]:
    """scenario_results over `names` of `table` (name -> fn(rank, dir)), each scenario in
    its own directory under `base`, every rank starting each one together."""
    import torch.distributed as dist

    def run(name):
        def go(r):
            d = os.path.join(base, name)
            os.makedirs(d, mode=0o700, exist_ok=True)
            dist.barrier()
            table[name](r, d)
        return go

    return scenario_results(rank, {n: run(n) for n in names})
