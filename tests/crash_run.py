"""A small crash-consistent training run that kills itself (SIGKILL) at a chosen point.

Run as a script by tests/test_crash.py:

    python crash_run.py SWAP BACKEND POINT:N STEPS [MODEL_DTYPE [STATE_DTYPE [GRADS [MASTER [PARAMS]]]]]

GRADS: "synthetic" (default: set from a seeded generator) or "overlap" (a real
backward with pipeline.overlap_backward, so records are written during backward).
MASTER: optimizer.master_weights (fp32 by default; kahan and none with a bf16 or fp16
model and any state dtype, whose records then keep the weights). PARAMS: parameters.offload
(none by default; host or nvme put the weights and grads in the parameter tier, whose
gradients come from a real backward: GRADS "backward").

POINT is where the N-th (1-based) event of its kind sends SIGKILL:
  write-before   before a swap record write is issued
  write-after    right after it is issued (the write is in flight)
  sync           before the swap files are flushed for a commit
  manifest-tmp   after the new manifest is written and fsynced, before its rename
  manifest-renamed  after the rename, before the directory is fsynced
  after-step     after optimizer.step() number N returned
Setup (the step-0 commit) writes and commits before step 1. The run prints
"begin k" (flushed) before step k, so the test knows how far it got.

The model, gradients and config are shared with the test, which computes the
reference trajectory with a plain torch.optim.AdamW.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

MODEL_SEED = 0
LR = 1e-2


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    m = torch.nn.Sequential(torch.nn.Linear(32, 200), torch.nn.Linear(200, 160),
                            torch.nn.Linear(160, 24))
    return m.to(dtype)


def set_grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def backward_grads(model: torch.nn.Module, step: int) -> None:
    """Gradients of step `step` from a real forward and backward on a seeded batch."""
    g = torch.Generator().manual_seed(2000 + step)
    dtype = next(model.parameters()).dtype
    x = torch.randn(16, 32, generator=g).to(dtype)
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def crash_config(swap: str, backend: str, state_dtype: str = "fp32",
                 master_weights: str = "fp32") -> dict:
    """Mixed placement (one host-tier record, the rest on NVMe), tiny partitions."""
    # no kernel reproduces torch's bitwise with bf16/int8 moments or without a master
    if state_dtype != "fp32" or master_weights != "fp32":
        cfg = crash_config(swap, backend)
        cfg["optimizer"] = {"kernel": "native", "state_dtype": state_dtype,
                            "master_weights": master_weights}
        return cfg
    return {"swap": {"paths": [swap], "durability": "crash_consistent"},
            "io": {"backend": backend, "block_size": "16KiB", "queue_depth": 8},
            "tiers": {"host": {"capacity": "160KiB"}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 1},
            "optimizer": {"kernel": "match"}}


def run_killed(swap, backend: str, spec: str, steps: int, *extra: str) -> list[str]:
    """Run this script as a child (from a test) and return the words it printed; it must
    have died of the SIGKILL it sent itself at `spec`."""
    from zygote import run_python  # forked with torch imported (tests/zygote.py)

    proc = run_python(__file__, swap, backend, spec, steps, *extra, timeout=120)
    assert proc.returncode == -9, f"child was not killed at {spec}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout.split()


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, n: int) -> None:
    """Wrap the function where `point` happens so that its n-th call kills the process."""
    import tiermem.swap.manifest
    import tiermem.swap.store

    count = [0]

    def hit() -> bool:
        count[0] += 1
        return count[0] == n

    if point in ("write-before", "write-after"):
        real_write = tiermem.swap.store.SwapStore.write

        def write(self, part, buf, **kw):
            fire = hit()
            if fire and point == "write-before":
                _die()
            req = real_write(self, part, buf, **kw)
            if fire:
                _die()
            return req
        tiermem.swap.store.SwapStore.write = write
    elif point == "sync":
        real_sync = tiermem.swap.store.SwapStore.sync

        def sync(self):
            if hit():
                _die()
            return real_sync(self)
        tiermem.swap.store.SwapStore.sync = sync
    elif point in ("manifest-tmp", "manifest-renamed"):
        real_replace = os.replace

        def replace(src, dst, *a, **kw):
            fire = str(dst).endswith("manifest.json") and hit()
            if fire and point == "manifest-tmp":
                _die()
            real_replace(src, dst, *a, **kw)
            if fire:
                _die()
        tiermem.swap.manifest.os.replace = replace  # the os module: this process only
    elif point != "after-step":
        raise SystemExit(f"unknown kill point {point!r}")


def main(swap: str, backend: str, spec: str, steps: int, dtype: str = "fp32",
         state_dtype: str = "fp32", grads: str = "synthetic", master: str = "fp32",
         params: str = "none") -> None:
    import tiermem

    point, n = spec.split(":")
    _arm(point, int(n))
    model = make_model({"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32))
    opt = make_optimizer(model)
    cfg = crash_config(swap, backend, state_dtype, master)
    cfg["pipeline"]["overlap_backward"] = grads == "overlap"
    cfg["parameters"] = {"offload": params}
    with tiermem.offload(opt, cfg, model=model):
        for k in range(1, steps + 1):
            print(f"begin {k}", flush=True)
            if grads in ("overlap", "backward"):
                backward_grads(model, k)  # the worker updates and writes during it
            else:
                set_grads(model, k)
            opt.step()
            if point == "after-step" and k == int(n):
                _die()
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
