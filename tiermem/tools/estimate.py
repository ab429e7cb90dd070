"""`tiermem plan`'s step time: an NVMe floor and an update floor, and which one dominates.

A step's reads, update and write-backs run as a pipeline (reads ahead, writes
behind), so in steady state opt.step() takes about the larger of the two floors:
the NVMe floor (bytes read and written per drive at the probe's rates) and the
update floor (the elements updated on the CPU times the kernel's cost per element,
measured here on a small tensor or given). Gradients, the forward and backward
passes, and pipeline fill are not counted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from tiermem.config import Settings
from tiermem.kernels.adam import adam_update
from tiermem.sizes import format_count, format_size
from tiermem.swap.paths import check_paths
from tiermem.tools.optimizers import make_optimizer
from tiermem.tools.stress import DTYPES, Plan

MEASURE_ELEMENTS = 4_000_000  # 64 MB of fp32 tensors, past the caches, allocated once
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class UpdateCost:
    """The CPU update's cost per parameter, and where the figure comes from."""

    ns_per_param: float
    kernel: str
    source: str


def kernel_for(settings: Settings) -> str:
    """The kernel the CPU update of a plain torch Adam/AdamW runs under these settings."""
    o = settings.optimizer
    if o.state_dtype != "fp32" or o.kernel in ("native", "auto"):
        # bf16 state always runs tiermem's native kernel; auto picks it for a CPU step
        return "native"
    # match: what a plain (unfused, foreach unset) torch optimizer runs on CPU tensors
    return "fused" if o.kernel == "fused" else "single_tensor"


def measure_update(settings: Settings, dtype: str, *, numel: int = MEASURE_ELEMENTS,
                   repeats: int = 3) -> UpdateCost | None:
    """Time the CPU update kernel these settings pick on `numel` elements (the best of
    `repeats` runs after a warm-up); nothing else is allocated. None for a state dtype
    this measurement does not know (the plan then asks for --update-ns)."""
    kernel = kernel_for(settings)
    o = settings.optimizer
    moments = MOMENT_DTYPES.get(o.state_dtype)
    if moments is None:
        return None
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).to(DTYPES[dtype])
    if grad.dtype != torch.float32 and kernel != "native":
        grad = grad.float()  # the pipeline upcasts into a scratch area for torch's kernels
    exp_avg = torch.zeros(numel, dtype=moments)
    exp_avg_sq = torch.zeros(numel, dtype=moments)
    weights_out = ([torch.empty(numel, dtype=DTYPES[dtype])]
                   if kernel == "native" and dtype != "fp32" else None)
    extra = {}
    if o.state_dtype != "fp32":
        extra = dict(rounding=o.state_rounding, seeds=[1], offsets=[0])
    step = torch.tensor(0.0)
    best = float("inf")
    for i in range(repeats + 1):
        step += 1
        t0 = time.perf_counter()
        adam_update(kernel=kernel, params=[param], grads=[grad], exp_avgs=[exp_avg],
                    exp_avg_sqs=[exp_avg_sq], max_exp_avg_sqs=[], steps=[step], lr=1e-3,
                    beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                    maximize=False, decoupled_weight_decay=True, weights_out=weights_out,
                    **extra)
        if i:  # the first run pays for page faults and thread start-up
            best = min(best, time.perf_counter() - t0)
    return UpdateCost(best / numel * 1e9, kernel,
                      f"measured here on {format_count(numel)} elements, "
                      f"{torch.get_num_threads()} threads")


PLAIN_ELEMENTS = 1 << 20  # a 1024 x 1024 matrix: whole-parameter steps cost by shape too


def measure_plain_update(spec: str, *, numel: int = PLAIN_ELEMENTS,
                         repeats: int = 3) -> UpdateCost:
    """Time the plain optimizer `spec`'s own step in memory on one fp32 square matrix of
    about `numel` elements (the best of `repeats` steps after a first one, which makes the
    state): what every optimizer but Adam runs per partition, torch's functions on the
    record's views or the optimizer's step() on whole parameters. A whole-parameter
    step's cost is not linear in the elements (SOAP's eigendecompositions every few
    steps): the figure is this matrix's."""
    side = math.isqrt(numel)
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(side, side, generator=gen).requires_grad_()
    grad = torch.randn(side, side, generator=gen)
    opt = make_optimizer(spec, [param], 1e-4)
    best = float("inf")
    for i in range(repeats + 1):
        param.grad = grad.clone()
        t0 = time.perf_counter()
        opt.step()
        if i:  # the first step makes the state and pays for its page faults
            best = min(best, time.perf_counter() - t0)
    return UpdateCost(best / (side * side) * 1e9, f"{type(opt).__name__}'s own step",
                      f"measured here on a {side} x {side} matrix, "
                      f"{torch.get_num_threads()} threads")


def nvme_drives(settings: Settings) -> tuple[int, list[str]]:
    """Distinct devices under the swap paths (stripes on one device share its rate), and
    the warnings naming swap paths that share one (the ones `tiermem validate` prints)."""
    report = check_paths(settings.swap.paths)
    drives = len({c.device for c in report.checks if c.device is not None}) or 1
    return drives, list(report.warnings)


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.1 else f"{s * 1e3:.3g} ms"


def estimate_step(plan: Plan, settings: Settings, *, read_gbps: float | None,
                  write_gbps: float | None, update: UpdateCost | None,
                  drives: int | None = None) -> list[str]:
    """The lines `tiermem plan` prints about the step time (see the module docstring)."""
    out = []
    nvme = plan.tiers["nvme"]
    io = None
    if nvme:
        p = settings.pipeline
        # With zigzag the partitions still in the buffers from the last step need no read,
        # and with deferred write-back (scratch durability, the zig-zag order kept) they
        # were not written either: the step updates them again where they are.
        skipped = min(nvme, p.buffer_count * p.partition_size) if p.zigzag else 0
        deferred = settings.defers_writes and not p.overlap_backward
        reads, writes = nvme - skipped, nvme - (skipped if deferred else 0)
        shared: list[str] = []
        if not drives:
            drives, shared = nvme_drives(settings)
        out.append(f"NVMe per step: read {format_size(reads)}, write {format_size(writes)}, "
                   f"over {drives} drive(s)")
        out += [f"warning: {w}" for w in shared]
        if read_gbps and write_gbps:
            io = (reads / (read_gbps * 1e9) + writes / (write_gbps * 1e9)) / drives
            out.append(f"NVMe floor: {_seconds(io)} (at {read_gbps:.3g} GB/s read and "
                       f"{write_gbps:.3g} GB/s write per drive)")
        else:
            out.append("NVMe floor: unknown: measure the rates with `tiermem probe --json "
                       "probe.json`, then give --probe probe.json (or --read-gbps/--write-gbps)")
    else:
        out.append("no optimizer state on NVMe: a step does no NVMe I/O")
    if plan.weights_tier == "nvme":
        # weights read for forward and again (at most) for backward and by the step, grads
        # written and read back, the updated weights written
        out.append(f"weights and grads on NVMe per iteration: read "
                   f"{format_size(3 * plan.weights + plan.grads)}, write "
                   f"{format_size(plan.weights + plan.grads)} (forward, backward and the step; "
                   "not in the figures below)")
    compute = None
    # state_per_param is fractional for factored state (Adafactor), 0 for none (plain SGD)
    on_cpu = (round((plan.tiers["host"] + nvme) / plan.state_per_param)
              if plan.state_per_param else 0)
    if settings.optimizer.step_device == "device":
        out.append("update floor: not estimated (optimizer.step_device device updates on the "
                   "GPU; the host<->device copies are not counted either)")
    elif update is None and on_cpu:
        what = (f"optimizer.state_dtype {settings.optimizer.state_dtype}"
                if plan.optimizer in ("adam", "adamw") else f"optimizer {plan.optimizer}")
        out.append(f"update floor: not measured for {what}; give --update-ns (ns per "
                   "parameter)")
    elif update is not None and on_cpu:
        compute = on_cpu * update.ns_per_param * 1e-9
        out.append(f"update floor: {_seconds(compute)} ({on_cpu:,} parameters updated on the "
                   f"CPU at {update.ns_per_param:.3g} ns/param, kernel {update.kernel}, "
                   f"{update.source})")
    if io is None and compute is None:
        return out
    if io is None and nvme:
        out.append(f"estimated opt.step() time >= {_seconds(compute)} (update floor; the "
                   "NVMe floor is unknown)")
        return out
    floors = {"NVMe": io or 0.0, "update": compute or 0.0}
    bound = max(floors, key=floors.get)
    other = "update" if bound == "NVMe" else "NVMe"
    ratio = floors[bound] / floors[other] if floors[other] else float("inf")
    why = (f"{ratio:.2g}x the {other} floor, which overlaps with it" if ratio != float("inf")
           else "the only floor estimated")
    out.append(f"estimated opt.step() time ~{_seconds(floors[bound])}: {bound}-bound ({why}; "
               "gradients, forward and backward not counted)")
    return out
