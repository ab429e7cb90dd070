"""`tiermem stress`: train a synthetic model through tiermem.offload and check every step.

Before the first step it prints the memory plan and refuses one that cannot
fit. With --verify, a seeded sample of partitions (all of them when there are
few) is recomputed each step from copies taken just before the step, with the
same kernel, in memory, and compared bit for bit.
"""

from __future__ import annotations

import json
import math
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tiermem.config import Settings, swap_dir
from tiermem.context import Offload, offload
from tiermem.errors import TierMemError
from tiermem.kernels.adam import adam_update, kernel_matching
from tiermem.optim.rules.adam import MOMENTS
from tiermem.partition import QUANT_BLOCK, Partition
from tiermem.sizes import format_size
from tiermem.swap.paths import check_paths
from tiermem.tools.synthetic import SyntheticModel, build_model, fill_synthetic_grads
from tiermem.sysinfo import available_memory, free_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BATCH, SEQ = 2, 64
VERIFY_ALL_UP_TO = 8  # partitions; above this a sample is checked each step
VERIFY_SAMPLE = 4


class PlanError(TierMemError, ValueError):
    """The run cannot fit on this machine; the message says which part overflows."""


# -- the plan ---------------------------------------------------------------------


@dataclass
class Plan:
    params: int
    dtype: str
    weights: int
    grads: int
    state: int
    state_per_param: float
    tiers: dict[str, int]
    pinned: int
    swap: int
    activations: int
    host_need: int
    host_available: int
    disk_free: int

    def lines(self) -> list[str]:
        f = format_size
        return [
            f"model: {self.params:,} parameters, {self.dtype}",
            f"weights {f(self.weights)} + grads {f(self.grads)} + optimizer state "
            f"{f(self.state)} ({self.state_per_param:.4g} B/param)",
            "optimizer state per tier: " + ", ".join(f"{k} {f(v)}" for k, v in self.tiers.items()),
            f"pinned host memory {f(self.pinned)}, swap {f(self.swap)} "
            f"(free on disk {f(self.disk_free)})",
            f"host memory needed {f(self.host_need)} of {f(self.host_available)} available "
            f"(activations ~{f(self.activations)})",
        ]


def make_plan(params: int, dtype: str, settings: Settings, *, synthetic_grads: bool,
              hidden: int, layers: int) -> Plan:
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    per_param = state_bytes_per_param(dtype, settings)
    state = math.ceil(params * per_param)
    gpu = min(state, settings.tiers.gpu.capacity)
    host = min(state - gpu, settings.tiers.host.capacity)
    nvme = state - gpu - host
    buffers = settings.pipeline.buffer_count * settings.pipeline.partition_size if nvme else 0
    activations = 0 if synthetic_grads else BATCH * SEQ * hidden * max(1, layers) * 24 * 4
    weights = grads = params * itemsize
    path = swap_dir(settings)
    return Plan(params, dtype, weights, grads, state, per_param,
                {"gpu": gpu, "host": host, "nvme": nvme}, host + buffers, nvme, activations,
                weights + grads + host + buffers + activations, available_memory(),
                _free_disk(path))


def state_bytes_per_param(dtype: str, settings: Settings) -> float:
    """Record bytes per parameter of Adam: two moments (4 bytes each; 2 with
    optimizer.state_dtype bf16; 1 + 4/256 for the block scales with int8), plus what a
    low-precision model keeps of its weight (optimizer.master_weights: an fp32 master 4,
    a bf16 Kahan term 2, none 0)."""
    o = settings.optimizer
    per = 2 * {"fp32": 4, "bf16": 2, "int8": 1 + 4 / QUANT_BLOCK}[o.state_dtype]
    if dtype != "fp32":
        per += {"fp32": 4, "kahan": 2, "none": 0}[o.master_weights]
    return per


def _free_disk(path: str) -> int:
    import os
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return free_bytes(path or "/")


def estimate_step(plan: Plan, settings: Settings, read_gbps: float | None,
                  write_gbps: float | None) -> list[str]:
    """What the NVMe tier costs per step at the given rates (a floor on the step time: the
    Adam arithmetic overlaps with the transfers, and gradients are not counted)."""
    nvme = plan.tiers["nvme"]
    if not nvme:
        return ["no optimizer state on NVMe: a step does no NVMe I/O"]
    p = settings.pipeline
    # With zigzag the partitions still in the buffers from the last step need no read.
    skipped = min(nvme, p.buffer_count * p.partition_size) if p.zigzag else 0
    reads, writes = nvme - skipped, nvme
    report = check_paths(settings.swap.paths)
    drives = len({c.device for c in report.checks if c.device is not None}) or 1
    out = [f"NVMe per step: read {format_size(reads)}, write {format_size(writes)}, over "
           f"{drives} drive(s)"]
    if not read_gbps or not write_gbps:
        return out + ["no NVMe rates: measure them with `tiermem probe --json probe.json`, "
                      "then give --probe probe.json (or --read-gbps/--write-gbps)"]
    seconds = (reads / (read_gbps * 1e9) + writes / (write_gbps * 1e9)) / drives
    return out + [f"estimated opt.step() time >= {seconds:.3g} s (NVMe-bound, at "
                  f"{read_gbps:.3g} GB/s read and {write_gbps:.3g} GB/s write per drive; the "
                  "arithmetic overlaps with it)"]


def check_plan(plan: Plan) -> None:
    """Raise PlanError naming the tier that overflows and by how much."""
    if plan.tiers["gpu"] and not torch.cuda.is_available():
        raise PlanError("the plan puts optimizer state on the gpu tier but no CUDA device "
                        "is available; set tiers.gpu.capacity: 0")
    if plan.host_need > plan.host_available:
        raise PlanError(
            f"host memory overflows by {format_size(plan.host_need - plan.host_available)}: "
            f"weights {format_size(plan.weights)} + grads {format_size(plan.grads)} + host "
            f"tier and buffers {format_size(plan.pinned)} + activations "
            f"{format_size(plan.activations)} > {format_size(plan.host_available)} available. "
            "Offloading the optimizer state does not shrink weights, gradients or "
            "activations: use fewer parameters, lower tiers.host.capacity, or "
            "--synthetic-grads to skip the forward pass.")
    if plan.swap > plan.disk_free:
        raise PlanError(f"the nvme tier overflows by {format_size(plan.swap - plan.disk_free)}: "
                        f"{format_size(plan.swap)} of swap, {format_size(plan.disk_free)} free "
                        "on the swap path")


# -- verification -----------------------------------------------------------------


@dataclass
class Mismatch:
    step: int
    partition: int
    tier: str
    tensor: str
    max_abs_diff: float

    def __str__(self) -> str:
        return (f"step {self.step}: partition {self.partition} ({self.tier} tier) {self.tensor} "
                f"differs from the in-memory reference (max |diff| {self.max_abs_diff:.3g})")


@dataclass
class Verifier:
    """Recomputes sampled partitions in memory and compares them bit for bit."""

    tm: Offload
    seed: int = 0
    checked: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    _pending: list[tuple[Partition, dict]] = field(default_factory=list)

    def sample(self, step: int) -> list[Partition]:
        parts = self.tm.offloaded.parts
        if len(parts) <= VERIFY_ALL_UP_TO:
            return list(parts)
        rng = random.Random(self.seed * 7919 + step)
        by_tier: dict[str, list[Partition]] = {}
        for p in parts:
            by_tier.setdefault(p.tier, []).append(p)
        picked: dict[int, Partition] = {}
        for ps in by_tier.values():  # at least one per tier in use
            p = rng.choice(ps)
            picked[p.id] = p
        while len(picked) < min(VERIFY_SAMPLE, len(parts)):
            p = rng.choice(parts)
            picked[p.id] = p
        return sorted(picked.values(), key=lambda p: p.id)

    def before(self, step: int) -> None:
        """Copy the sampled partitions' records, weights and grads, and compute the reference."""
        off = self.tm.offloaded
        self._pending = []
        for part in self.sample(step):
            taken: dict[str, torch.Tensor] = {}

            with off.tiers.record(part, write=False) as (views, fresh):
                for k, v in views.items():
                    taken[k] = v.clone()
            if fresh:  # a never-written record starts as the rule builds it
                off.rule.init(part, taken)
            self._pending.append((part, self._reference(part, taken)))

    def _reference(self, part: Partition, rec: dict[str, torch.Tensor]) -> dict:
        off = self.tm.offloaded
        group = off.opt.param_groups[part.group]
        lists: dict[str, list] = {k: [] for k in ("params", "grads", "steps", *MOMENTS)}
        weights = []
        pos = 0
        for s in part.segments:
            sl = slice(pos, pos + s.length)
            pos += s.length
            p = s.param
            cur = p.detach().reshape(-1)[s.start: s.start + s.length].clone()
            weights.append((s, cur))
            if p.grad is None:
                continue
            g = p.grad.reshape(-1)[s.start: s.start + s.length].float().clone()
            lists["params"].append(rec["master"][sl] if "master" in rec else cur)
            lists["grads"].append(g)
            lists["steps"].append(off.steps[s.index] + 1)
            for k in MOMENTS:
                if k in rec:
                    lists[k].append(rec[k][sl])
        if lists["params"] and off.settings.optimizer.state_dtype == "int8":
            self._reference_int8_state(part, rec, lists["params"], lists["steps"], group)
        elif lists["params"] and off.settings.optimizer.state_dtype == "bf16":
            self._reference_bf16_state(part, rec, lists["params"], lists["steps"], group)
        elif lists["params"]:
            kernel = off.settings.optimizer.kernel
            if kernel == "match":
                kernel = kernel_matching(group, part.segments[0].param.device)
            adam_update(kernel=kernel, params=lists["params"], grads=lists["grads"],
                        exp_avgs=lists["exp_avg"], exp_avg_sqs=lists["exp_avg_sq"],
                        max_exp_avg_sqs=lists["max_exp_avg_sq"], steps=lists["steps"],
                        lr=group["lr"], beta1=float(group["betas"][0]),
                        beta2=float(group["betas"][1]), eps=group["eps"],
                        weight_decay=group["weight_decay"], amsgrad=bool(group["amsgrad"]),
                        maximize=bool(group["maximize"]),
                        decoupled_weight_decay=bool(group.get("decoupled_weight_decay")))
        if "master" in rec:
            pos = 0
            for s, cur in weights:
                if s.param.grad is not None:
                    cur.copy_(rec["master"][pos: pos + s.length])
                pos += s.length
        return {"record": rec, "weights": weights}

    def _reference_int8_state(self, part: Partition, rec: dict[str, torch.Tensor],
                              params: list, steps: list, group: dict) -> None:
        """int8 moments: kernels.lowbit's plain-torch reference per segment, seeded as the
        pipeline seeds it; the native kernel must match it bit for bit. params: per
        stepped segment, the record's master or a copy of the model's weights (fp32, or
        bf16 with optimizer.master_weights kahan/none), updated here."""
        from tiermem.kernels.lowbit import adam_lowbit_reference
        from tiermem.kernels.native_adam import state_seed

        opt = self.tm.offloaded.settings.optimizer
        slices = {k: part.slices(k) for k in rec}
        k = 0
        for n, s in enumerate(part.segments):
            if s.param.grad is None:
                continue
            param, step, k = params[k], steps[k], k + 1
            sl = slices["exp_avg"][n]
            adam_lowbit_reference(
                param=param, grad=s.param.grad.reshape(-1)[s.start: s.start + s.length],
                **{kind: rec[kind][slices[kind][n]] for kind in (
                    "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")},
                kahan=rec["kahan"][slices["kahan"][n]] if "kahan" in rec else None,
                master="fp32" if param.dtype == torch.float32 else opt.master_weights,
                step=step, lr=group["lr"], beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]), eps=group["eps"],
                weight_decay=group["weight_decay"], maximize=bool(group["maximize"]),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay")),
                rounding=opt.state_rounding, seed=state_seed(step=step, partition=part.id),
                offset=sl.start)

    def _reference_bf16_state(self, part: Partition, rec: dict[str, torch.Tensor],
                              params: list, steps: list, group: dict) -> None:
        """bf16 moments: the native kernel per segment, rounded and seeded as the pipeline
        does (optimizer.state_rounding; the stream of (step, partition) at the element's
        record position). params: per stepped segment, the record's master or a copy of
        the fp32 weights, updated here."""
        from tiermem.kernels.native_adam import adam_fused_mixed, state_seed

        opt = self.tm.offloaded.settings.optimizer
        pos, k = 0, 0
        for s in part.segments:
            sl = slice(pos, pos + s.length)
            pos += s.length
            if s.param.grad is None:
                continue
            master, step, k = params[k], steps[k], k + 1
            adam_fused_mixed(
                master=master,
                grad=s.param.grad.reshape(-1)[s.start: s.start + s.length],
                exp_avg=rec["exp_avg"][sl], exp_avg_sq=rec["exp_avg_sq"][sl],
                max_exp_avg_sq=rec["max_exp_avg_sq"][sl] if group["amsgrad"] else None,
                step=step, lr=group["lr"], beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]), eps=group["eps"],
                weight_decay=group["weight_decay"], amsgrad=bool(group["amsgrad"]),
                maximize=bool(group["maximize"]),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay")),
                rounding=opt.state_rounding, seed=state_seed(step=step, partition=part.id),
                offset=sl.start)

    def after(self, step: int) -> None:
        """Compare each sampled partition with its reference."""
        off = self.tm.offloaded
        for part, ref in self._pending:
            with off.tiers.record(part, write=False) as (views, _):
                for k, v in views.items():
                    self._check(step, part, k, v, ref["record"][k])
            for s, expected in ref["weights"]:
                got = s.param.detach().reshape(-1)[s.start: s.start + s.length]
                self._check(step, part, f"weights of param {s.index}", got, expected)
            self.checked += 1
        self._pending = []

    def _check(self, step: int, part: Partition, name: str, got: torch.Tensor,
               want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().max().item()
            self.mismatches.append(Mismatch(step, part.id, part.tier, name, diff))


# -- the run ----------------------------------------------------------------------


@dataclass
class StressArgs:
    settings: Settings
    params: int | None = None
    layers: int | None = None
    hidden: int | None = None
    dtype: str = "fp32"
    steps: int = 3
    grad_accum: int = 1
    verify: bool = False
    synthetic_grads: bool = False
    seed: int = 0
    lr: float = 1e-4
    record_events: bool = False
    progress: bool = True


def run_stress(a: StressArgs, *, out=print) -> dict[str, Any]:
    """The whole run; returns what --json writes. Raises PlanError before allocating anything
    when the plan cannot fit."""
    from tiermem.tools.synthetic import choose_shape

    shape = choose_shape(a.params, a.layers, a.hidden)
    # Before the plan: on a path that cannot hold files the free-space figure is nonsense.
    check_paths(a.settings.swap.paths).raise_first()
    plan = make_plan(shape.params, a.dtype, a.settings, synthetic_grads=a.synthetic_grads,
                     hidden=shape.hidden, layers=shape.layers)
    for line in plan.lines():
        out(line)
    check_plan(plan)
    model = build_model(a.params, layers=a.layers, hidden=a.hidden, dtype=DTYPES[a.dtype],
                        seed=a.seed)
    out(f"synthetic model: {shape.layers} blocks of hidden {shape.hidden}, embedding "
        f"{shape.embed_rows} x {shape.hidden}, extra {shape.extra}")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    result: dict[str, Any] = {"plan": asdict(plan), "shape": asdict(shape), "steps": []}
    with offload(opt, a.settings, model=model, name="stress") as tm:
        tm.discard()  # a stress run's state is not kept
        tm.record_events(a.record_events)
        result["tiermem_plan"] = tm.plan()
        verifier = Verifier(tm, a.seed) if a.verify else None
        bar = _progress(a.steps, a.progress)
        log = a.progress and bar is None  # not a terminal: one plain line per step
        try:
            for step in range(1, a.steps + 1):
                t0 = time.perf_counter()
                _gradients(model, a, step)
                if verifier:
                    verifier.before(step)
                opt.step()
                if verifier:
                    verifier.after(step)
                opt.zero_grad(set_to_none=False)
                last = tm.last_step
                seconds = time.perf_counter() - t0
                row = {"seconds": seconds, **last.as_dict()}
                result["steps"].append(row)
                # Live: bytes and times only. GB/s are over the time transfers were in
                # flight, known once the writes land (the table at the end).
                live = (f"opt.step() {fmt_seconds(last.step_seconds)}, read "
                        f"{format_size(sum(last.read_bytes.values()))}, wrote "
                        f"{format_size(sum(last.write_bytes.values()))}, stalled "
                        f"{fmt_seconds(last.stall_seconds)}")
                if bar is not None:
                    bar.set_postfix_str(live)
                    bar.update(1)
                elif log:
                    out(f"step {step}/{a.steps}: wall {fmt_seconds(seconds)}, {live}")
        finally:
            if bar is not None:
                bar.close()
        final = tm.stats()  # flushes: io_seconds and GB/s of the last step are now known
        for row, stats in zip(result["steps"], final):
            row.update(stats)
        result["events"] = tm.events() if a.record_events else []
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if verifier:
        result["verify"] = {"partitions_checked": verifier.checked,
                            "mismatches": [str(m) for m in verifier.mismatches],
                            "ok": not verifier.mismatches}
    return result


def _gradients(model: SyntheticModel, a: StressArgs, step: int) -> None:
    if a.synthetic_grads:
        fill_synthetic_grads(model, step, a.seed)
        return
    gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
    for _ in range(a.grad_accum):
        tokens = torch.randint(0, 1 << 30, (BATCH, SEQ), generator=gen)
        (model(tokens) / a.grad_accum).backward()


def _progress(total: int, enabled: bool):
    """A tqdm bar on a terminal; None when off or when stderr is a pipe or file (a log full
    of carriage-return redraws is unreadable: run_stress prints a line per step instead)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    # tqdm's own rate is wall time per step (gradients included): say so.
    return tqdm(total=total, unit="step", dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, wall "
                           "{rate_inv_fmt}] {postfix}")


def fmt_seconds(s: float) -> str:
    """3 significant figures in s, ms or µs: a small run's times never print as 0.00."""
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s > 0:
        return f"{s * 1e6:.3g} µs"
    return "0"


def fmt_rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s" if bytes_per_s else "—"


STEP_TABLE_LEGEND = [
    "wall: the whole step (gradients + opt.step()); opt.step(): tiermem's part of it;",
    "update: Adam arithmetic; stall: opt.step() waiting on NVMe; read/write rates are over",
    "the time NVMe transfers were in flight (I/O-busy time); overlap: the share of that",
    "time hidden behind compute (— when the step did no NVMe I/O); B/param: NVMe bytes read",
    "and written per parameter (optimizer.state_dtype and master_weights set it).",
]


def step_table(rows: list[dict]) -> str:
    """The per-step table printed at the end, each column saying what it measures."""
    cols = ["step", "wall", "opt.step()", "update", "stall", "read", "written", "B/param",
            "read rate", "write rate", "overlap"]
    body = []
    for r in rows:
        rd, wr = sum(r["read_bytes"].values()), sum(r["write_bytes"].values())
        io = r.get("io_seconds", 0.0)
        body.append([str(r["step"]), fmt_seconds(r.get("seconds", r["step_seconds"])),
                     fmt_seconds(r["step_seconds"]), fmt_seconds(r["update_seconds"]),
                     fmt_seconds(r["stall_seconds"]), format_size(rd), format_size(wr),
                     f"{r['bytes_per_param']:.3g}" if "bytes_per_param" in r else "—",
                     fmt_rate(r["read_gbps"] * 1e9) if rd else "—",
                     fmt_rate(r["write_gbps"] * 1e9) if wr else "—",
                     f"{r['overlap']:.2f}" if io and (rd or wr) else "—"])
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c)
              for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines + STEP_TABLE_LEGEND)


def to_json(result: dict) -> str:
    clean = {k: v for k, v in result.items() if k != "events"}
    return json.dumps(clean, indent=2, default=str)
