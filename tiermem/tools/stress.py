"""`tiermem stress`: train a synthetic model through tiermem.offload and check every step.

Before the first step it prints the memory plan and refuses one that cannot
fit. With --verify, a seeded sample of partitions (all of them when there are
few) is recomputed each step from copies taken just before the step, in memory, and
compared bit for bit: Adam/AdamW with the same kernel, every other optimizer
(--optimizer) by its plain torch.optim class stepping the same values.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from tiermem.config import Settings, swap_dir
from tiermem.context import Offload, offload
from tiermem.errors import TierMemError
from tiermem.kernels.adam import adam_update, kernel_matching
from tiermem.optim.rules import own_values
from tiermem.optim.rules.adam import MOMENTS
from tiermem.partition import Partition, flat, flat_like
from tiermem.sizes import format_size
from tiermem.swap.paths import check_paths
from tiermem.tools.optimizers import make_optimizer, plain_reference, state_bytes, verifies_with_plain
from tiermem.tools.synthetic import (SyntheticModel, build_model, fill_synthetic_grads,
                                     param_shapes)
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
    optimizer: str = "adamw"
    # parameters.offload: where weights and grads live, and the window they are used in
    weights_tier: str = "model"
    window: int = 0
    window_need: int = 0  # the least window the largest module and partition need
    on_gpu: bool = False  # the model trains on a GPU: the window is GPU memory
    staging: int = 0  # on_gpu: pinned host buffers the window's copies go through
    # the process before the run (interpreter, torch, tiermem), measured at plan time
    baseline: int = 0
    verify: int = 0  # --verify's copies of the sampled partitions, held across the step
    # the copies are held through backward too (pipeline.overlap_backward), beside its
    # activations
    verify_in_backward: bool = False

    def lines(self) -> list[str]:
        f = format_size
        return [
            f"model: {self.params:,} parameters, {self.dtype}",
            f"weights {f(self.weights)} + grads {f(self.grads)} + optimizer state "
            f"{f(self.state)} ({self.state_per_param:.4g} B/param, {self.optimizer})",
            "optimizer state per tier: " + ", ".join(f"{k} {f(v)}" for k, v in self.tiers.items()),
            f"pinned host memory {f(self.pinned)}, swap {f(self.swap)} "
            f"(free on disk {f(self.disk_free)})",
            f"host memory needed {f(self.host_need)} of {f(self.host_available)} available "
            f"(this process now {f(self.baseline)}, activations ~{f(self.activations)}"
            + (f", verify copies {f(self.verify)}" if self.verify else "") + ")",
        ] + ([f"weights and grads on the {self.weights_tier} tier "
              f"({f(self.weights + self.grads)}), used through a "
              f"{'GPU ' if self.on_gpu else ''}window of {f(self.window)} "
              f"(needs at least {f(self.window_need)})"
              + (f", copied through {f(self.staging)} of pinned host buffers"
                 if self.on_gpu else "")]
             if self.weights_tier != "model" else [])


def make_plan(params: int, dtype: str, settings: Settings, *, synthetic_grads: bool,
              hidden: int, layers: int, optimizer: str = "adamw",
              shapes: Sequence[tuple[int, ...]] | None = None, embed_rows: int = 0,
              verify: bool = False, on_gpu: bool = False) -> Plan:
    """shapes: the model's parameter shapes (default: one flat parameter of `params`), for
    rules whose state depends on them (Adafactor's factored statistics; Muon steps 2-D
    parameters only). verify: count --verify's copies. on_gpu: the model trains on a GPU
    (weights, grads and activations there; its records keep an fp32 master; with
    parameters.offload the window is GPU memory, its copies staged through pinned host
    buffers: fetch buffers twice the window, gradient staging once).

    The host figure is what the process will hold at its peak: what it holds now, the
    weights and grads where the model keeps them (or the parameter window and its write
    buffers), the host tier and the pipeline's buffers, and the larger of the activations
    (forward and backward) and --verify's copies (held across opt.step(), after backward
    has freed the activations; with pipeline.overlap_backward taken before backward and
    held through it, so both)."""
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    # What the update rule keeps per parameter (moments, accumulators, an fp32 master for
    # a low-precision model or a crash-consistent run), from its record layout.
    state = state_bytes(optimizer, shapes or [(params,)], DTYPES[dtype], settings,
                        on_gpu=on_gpu)
    per_param = state / params if params else 0
    per_param = int(per_param) if per_param == int(per_param) else round(per_param, 6)
    gpu = min(state, settings.tiers.gpu.capacity)
    host = min(state - gpu, settings.tiers.host.capacity)
    nvme = state - gpu - host
    buffers = settings.pipeline.buffer_count * settings.pipeline.partition_size if nvme else 0
    activations = 0 if synthetic_grads or on_gpu else \
        BATCH * SEQ * hidden * max(1, layers) * 24 * 4
    weights = grads = params * itemsize
    baseline = process_rss()
    path = swap_dir(settings)
    ps = settings.parameters
    in_memory = 0 if on_gpu else weights + grads  # where the model keeps them
    staging = 0
    swap = nvme
    window_need = 0
    pinned = host + buffers
    largest = max((math.prod(s) for s in shapes), default=params) if shapes else params
    verify_bytes = _verify_bytes(state, per_param, settings.pipeline.partition_size,
                                 itemsize, largest) if verify else 0
    # with updates during backward the copies are taken before it and held through it
    verify_in_backward = verify and updates_in_backward(settings, synthetic_grads)
    if ps.offload != "none":
        # The largest module (a block's 4h x h linear, or the embedding table) and one
        # partition's parameters, weights and grads, with a page of padding and a footer
        # each. A partition opens its parameters whole: the ones it cuts at either end can
        # each be the largest.
        largest = max(4 * hidden * hidden, embed_rows * hidden, largest if shapes else 0)
        # a rule keeping no state per parameter (plain SGD) has all of them in one partition
        per_part = int(settings.pipeline.partition_size // per_param) if per_param else params
        opened = min(params, per_part + 2 * largest)
        window_need = max(largest * itemsize, 2 * opened * itemsize) + (64 << 10)
        # the window, and as much again in write buffers in flight (records.pending_limit)
        in_memory = 2 * ps.window
        if on_gpu:  # those buffers are the pinned staging, with the gradients' (the window)
            staging = in_memory = 3 * ps.window
            pinned += staging
        if ps.offload == "host":
            pinned += weights + grads
            in_memory += weights + grads
        else:
            swap += weights + grads
    return Plan(params, dtype, weights, grads, state, per_param,
                {"gpu": gpu, "host": host, "nvme": nvme}, pinned, swap, activations,
                baseline + in_memory + host + buffers
                + (activations + verify_bytes if verify_in_backward
                   else max(activations, verify_bytes)),
                available_memory(), _free_disk(path), optimizer,
                weights_tier="model" if ps.offload == "none" else ps.offload,
                window=ps.window if ps.offload != "none" else 0, window_need=window_need,
                on_gpu=on_gpu, staging=staging, baseline=baseline, verify=verify_bytes,
                verify_in_backward=verify_in_backward)


def _verify_bytes(state: int, per_param: float, partition_size: int, itemsize: int,
                  largest: int) -> int:
    """What Verifier holds at most: per sampled partition a copy of its record and of its
    parameters' weights; while one is computed, its largest parameter's weights and
    gradient whole (fetched from the tier) and its gradient slice in fp32."""
    parts = max(1, -(-state // partition_size)) if state else 1
    sample = parts if parts <= VERIFY_ALL_UP_TO else VERIFY_SAMPLE
    record = min(state, partition_size)
    per_part = min(int(record / per_param), largest) if per_param else largest
    return sample * (record + per_part * itemsize) + 2 * largest * itemsize + per_part * 4


def _status_bytes(field: str) -> int:
    """A byte figure of /proc/self/status (VmRSS, VmHWM); getrusage's peak where /proc is
    missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_rss() -> int:
    """Bytes this process holds in memory now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """The process's peak resident bytes so far (VmHWM). Not getrusage's ru_maxrss: Linux
    keeps that across execve, so a process started by a big one (a test suite) would
    report its parent's size."""
    return _status_bytes("VmHWM")


def bound_heap(threshold: int = 1 << 20) -> bool:
    """Pin glibc's mmap threshold, so that a freed tensor of `threshold` bytes or more goes
    back to the system at once. Left alone, glibc raises the threshold (up to 32 MiB) each
    time a big block is freed, and a run that churns through the model's weights module by
    module keeps every freed buffer below it in its heap: a run measured at 1.75x its plan
    held 1.2x with this. False where there is no glibc (nothing changes)."""
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_MMAP_THRESHOLD = -3
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def _free_disk(path: str) -> int:
    import os
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return free_bytes(path or "/")


def _rest(plan: Plan) -> str:
    f = format_size
    if plan.verify_in_backward:
        return (f"this process {f(plan.baseline)} + activations {f(plan.activations)} + "
                f"verify copies {f(plan.verify)} (held through backward)")
    return (f"this process {f(plan.baseline)} + the larger of activations "
            f"{f(plan.activations)} and verify copies {f(plan.verify)}")


def check_plan(plan: Plan) -> None:
    """Raise PlanError naming the tier that overflows and by how much."""
    if plan.tiers["gpu"] and not torch.cuda.is_available():
        raise PlanError("the plan puts optimizer state on the gpu tier but no CUDA device "
                        "is available; set tiers.gpu.capacity: 0")
    if plan.host_need > plan.host_available and plan.weights_tier != "model":
        raise PlanError(
            f"host memory overflows by {format_size(plan.host_need - plan.host_available)}: "
            f"the parameter window and its write buffers {format_size(2 * plan.window)} + "
            f"host tier and buffers {format_size(plan.pinned)} + {_rest(plan)} > "
            f"{format_size(plan.host_available)} available; "
            "lower parameters.window or tiers.host.capacity, or use parameters.offload: nvme")
    if plan.host_need > plan.host_available:
        raise PlanError(
            f"host memory overflows by {format_size(plan.host_need - plan.host_available)}: "
            f"weights {format_size(plan.weights)} + grads {format_size(plan.grads)} + host "
            f"tier and buffers {format_size(plan.pinned)} + {_rest(plan)} > "
            f"{format_size(plan.host_available)} available. "
            "Offloading the optimizer state does not shrink weights, gradients or "
            "activations: use fewer parameters, lower tiers.host.capacity, or "
            "--synthetic-grads to skip the forward pass.")
    if plan.window and plan.window < plan.window_need:
        raise PlanError(
            f"parameters.window {format_size(plan.window)} cannot hold the largest module and "
            f"one optimizer partition's weights and gradients (about "
            f"{format_size(plan.window_need)}): raise parameters.window or lower "
            "pipeline.partition_size")
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


def _weights_of(off: Any, p: torch.Tensor) -> torch.Tensor:
    """`p`'s weights now: from the parameter tier with parameters.offload."""
    return p.detach() if off.weights is None else off.weights.current_weight(p)


def _grad_of(off: Any, p: torch.Tensor) -> torch.Tensor | None:
    """`p`'s gradient for the coming step: from the parameter tier with parameters.offload."""
    return p.grad if off.weights is None else off.weights.gradient(p)


@dataclass
class Verifier:
    """Recomputes sampled partitions in memory and compares them bit for bit."""

    tm: Offload
    seed: int = 0
    checked: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    _pending: list[tuple[Partition, dict]] = field(default_factory=list)
    _taken: list[tuple[Partition, dict]] = field(default_factory=list)

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

    def take(self, step: int) -> None:
        """Copy the sampled partitions' records, weights, step counts and scalars now: with
        pipeline.overlap_backward, before the backward that starts their updates (the
        gradients are read after it, by before())."""
        # step() left the next step's run-ahead reads to the overlap's worker, which
        # reassigns the pipeline's buffers meanwhile (as for opt.state_dict(), tm.stats())
        self.tm.offloaded.wait_idle()
        self._taken = self._copies(step)

    def before(self, step: int) -> None:
        """Compute each sampled partition's reference from its copy (taken now, unless
        take() took it before backward) and the gradients backward left."""
        taken = self._taken or self._copies(step)
        self._taken = []
        self._pending = [(part, self._reference(part, copy)) for part, copy in taken]

    def _copies(self, step: int) -> list[tuple[Partition, dict]]:
        """The sampled partitions and their copies; the values the optimizer keeps outside
        the state (rules.own_values), copied once for all of them."""
        own = own_values(self.tm.offloaded.opt)
        return [(part, self._copy(part, own)) for part in self.sample(step)]

    def _copy(self, part: Partition, own: dict) -> dict:
        off = self.tm.offloaded
        rec: dict[str, torch.Tensor] = {}
        with off.tiers.record(part, write=False) as (views, fresh):
            for k, v in views.items():
                rec[k] = v.clone()
        if fresh:  # a never-written record starts as the rule builds it
            with (off.weights.materialised(s.param for s in part.segments)
                  if off.weights is not None else contextlib.nullcontext()):
                off.rule.init(part, rec)
        return {
            "record": rec,
            "weights": [(s, flat(_weights_of(off, s.param))[s.start: s.start + s.length]
                         .clone()) for s in part.segments],
            "steps": {s.index: off.steps[s.index].clone() for s in part.segments},
            "scalars": {s.index: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in off.latest_scalars(s.index).items()}
                        for s in part.segments},
            # the values a step changes outside the state (a group's count, MADGRAD's
            # state['k']): with pipeline.overlap_backward the step has run by before()
            "values": ({k: copy.deepcopy(v) for k, v in
                        off.opt.param_groups[part.group].items() if k != "params"}, own),
        }

    def _reference(self, part: Partition, copy: dict) -> dict:
        """What `part`'s record and weights must hold after the step, from `copy` (its
        record, weights, step counts and scalars before the step) and the gradients."""
        off = self.tm.offloaded
        rec, weights = copy["record"], copy["weights"]
        if verifies_with_plain(off.rule):
            plain_reference(off, part, rec, weights, steps=copy["steps"],
                            scalars=copy["scalars"], grad_of=lambda p: _grad_of(off, p),
                            values=copy["values"])
            return {"record": rec, "weights": weights}
        group = off.opt.param_groups[part.group]
        lists: dict[str, list] = {k: [] for k in ("params", "grads", "steps", *MOMENTS)}
        grads: dict[int, torch.Tensor] = {}  # per segment number, the gradient (if any)
        pos = 0
        for n, (s, cur) in enumerate(weights):
            sl = slice(pos, pos + s.length)
            pos += s.length
            full = _grad_of(off, s.param)
            if full is None:
                continue
            grads[n] = flat_like(full, s.param)[s.start: s.start + s.length]
            g = grads[n].float().clone()
            lists["params"].append(rec["master"][sl] if "master" in rec else cur)
            lists["grads"].append(g)
            lists["steps"].append(copy["steps"][s.index] + 1)
            for k in MOMENTS:
                if k in rec:
                    lists[k].append(rec[k][sl])
        if lists["params"] and off.rule.lowbit(lists["params"]):
            self._reference_lowbit(part, rec, lists["params"], lists["steps"], group,
                                       grads)
        elif lists["params"] and off.settings.optimizer.state_dtype == "bf16":
            self._reference_bf16_state(part, rec, lists["params"], lists["steps"], group,
                                       grads)
        elif lists["params"]:
            kernel = off.settings.optimizer.kernel
            if kernel == "match":
                kernel = kernel_matching(group, part.segments[0].param.device)
            elif kernel == "auto":
                kernel = "native" if off.runs_native(part) else "fused"
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
            for n, (s, cur) in enumerate(weights):
                if n in grads:
                    cur.copy_(rec["master"][pos: pos + s.length])
                pos += s.length
        return {"record": rec, "weights": weights}

    def _reference_lowbit(self, part: Partition, rec: dict[str, torch.Tensor],
                          params: list, steps: list, group: dict,
                          grads: dict[int, torch.Tensor]) -> None:
        """int8 moments, or bf16 weights without a master (master_weights kahan/none, any
        moments): kernels.lowbit's plain-torch reference per segment, on the streams the
        pipeline uses (optim.rules.adam.int8_segment); the native kernel must match it bit
        for bit. params: per stepped segment, the record's master or a copy of the model's
        weights (fp32, or bf16 with optimizer.master_weights kahan/none), updated here."""
        from tiermem.optim.rules.adam import int8_segment

        opt = self.tm.offloaded.settings.optimizer
        slices = {k: part.slices(k) for k in rec}
        k = 0
        for n, s in enumerate(part.segments):
            if n not in grads:
                continue
            param, step, k = params[k], steps[k], k + 1
            int8_segment(
                kernel="reference", start=s.start, param_index=s.index,
                param=param, grad=grads[n],
                **{kind: rec[kind][slices[kind][n]] if kind in rec else None for kind in (
                    "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")},
                kahan=rec["kahan"][slices["kahan"][n]] if "kahan" in rec else None,
                max_exp_avg_sq=(rec["max_exp_avg_sq"][slices["max_exp_avg_sq"][n]]
                                if "max_exp_avg_sq" in rec else None),
                master="fp32" if param.dtype == torch.float32 else opt.master_weights,
                step=step, lr=group["lr"], beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]), eps=group["eps"],
                weight_decay=group["weight_decay"], maximize=bool(group["maximize"]),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay")),
                rounding=opt.state_rounding)

    def _reference_bf16_state(self, part: Partition, rec: dict[str, torch.Tensor],
                              params: list, steps: list, group: dict,
                              grads: dict[int, torch.Tensor]) -> None:
        """bf16 moments: the native kernel per segment, rounded and seeded as the pipeline
        does (optimizer.state_rounding; the stream of (step, parameter) at the element's
        position in its parameter). params: per stepped segment, the record's master or a
        copy of the fp32 weights, updated here."""
        from tiermem.kernels.native_adam import adam_fused_mixed, state_seed

        opt = self.tm.offloaded.settings.optimizer
        pos, k = 0, 0
        for n, s in enumerate(part.segments):
            sl = slice(pos, pos + s.length)
            pos += s.length
            if n not in grads:
                continue
            master, step, k = params[k], steps[k], k + 1
            index, start = self.tm.offloaded.origin(s)
            adam_fused_mixed(
                master=master,
                grad=grads[n],
                exp_avg=rec["exp_avg"][sl], exp_avg_sq=rec["exp_avg_sq"][sl],
                max_exp_avg_sq=rec["max_exp_avg_sq"][sl] if group["amsgrad"] else None,
                step=step, lr=group["lr"], beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]), eps=group["eps"],
                weight_decay=group["weight_decay"], amsgrad=bool(group["amsgrad"]),
                maximize=bool(group["maximize"]),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay")),
                rounding=opt.state_rounding, seed=state_seed(step=step, partition=index),
                offset=start)

    def after(self, step: int) -> None:
        """Compare each sampled partition with its reference."""
        off = self.tm.offloaded
        off.wait_idle()  # the overlap's worker may be running the next step's reads ahead
        for part, ref in self._pending:
            with off.tiers.record(part, write=False) as (views, _):
                for k, v in views.items():
                    self._check(step, part, k, v, ref["record"][k])
            for s, expected in ref["weights"]:
                got = flat(_weights_of(off, s.param))[s.start: s.start + s.length]
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
    optimizer: str = "adamw"
    record_events: bool = False
    progress: bool = True


def run_stress(a: StressArgs, *, out=print) -> dict[str, Any]:
    """The whole run; returns what --json writes. Raises PlanError before allocating anything
    when the plan cannot fit."""
    from tiermem.tools.synthetic import choose_shape

    shape = choose_shape(a.params, a.layers, a.hidden)
    in_backward = updates_in_backward(a.settings, a.synthetic_grads)
    if a.verify and in_backward and a.settings.parameters.offload != "none":
        raise TierMemError(
            "--verify cannot check pipeline.overlap_backward: true with "
            f"parameters.offload: {a.settings.parameters.offload}: each update runs during "
            "backward and drops the gradients it used, so nothing is left to recompute the "
            "step from. Verify this configuration with --synthetic-grads (the same "
            "gradients handed to the tier, the updates at opt.step()), or with "
            "pipeline.overlap_backward: false (the same kernels)")
    # Before the plan: on a path that cannot hold files the free-space figure is nonsense.
    check_paths(a.settings.swap.paths).raise_first()
    bound_heap()
    plan = make_plan(shape.params, a.dtype, a.settings, synthetic_grads=a.synthetic_grads,
                     hidden=shape.hidden, layers=shape.layers, optimizer=a.optimizer,
                     shapes=param_shapes(shape), embed_rows=shape.embed_rows,
                     verify=a.verify)
    for line in plan.lines():
        out(line)
    check_plan(plan)
    # with the weights in the tiers the model is never whole in memory: built on the meta
    # device, made module by module as its weights go into their records
    model = build_model(a.params, layers=a.layers, hidden=a.hidden, dtype=DTYPES[a.dtype],
                        seed=a.seed, meta=a.settings.parameters.offload != "none")
    out(f"synthetic model: {shape.layers} blocks of hidden {shape.hidden}, embedding "
        f"{shape.embed_rows} x {shape.hidden}, extra {shape.extra}")
    opt = make_optimizer(a.optimizer, list(model.parameters()), a.lr)
    result: dict[str, Any] = {"plan": asdict(plan), "shape": asdict(shape), "steps": []}
    with offload(opt, a.settings, model=model, name="stress") as tm:
        tm.discard()  # a stress run's state is not kept
        tm.record_events(a.record_events)
        result["tiermem_plan"] = tm.plan()
        # the peak after each phase: which one raised it, when a run holds more than planned
        phases = result["peak_rss_after"] = {"build": peak_rss()}
        verifier = Verifier(tm, a.seed) if a.verify else None
        bar = _progress(a.steps, a.progress)
        log = a.progress and bar is None  # not a terminal: one plain line per step
        try:
            for step in range(1, a.steps + 1):
                t0 = time.perf_counter()
                if verifier and in_backward:
                    verifier.take(step)  # the records before backward starts updating them
                    phases[f"step {step} verify copies"] = peak_rss()
                _gradients(model, a, step, tm)
                phases[f"step {step} gradients"] = peak_rss()
                if verifier:
                    verifier.before(step)
                    phases[f"step {step} verify copies"] = peak_rss()
                opt.step()
                phases[f"step {step} opt.step()"] = peak_rss()
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
        result["param_stats"] = tm.param_stats()
        final = tm.stats()  # flushes: io_seconds and GB/s of the last step are now known
        for row, stats in zip(result["steps"], final):
            row.update(stats)
        result["events"] = tm.events() if a.record_events else []
    result["peak_rss"] = peak_rss()
    if verifier:
        result["verify"] = {"partitions_checked": verifier.checked,
                            "mismatches": [str(m) for m in verifier.mismatches],
                            "ok": not verifier.mismatches}
    return result


def updates_in_backward(settings: Settings, synthetic_grads: bool) -> bool:
    """The step's updates run during backward (pipeline.overlap_backward): --verify takes
    its copies before backward, and holds them through it. Synthetic gradients run no
    backward: their updates run at opt.step()."""
    return settings.pipeline.overlap_backward and not synthetic_grads


def _gradients(model: SyntheticModel, a: StressArgs, step: int, tm: Offload) -> None:
    weights = tm.offloaded.weights
    if a.synthetic_grads and weights is not None:
        # the same seeded gradients, handed to the parameter tier as backward's hooks would
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        for p in model.parameters():
            shape = weights.records.metas[weights.index[id(p)]]
            g = torch.empty(shape.shape, dtype=shape.dtype).normal_(0, 1e-3, generator=gen)
            weights.store_gradient(p, g)
        return
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
