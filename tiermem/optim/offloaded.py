"""OffloadedOptimizer: a torch Adam/AdamW whose state lives in tiers.

It validates the optimizer, gathers its parameters into partitions, and hooks
the optimizer *instance* (step, state_dict, load_state_dict, add_param_group)
so the user's object keeps behaving as a torch.optim.Optimizer: param_groups,
lr schedulers and zero_grad are untouched. `detach()` puts everything back.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from tiermem.config import ConfigError, Settings
from tiermem.device.lanes import CudaBackend, DeferredBackend, DeviceLanes
from tiermem.errors import TierMemError
from tiermem.kernels.adam import kernel_matching
from tiermem.swap.manifest import (read_manifest, refuse_stale_paths, scalar_from_json,
                                    value_from_json, write_manifest)
from tiermem.optim import amp
from tiermem.optim.counts import StepCounts
from tiermem.optim.edits import EditedWeights
from tiermem.optim.hooks import (Installed, changed_since, load_snapshot, load_with_hooks,
                                 run_post_hooks, run_pre_hooks, step_called)
from tiermem.optim.overlap import BackwardOverlap
from tiermem.optim.rules import AdamRule, Batch, PreparedUpdate, UpdateRule, rule_class, rule_for
from tiermem.optim.rules.nested import json_exact, value_digest
from tiermem.optim.state_io import (drop_param_state, gather, jsonable, param_entries,
                                    refuse_unkept_keys, scatter, torch_state_dict)
from tiermem.optim.threads import UpdateThreads
from tiermem.kernels.checksum import record_digest
from tiermem.kernels.edits import keep_kahan_terms, take_edits
from tiermem.kernels.vml import resolve_vml_dispatch
from tiermem.params.tier import ParamTier
from tiermem.partition import Partition, Segment, build_partitions, flat, flat_like
from tiermem.tiers.pipeline import Views
from tiermem.signals import deferred
from tiermem.telemetry.stats import StepStats, timed, update_range
from tiermem.swap.rundir import run_dirs
from tiermem.tiers.manager import Ready, TierManager
from tiermem.tiers.placement import Budgets

HISTORY = 1000  # steps of StepStats kept for tm.stats()


def scalar_to_json(value: Any) -> Any:
    """A per-parameter scalar as the manifest keeps it: numbers as they are, a 0-d tensor
    with its dtype (an fp32 value is a double JSON keeps to the last bit)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


KEPT_TENSOR = 4096  # elements: a larger tensor value goes in a manifest as its digest


def step_value_to_json(value: Any) -> Any:
    """A value a step may change outside the per-parameter state (a count in a group, one
    kept on the optimizer) as a manifest keeps it exactly, or {"unkept": ..., "digest": ...}
    where JSON cannot (a resume then refuses, naming it, unless the resumed optimizer
    holds that same value)."""
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.dim() == 0:
        return scalar_to_json(value)
    if (isinstance(value, torch.Tensor) and type(value) is torch.Tensor
            and value.numel() <= KEPT_TENSOR
            and value.device.type == "cpu" and not value.is_complex()
            and (not value.is_floating_point() or bool(torch.isfinite(value).all()))):
        # a small count kept as a 1-element tensor (MADGRAD's state['k']): its elements
        # as nested lists (floats widen to doubles exactly), which torch.tensor() takes back
        # with the shape
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple) and all(_finite_json(v) for v in value):
        return {"tuple": list(value)}
    if (type(value) is dict and all(isinstance(k, str) for k in value)
            and all(_finite_json(v) for v in value.values())):
        return {"dict": value}  # EmoNavi's loss averages in state['ema']
    if _finite_json(value):
        return value
    return {"unkept": repr(value)[:200], "digest": value_digest(value)}


def _default_json(value: Any) -> Any:
    """An optimizer's default as the manifest keeps it: jsonable's form, or its repr where
    that is no finite JSON (a default of inf that every group overrides must not stop the
    commits); recover reads only Adagrad's initial_accumulator_value, a number."""
    kept = jsonable(value)
    return kept if _finite_json(kept) else repr(value)


def _finite_json(value: Any) -> bool:
    return json_exact(value) and not (isinstance(value, float) and not math.isfinite(value))


def check_weights_supported(settings: Settings, model: torch.nn.Module | None, streams: Any,
                            resume: bool) -> None:
    """What parameters.offload needs, and what it cannot run with yet: refused, never run
    half right."""
    if model is None:
        raise ConfigError("parameters.offload", settings.parameters.offload,
                          "needs the model: pass model= to tiermem.offload(opt, config, "
                          "model=model), whose modules' hooks fetch the weights")
    if resume and settings.swap.durability != "crash_consistent":
        # A scratch run keeps no weights on disk (an fp32 model's records hold none).
        raise TierMemError("resume=True with parameters.offload needs swap.durability "
                           "crash_consistent, whose commits hold the weights; a scratch run "
                           "keeps only the optimizer state on disk")
    on_device = streams is not None or any(p.device.type == "cuda" for p in model.parameters())
    if not on_device:
        return
    # A device model's weights reach the device through pinned buffers and its grads come
    # back (tiermem/params/device.py); the step runs on the host, from the records.
    if settings.optimizer.step_device != "cpu":
        raise ConfigError("optimizer.step_device", settings.optimizer.step_device,
                          "cpu with parameters.offload on a device model: the step reads "
                          "each partition's weights and grads from the parameter tier into "
                          "host memory and updates them there (a device step is not built)")
    if settings.pipeline.overlap_backward:
        raise ConfigError("pipeline.overlap_backward", True,
                          "false with parameters.offload on a device model: updates during "
                          "backward are not built for weights on the device")
    if settings.tiers.gpu.capacity:
        raise ConfigError("tiers.gpu.capacity", settings.tiers.gpu.capacity,
                          "0 with parameters.offload on a device model: the step runs on the "
                          "host, so optimizer state kept on the device would cross for nothing")


def groups_changed(groups: Sequence[dict], sizes: Sequence[int],
                   params: Sequence[torch.Tensor]
                   ) -> tuple[list[int], list[torch.Tensor]] | None:
    """None if `groups` hold exactly `params`, `sizes[g]` of them in group g, in order;
    else the groups' sizes now and the parameters among them not in `params`."""
    now = [len(g["params"]) for g in groups]
    flat = [p for g in groups for p in g["params"]]
    if now == list(sizes) and len(flat) == len(params) and all(
            a is b for a, b in zip(flat, params)):
        return None
    known = {id(p) for p in params}
    return now, [p for p in flat if id(p) not in known]


def _pieces(parts: Iterable[Partition]) -> list[tuple[torch.Tensor, int]]:
    """Each parameter of `parts` with the number of them holding a piece of it."""
    pieces: dict[int, list] = {}
    for part in parts:
        for s in part.segments:
            pieces.setdefault(id(s.param), [s.param, 0])[1] += 1
    return [(p, n) for p, n in pieces.values()]


def check_optimizer(opt: torch.optim.Optimizer) -> UpdateRule:
    """The rule that runs `opt` (refusing, with UnsupportedOptimizer, what none runs)."""
    return rule_for(opt)


@dataclass
class NativeBatch:
    """A partition's native update (OffloadedOptimizer._native_batch): the rule's batch,
    the segments with a gradient (their numbers in the partition), and the copies to make
    once the kernel ran, (to, from) each: an fp32 model's weights from a master the kernel
    updated, and with master_weights kahan/none in a crash-consistent run, the model's
    bf16 weights into the record (views["weight"]), so that the commit holds them (the
    kernel's CRC of the weights is the copy's)."""

    batch: Batch
    updated: list[int] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # step_device cpu on a device model: (segment, master) whose weights the lanes copy over
    to_device: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def copy_out(self) -> None:
        for to, src in self.copies:
            to.copy_(src)


@dataclass
class TogetherPlan:
    """A group's host records updated together (OffloadedOptimizer._update_together), made
    ready once: the rule's prepared update, and what it was made for, which the next step
    checks before it runs it again (a record or a parameter's memory moved, or another
    set of parameters has gradients: a new plan)."""

    group: int  # the param group
    ids: tuple[int, ...]  # its partitions
    records: tuple[int, ...]  # each record's address
    params: tuple[tuple[int, int, torch.dtype, bool], ...]  # per parameter: address,
    # elements, dtype, whether it had a gradient
    prepared: PreparedUpdate
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # as NativeBatch.copies


class OffloadedOptimizer:
    """The tiered state of one Adam/AdamW instance, and the hooks that route to it."""

    def __init__(self, optimizer: torch.optim.Optimizer, settings: Settings, *,
                 model: torch.nn.Module | None = None, swap_name: str = "default",
                 resume: bool = False, resume_previous: bool = False,
                 keep_previous: bool = False,
                 streams: CudaBackend | DeferredBackend | None = None,
                 origins: Sequence[tuple[int, int]] = (), share: dict | None = None,
                 rule: UpdateRule | None = None) -> None:
        """resume_previous: resume from the commit before the last (manifest.PREVIOUS);
        keep_previous: every commit keeps the one before it (both: torch.distributed);
        streams: the device lanes' stream backend (None: CUDA streams for CUDA parameters);
        origins: per parameter, the user's parameter it is a piece of and the piece's first
        element there (a rank's shares; default: itself, from element 0), which keys the
        random streams of stochastic rounding (UpdateRule: Batch.origins);
        share: what a rank's manifests say of its share (swap/manifest.py: Manifest.share);
        rule: the rule to run `optimizer` with, already checked (a rank's optimizer under a
        process group, whose rule was checked on the user's: ShadowRule.bind).
        With parameters.offload the model's weights and grads move to a ParamTier once the
        state is laid out (each partition's parameters are opened from it for its update)."""
        # Before any update: torch's first multithreaded sqrt may otherwise run a
        # low-accuracy MKL kernel on one thread (kernels/vml.py).
        resolve_vml_dispatch()
        o = settings.optimizer
        options = dict(state_dtype=o.state_dtype, state_rounding=o.state_rounding)
        if o.master_weights != "fp32":
            if rule_class(optimizer) is not AdamRule:  # a subclass with its own step too
                raise TierMemError(
                    f"optimizer.master_weights {o.master_weights} runs Adam/AdamW only (torch's "
                    f"own step), not {type(optimizer).__name__}; use master_weights fp32")
            options["master_weights"] = o.master_weights
        if rule is None:
            rule = rule_for(optimizer, **options)
        else:
            type(rule)(**options)  # the settings it refuses, refused as rule_for would
        self.rule = rule
        self.opt = optimizer
        self.settings = settings
        self.weights: ParamTier | None = None
        if settings.parameters.offload != "none":
            check_weights_supported(settings, model, streams, resume)
        self.swap_name = swap_name
        self.crash = settings.swap.durability == "crash_consistent"
        self.keep_previous = keep_previous
        # Set when a failed step could not be rolled back, a state method failed part-way
        # with nothing to roll back to (scratch), or a DCP load failed after writing: why
        # no step may run any more.
        self.broken: str | None = None
        # Set when a load_state_dict() failed after it began replacing the state: the
        # records hold some of the loaded state and some of the old. Why nothing may step
        # or read it before a load succeeds (which replaces all of it).
        self.half_loaded: str | None = None
        # Set when a step rolled back had taken gradients that exist nowhere else: why no
        # step may run before a backward gives them again (cleared by zero_grad()).
        self.gradients_gone: str | None = None
        self.names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        if model is None and any(r.match != "*" for r in settings.placement):
            raise TierMemError("placement rules match parameter names: pass model= to "
                               "tiermem.offload so tiermem knows them")
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.group_sizes = [len(g["params"]) for g in optimizer.param_groups]
        self.steps = StepCounts(0.0 for _ in self.params)
        # Of a rule whose optimizer makes its state eagerly (Adagrad: in __init__), the
        # parameters never stepped that it keeps no state for all the same: a group added
        # after construction, an entry a loaded state_dict left out. torch's state_dict
        # has no entry for them until their first step, which fills it (the rule's
        # first_fill); every other one keeps the state it has (its record), as torch's
        # does. Set where the state comes from (entry, load, resume). Not known after a
        # resume from a version-3 manifest, which kept none: every parameter never stepped
        # then starts from the first fill (what tiermem did before it kept them).
        self.stateless: set[int] = set()
        self.stateless_known = True
        # Of any other rule's, the parameters never stepped that hold state all the same:
        # a step GradScaler skipped, which torch's fused Adam makes their state in (step 0,
        # zero moments) before it skips; an entry with step 0, loaded or held at entry.
        self.unstepped_state: set[int] = set()
        # The weights changed since the records last took them (optim/edits.py): the
        # masters a step starts from take them first (_first_step_masters), and a commit
        # those of the parameters that took no step (_refresh_edited_masters)
        self.edits = EditedWeights(self.params)
        # parameters a scratch step has updated so far (a failed one uncounts the rest)
        self.updated_now: set[int] = set()
        # After a scratch step failed part-way: the gradients (grad_marks) its updated
        # parameters took it with; a step() on the same ones would update them twice.
        self._applied: dict[int, Any] = {}
        self.origins = list(origins)
        self.share = share or {}
        # Each parameter's other scalar state (rule.scalar_keys: ASGD's eta, mu, ...) as
        # its last completed step left it, and the values this step's update made, which
        # replace them when the parameter's next step is counted: every segment of a
        # parameter split across partitions starts this step from the same values.
        self.scalars: list[dict[str, torch.Tensor]] = [{} for _ in self.params]
        self._next_scalars: dict[int, dict[str, torch.Tensor]] = {}
        # The last HISTORY steps' figures: a long run keeps a bounded amount of them.
        self.history: deque[StepStats] = deque(maxlen=HISTORY)
        self.steps_taken = 0
        # the native updates' thread count, step by step (optim/threads.py)
        self.threads = UpdateThreads(settings.optimizer.update_threads)
        self.record_events = False  # timeline spans per step (tracing, plots)
        # Called with each partition once step() has updated it (its weights are final for
        # the step): distributed.py starts the weight all-gather of a window from it.
        self.after_update: Callable[[Partition], None] | None = None
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._plans: dict[int, TogetherPlan] = {}  # per group, its last together update
        self.step_device = settings.optimizer.step_device
        # With a backend whose device memory is host memory (DeferredBackend) CPU parameters
        # count as device ones: like a CUDA model's, their records keep an fp32 master and
        # their updates cross the lanes.
        self.streams = streams
        self.emulated = streams is not None and streams.host_is_device
        self._keep_master = self.crash or self.emulated
        # A parameter frozen when the block opens (requires_grad False and no state yet:
        # a LoRA run's base weights) gets no record: a plain optimizer keeps no state for
        # it, and a record would take host or NVMe room (Adam's 8-12 B a parameter) for
        # nothing. A rank's shares are laid out whole (they are views, cut over the ranks).
        # One holding a gradient (left by a backward from before it was frozen) is
        # stepped by torch all the same: laid out.
        self._skip = None if share else (
            lambda p: not p.requires_grad and p.grad is None and not optimizer.state.get(p))
        # Parameters laid out inside the block after it opened (lay_out_late), in order,
        # each lay-out with the partition count before it ("at"): a resume lays them out
        # between the groups' partitions again (add_param_group's come after them), as the
        # kept records are.
        self.late: list[dict[str, Any]] = []
        if resume and not share:
            # A resume lays out the parameters the kept records hold, frozen now or not (a
            # parameter frozen mid-run keeps its state, as in torch), and no other: one
            # unfrozen since gets its records at its first step, as inside the block.
            kept = read_manifest(run_dirs(settings.swap.paths, swap_name)[0], None,
                                 previous=resume_previous)
            self.late = kept.late
            if len(kept.steps) == len(self.params):  # (else the layout check refuses)
                held = {s[0] for part in kept.partitions for s in part["segments"]}
                index = {id(p): i for i, p in enumerate(self.params)}
                self._skip = lambda p: index[id(p)] not in held
        self.parts = []
        self._lay_out_groups(optimizer.param_groups)
        self.unlaid = self._unlaid(self.parts, range(len(self.params)))
        self.budgets = Budgets(settings.tiers.gpu.capacity, settings.tiers.host.capacity)
        self.budgets.assign(self.parts)
        # Streams, events and buffers between host memory and the device, made once.
        self.lanes: DeviceLanes | None = None
        self._refuse_routes(self.parts)
        self._add_lanes(self.parts)
        self.committed_step: int | None = None  # crash-consistent: the step a crash returns to
        manifest = None
        if resume:
            dirs = run_dirs(settings.swap.paths, swap_name)
            manifest = read_manifest(dirs[0], self.parts, settings.swap.durability,
                                     previous=resume_previous, share=self.share)
            refuse_stale_paths(dirs, manifest, "resume from")
            if manifest.rule != type(self.rule).__name__:
                # Same record layout, other arithmetic (NAdam's moments are not Adam's).
                raise TierMemError(
                    f"cannot resume: the kept state is {manifest.rule}'s and this optimizer "
                    f"({type(optimizer).__name__}) runs {type(self.rule).__name__}; resume "
                    "with the optimizer class that kept it")
            self._adopt_counts(manifest)
            # the counts a step keeps in its groups or on the optimizer (Ranger21's group
            # step and current_lr), as the committed step left them
            self.rule.restore_step_values({
                "groups": {g: {k: value_from_json(v) for k, v in vs.items()}
                           for g, vs in manifest.values.get("groups", {}).items()},
                "own": {k: value_from_json(v)
                        for k, v in manifest.values.get("own", {}).items()},
                "state": {k: value_from_json(v)
                          for k, v in manifest.values.get("state", {}).items()},
                "absent": manifest.values.get("absent", [])})
        self.resumed_step = manifest.step if manifest else None
        self.tiers = TierManager(self.parts, settings, swap_name=swap_name, resume=manifest,
                                 keep_previous=keep_previous)
        try:
            existing = {p: s for p, s in optimizer.state.items()
                        if isinstance(p, torch.Tensor) and s}
            if not resume:
                self.stateless = self._without_state(
                    i for i, p in enumerate(self.params) if p not in existing)
            if resume_previous:
                # The commit gone back to is the latest from now on: a crash, or a step
                # rolled back, must not find the later one (its records get overwritten).
                write_manifest(self.tiers.run_dir(), manifest)
            # With parameters.offload the weights are restored, or step 0 committed, once
            # the parameter tier holds them (a model built on the meta device has none yet).
            later = settings.parameters.offload != "none"
            if resume:
                if self.crash and not later:
                    self._restore_weights()
                drop_param_state(optimizer)  # the kept state is the one to continue from
            elif existing:
                index = {id(p): i for i, p in enumerate(self.params)}
                self._refuse_unkept_keys({index[id(p)]: st for p, st in existing.items()
                                          if id(p) in index}, optimizer.param_groups,
                                         "holds")
                self._import(existing)
                drop_param_state(optimizer)  # the tiers hold it now; free the RAM
            if self.crash and not resume and not later:
                # Step 0 committed: every record, weights included, on disk before training.
                self._initialise(self.parts)
                self.commit()
        except BaseException:
            # A failed resume must leave the kept state exactly as it was.
            self.close_tiers(remove_swap=not resume)
            raise
        self.edits.record()  # the weights as the block found them (or a resume put them)
        self._hooks = Installed(optimizer, self)
        if settings.pipeline.overlap_backward or settings.parameters.offload != "none":
            self._hooks.claim_amp()  # so a GradScaler's step reaches the refusal (optim/amp.py)
        # Updates that start during backward (pipeline.overlap_backward; tiermem/overlap.py).
        self.overlap: BackwardOverlap | None = None
        if settings.pipeline.overlap_backward and settings.parameters.offload == "none":
            try:
                self.overlap = BackwardOverlap(self, model)
            except BaseException:
                self.detach()
                self.close_tiers(remove_swap=True)
                raise
        if settings.parameters.offload != "none":
            # Last: the partitions above were laid out from the weights still in memory.
            try:
                self.weights = ParamTier(model, settings, swap_name=swap_name, resume=resume,
                                         streams=streams)
                self._route_zero_grad(optimizer)
                # the update takes the gradients backward left in memory, unwritten
                self.weights.keep_grads = settings.pipeline.overlap_backward
                self.weights.check_partitions([s.param for s in part.segments]
                                              for part in self.parts)
                self.weights.expect_updates(_pieces(self.parts))
                self.weights.optimizer_holds(self.params)
                if self.crash and resume:
                    # The committed records hold every weight the optimizer updates (fp32
                    # masters, or the bf16 copies of master_weights kahan/none): the tier's
                    # own weight records are working copies, rewritten from them.
                    self._restore_weights()
                elif self.crash:
                    self._initialise(self.parts)
                    self.commit()
                if settings.pipeline.overlap_backward:
                    # After the tier: its gradient hooks (registered on the parameters it
                    # made, a meta model's included) store each gradient before the
                    # overlap's hook queues the partition.
                    self.overlap = BackwardOverlap(self, model)
            except BaseException:
                self.end_overlap()
                if self.weights is not None:
                    self.weights.close()
                    self.weights = None
                self.detach()
                self.close_tiers(remove_swap=not resume)  # a failed resume keeps the state
                raise

    # -- set-up ----------------------------------------------------------------

    def _unlaid(self, parts: Sequence[Partition], indices: Iterable[int]) -> set[int]:
        """Of parameters `indices`, those no partition holds (frozen at entry: _skip)."""
        covered = {s.index for part in parts for s in part.segments}
        return {i for i in indices if i not in covered and self.params[i].numel() > 0}

    def refuse_unlaid(self, stepped: Iterable[int]) -> None:
        """With pipeline.overlap_backward a parameter is laid out at the forward (unfrozen,
        or given a gradient, by then: lay_out_late); one that got its gradient after the
        forward has no record when backward has already updated the others: refuse it
        rather than leave it un-updated."""
        bad = sorted(set(stepped) & self.unlaid)
        if bad:
            p = self.params[bad[0]]
            name = self.names.get(id(p)) or f"parameter {bad[0]} (shape {tuple(p.shape)})"
            raise TierMemError(
                f"{name}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''} has a gradient "
                "but no optimizer record: it was frozen, with no gradient, when this step's "
                "forward ran, and with pipeline.overlap_backward a parameter's record is laid "
                "out at the forward, before backward starts updating the others. Unfreeze "
                "it, or give it its gradient, before the forward")

    def _layouts(self, groups: Sequence[dict], only: set[int] | None = None) -> dict[str, Any]:
        """build_partitions' layout arguments: what the rule keeps in a record for each
        parameter (per element, or per whole parameter when its math spans one); with
        `only` (ids), of those parameters only (the others are skipped: None)."""
        def each(lay: Callable[[torch.Tensor, dict], Any]) -> list[list[Any]]:
            return [[lay(p, g) if only is None or id(p) in only else None
                     for p in g["params"]] for g in groups]
        if not self.rule.elementwise:
            return {"whole": each(lambda p, g: self.rule.whole_layout(
                        p, g, keep_master=self._keep_master)),
                    "by_layout": not self.settings.pipeline.overlap_backward}
        return {"kinds": each(lambda p, g: self.rule.kinds(p, g, keep_master=self._keep_master))}

    def _lay_out_groups(self, groups: Sequence[dict]) -> None:
        """The partitions of `groups` at entry (all at once: the partition ids follow the
        groups), or, resuming a run that laid out parameters inside its block (self.late),
        group by group with those lay-outs where they came (a group laid out on its own
        is the same partitions, as add_param_group's are)."""
        kw = dict(keep_master=self._keep_master,
                  state_dtype=self.settings.optimizer.state_dtype,
                  master_weights=self.settings.optimizer.master_weights)
        size, rules = self.settings.pipeline.partition_size, self.settings.placement
        if not self.late:
            self.parts = build_partitions(groups, self.names, size, rules, skip=self._skip,
                                          **kw, **self._layouts(groups))
            return
        n = len(self.params)
        later = {id(self.params[i]) for lay in self.late for i in lay["params"] if i < n}
        pending = list(self.late)

        def due() -> None:  # the late lay-outs made when the partitions were as now
            while pending and pending[0]["at"] <= len(self.parts):
                self._late_parts([i for i in pending.pop(0)["params"] if i < n])

        first = 0
        for g, group in enumerate(groups):
            due()
            new = build_partitions([group], self.names, size, rules, first_id=len(self.parts),
                                   first_index=first, **kw, **self._layouts([group]),
                                   skip=lambda p: id(p) in later or bool(
                                       self._skip and self._skip(p)))
            for part in new:
                part.group = g
            self.parts.extend(new)
            first += len(group["params"])
        due()
        while pending:  # (kept at a count this layout never reaches: the check refuses)
            self._late_parts([i for i in pending.pop(0)["params"] if i < n])

    def _late_parts(self, indices: Sequence[int]) -> list[Partition]:
        """Partitions of parameters `indices`, frozen when the block opened (no record) and
        laid out since, after every partition there is: in their own groups, as
        build_partitions lays out a group (a resume lays them out again the same way)."""
        ids = {id(self.params[i]) for i in indices}
        with (self.weights.shaped([self.params[i] for i in indices])
              if self.weights is not None else contextlib.nullcontext()):
            new = build_partitions(
                self.opt.param_groups, self.names, self.settings.pipeline.partition_size,
                self.settings.placement, first_id=len(self.parts),
                keep_master=self._keep_master, state_dtype=self.settings.optimizer.state_dtype,
                master_weights=self.settings.optimizer.master_weights,
                skip=lambda p: id(p) not in ids, **self._layouts(self.opt.param_groups, ids))
        self.parts.extend(new)
        return new

    def lay_out_late(self, indices: Iterable[int], *, commit: bool = True) -> None:
        """Parameters frozen when the block opened (no record: _skip spares a LoRA run's
        frozen weights the room) that now have a gradient or are given state: their
        records are laid out now, as torch makes their state at their first step (a model
        whose backbone is unfrozen after some epochs, its parameters in the optimizer from
        the start). Each such lay-out is kept in the manifest (`late`), so a resume lays
        the partitions out in the same order. commit: crash-consistent, commit the lay-out
        now (False: the caller commits once the state it is in the middle of changing is
        whole, as a load does: a commit here kept its reset step counts with no state)."""
        if not self.unlaid:  # (every step asks: a set of every stepped parameter for nothing)
            return
        late = sorted(self.unlaid.intersection(indices))
        if not late:
            return
        if torch.is_inference_mode_enabled():
            # (overlap_backward: at an evaluation's forward) records made under inference
            # mode are inference tensors, which no update may write in place; leaving it
            # turns grad mode on: kept as the caller had it
            grad = torch.is_grad_enabled()
            with torch.inference_mode(False), torch.set_grad_enabled(grad):
                return self._lay_out(late, commit)
        self._lay_out(late, commit)

    def _lay_out(self, late: list[int], commit: bool) -> None:
        """lay_out_late of parameters `late` (sorted, all unlaid)."""
        if self.overlap is not None:
            self.overlap.require_idle("a parameter unfrozen inside the block")
        left, count = dict(self.budgets.left), len(self.parts)
        try:
            new = self._late_parts(late)
            if self.weights is not None:
                self.weights.check_partitions([s.param for s in part.segments] for part in new)
            self.budgets.assign(new)
            self._refuse_routes(new)
            self._add_lanes(new)
            self.tiers.add(new)
        except BaseException:
            del self.parts[count:]  # not laid out: refused at the step, as before
            self.budgets.left = left
            raise
        self.unlaid -= set(late)
        self.late.append({"at": count, "params": late})
        if self.weights is not None:
            self.weights.expect_updates(_pieces(new))
        if self.crash:
            self._initialise(new)
            if commit:
                self.commit()
        if self.overlap is not None:
            self.overlap.add(new)

    def _route(self, part: Partition) -> str | None:
        """How `part` is updated: "device" (record streamed to the device, step_device
        device), "offload" (grads to the host, weights back; step_device cpu), or None
        (in place: GPU-tier records, and CPU models' host/NVMe records)."""
        if part.tier == "gpu":
            return None
        if self.settings.parameters.offload != "none" and self.step_device == "cpu":
            # the parameter tier materialises the partition's weights and grads in host
            # memory for its update, a device model's too (its records are the home copy)
            return None
        if self.step_device == "device":
            return "device"
        # meta: a model built on the meta device, made module by module in the parameter
        # tier (parameters.offload), on the CPU
        on_device = self.emulated or any(not (s.param.is_cpu or s.param.is_meta)
                                         for s in part.segments)
        return "offload" if on_device else None

    def _refuse_routes(self, parts: list[Partition]) -> None:
        """What a partition's place cannot run. master_weights kahan/none update the model's
        bf16 weights in place: through the "offload" route the update runs on host grads
        while those weights stay on the device, so it cannot (step_device device and the gpu
        tier update them there). bf16 moments have only the native kernel, which updates
        host memory: a gpu-tier record cannot have them."""
        if self.settings.optimizer.state_dtype == "bf16" and any(p.tier == "gpu"
                                                                 for p in parts):
            raise ConfigError(
                "optimizer.state_dtype", "bf16",
                "fp32 or int8 with optimizer state on the gpu tier (tiers.gpu.capacity, or a "
                "placement rule naming gpu): bf16 moments are updated by tiermem's native "
                "kernel in host memory; or set tiers.gpu.capacity: 0")
        mw = self.settings.optimizer.master_weights
        if mw != "fp32" and any(self._route(p) == "offload" for p in parts):
            raise ConfigError(
                "optimizer.master_weights", mw,
                "fp32 for a model off the CPU with optimizer.step_device cpu (the weights "
                "live only on the device, the update would run on the host); or set "
                "optimizer.step_device: device")

    def _add_lanes(self, parts: list[Partition]) -> None:
        routed = [p for p in parts if self._route(p) is not None]
        if not routed:
            return
        if self.lanes is None:
            self.lanes = DeviceLanes(routed, self.step_device, self.streams)
        else:
            self.lanes.add(routed)

    def detach(self) -> None:
        """Remove the hooks (state must have been exported or kept on disk first)."""
        self.end_overlap()
        self._hooks.remove()
        if "zero_grad" in self.__dict__.get("_zero_grad_had", {}):
            had = self._zero_grad_had.pop("zero_grad")
            if had is None:
                self.opt.__dict__.pop("zero_grad", None)
            else:
                self.opt.zero_grad = had

    def _route_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """opt.zero_grad() also forgets the gradients stored in the parameter tier (they
        are not in p.grad), so a backward after it stores instead of adding, as in torch."""
        had = optimizer.__dict__.get("zero_grad")
        self._zero_grad_had = {"zero_grad": had}
        off = self

        def zero_grad(set_to_none: bool = True) -> None:
            if off.weights is not None:
                off.weights.zero_grad(off.params, set_to_none=set_to_none)
            off.gradients_gone = None
            (had or type(optimizer).zero_grad.__get__(optimizer))(set_to_none)

        optimizer.zero_grad = zero_grad

    # -- the step --------------------------------------------------------------

    def wait_idle(self) -> None:
        """Wait until the overlap's worker (pipeline.overlap_backward) is idle: it runs the
        updates backward queued and, after step(), the next step's run-ahead reads, and
        nothing else may touch the tiers meanwhile. A no-op without it."""
        if self.overlap is not None:
            self.overlap.wait_idle()

    def end_overlap(self) -> BaseException | None:
        """Stop updating during backward (hooks off, worker done); return an error the worker
        hit that no step() raised."""
        overlap, self.overlap = self.overlap, None
        return overlap.close() if overlap is not None else None

    def check_groups(self, what: str) -> None:
        """The optimizer's param groups hold the parameters tiermem laid out, group by
        group. Groups changed other than by add_param_group (`opt.param_groups = ...`, as
        Lightning's BaseFinetuning restores its groups on a resume, or an append) hold
        parameters no record holds: the step passed over them without a word (never
        updated) and a load of their state failed with a bare KeyError."""
        groups = self.opt.param_groups
        changed = groups_changed(groups, self.group_sizes, self.params)
        if changed is None:
            return
        sizes, new = changed
        which = (f"{len(new)} parameters tiermem laid out no record for (the first "
                 f"{self.names.get(id(new[0])) or tuple(new[0].shape)})" if new
                 else "parameters moved, removed or regrouped")
        raise TierMemError(
            f"{what}: the optimizer's param_groups changed inside the tiermem.offload block "
            f"other than through add_param_group: {len(groups)} groups of {sizes} parameters "
            f"where tiermem laid out {len(self.group_sizes)} of {self.group_sizes}, with "
            f"{which}. tiermem would not update them; add a group with "
            "optimizer.add_param_group(), or set param_groups before entering the block")

    @property
    def unusable(self) -> str | None:
        """Why memory holds state that is neither one step's nor another's (`broken`, or a
        load that failed part-way), or None."""
        return self.broken or self.half_loaded

    def refuse_unusable(self, what: str) -> None:
        """Refuse `what` on such state (`unusable`): nothing may step it or hand it out."""
        if self.unusable:
            raise TierMemError(f"{what}: {self.unusable}")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self.check_groups("optimizer.step()")
        self.refuse_unusable("optimizer.step()")
        if self.gradients_gone:
            raise TierMemError(self.gradients_gone)
        self._refuse_applied()
        if self.overlap is not None:
            # Ctrl-C / SIGTERM leave only between partitions (signals.safe_point), never
            # with a record's write half issued.
            with deferred():
                return self.overlap.step(closure)
        args, kwargs = run_pre_hooks(self.opt, (closure,), {})
        closure = args[0] if args else kwargs.get("closure")
        scaled = amp.handover(self.opt)
        if scaled is not None:
            if self.weights is not None:
                amp.refuse(self.opt, "parameters.offload",
                           "the gradients are in the parameter tier, where GradScaler "
                           "cannot check them for inf/NaN")
            if self.rule.own_step:
                amp.refuse_own_step(self.opt)
            if amp.apply(self.opt, scaled):  # (before the lanes stage any gradient)
                self.skipped(i for i, p in enumerate(self.params) if p.grad is not None)
                run_post_hooks(self.opt, args, kwargs)
                step_called(self.opt)
                return None
        loss = None
        if closure is not None:
            self.rule.check_closure()  # before the closure's forward and backward run
            with torch.enable_grad():
                loss = closure()
        with deferred():  # as above; the closure (forward, backward) stays interruptible
            # an optimizer's own step (the generic rule) gets the loss the closure gave,
            # as its plain step would from calling the closure itself
            self._step_tiers(None if closure is None else (lambda: loss))
        run_post_hooks(self.opt, args, kwargs)
        return loss

    def _step_tiers(self, closure: Callable[[], Any] | None = None) -> None:
        if self.weights is not None:  # the grads are in the parameter tier, not in p.grad
            # A gradient set on a parameter while it is empty between uses (shape (0,))
            # never reaches the tier: the step would pass over it without a word.
            # torch.distributed.checkpoint's state_dict helpers set zeros_like(p) and step
            # (lr 0) to make a never-stepped optimizer's state, which then stayed empty.
            # (of the model's shape too: a released parameter's zeros_like is the real
            # shape's, and a live one's always was; only the step's own are the tier's)
            stray = [self.names.get(id(p), "?") for p in self.params
                     if p.grad is not None and (p.grad.shape != self._shaped(p).shape
                                                or not self.weights.handed_out(p))]
            if stray:
                raise TierMemError(
                    f"optimizer.step(): p.grad of {', '.join(stray[:3])}"
                    f"{' and others' if len(stray) > 3 else ''} was set by hand inside the "
                    "block: with parameters.offload the gradients live in the parameter "
                    "tier, which a p.grad set by hand never reaches (the step would pass it "
                    "over). torch.distributed.checkpoint's get_optimizer_state_dict, "
                    "get_state_dict and set_optimizer_state_dict do that to make a "
                    "never-stepped optimizer's state: call them after its first step, or "
                    "before entering the block")
            self.weights.before_step(self.params)
            stepped = {i for i, p in enumerate(self.params) if self.weights.has_gradient(p)}
        else:
            stepped = {i for i, p in enumerate(self.params) if p.grad is not None}
        self.lay_out_late(stepped)
        if self.weights is None and any(self.params[i].grad.is_sparse for i in stepped):
            raise TierMemError(f"{type(self.opt).__name__} under tiermem does not support "
                               "sparse gradients")
        stats = self.begin_step(closure)  # refuses a group changed since the layout
        aside = self.weights.guard_aside() if self.weights is not None else contextlib.nullcontext()
        with timed(stats, "step_seconds"), torch.no_grad(), aside:
            self._count_all(stepped)  # only once nothing can refuse the step
            try:
                order = self.tiers.order(
                    lambda part: any(s.index in stepped for s in part.segments))
                if self.weights is not None:  # what the window keeps for the step
                    self.weights.expect_step_order(s.param for part in order
                                                   for s in part.segments)
                self.update(order, stats)
                self.rule.end_step(self.opt.param_groups)
                if self.weights is not None:
                    self.weights.step_done()
                self.tiers.end_step(stats)
            except BaseException as exc:
                if self.lanes is not None:
                    self.lanes.settle()  # queued copies and kernels done, nothing staged
                if self.crash:
                    self.roll_back(exc, stats.step)
                else:
                    # scratch: the partitions before the failure are updated and the rest
                    # not; a parameter none of whose partitions was updated keeps the count
                    # its state has (a parameter cut across the failure is half updated)
                    self.steps.decrement(stepped - self.updated_now)
                    self.failed_part_way(self.updated_now, stats.step)
                raise
            self.close_step(stats)
        self.threads.observe(stats)  # (timed: step_seconds is in)
        step_called(self.opt)

    def grad_marks(self, indices: Iterable[int]) -> dict[int, Any]:
        """What tells each parameter's gradient from the next: a backward, a zero_grad or
        an edit in place changes its mark."""
        if self.weights is not None:
            return {i: self.weights.grad_mark(self.params[i]) for i in indices}
        marks: dict[int, Any] = {}
        for i in indices:
            g = self.params[i].grad
            # a weak reference: an id() may be reused by the next backward's gradient
            marks[i] = None if g is None else (weakref.ref(g), g._version)
        return marks

    def failed_part_way(self, updated: set[int], step: int) -> None:
        """A scratch step failed after updating `updated` (documented: they keep it)."""
        if updated:
            self._applied = self.grad_marks(updated)
            self._applied_step = step

    def _refuse_applied(self) -> None:
        if not self._applied:
            return
        now = self.grad_marks(self._applied)

        def same(was: Any, is_: Any) -> bool:
            if was is None or is_ is None:
                return False
            if self.weights is not None:
                return was == is_
            return was[0]() is not None and was[0]() is is_[0]() and was[1] == is_[1]

        again = [i for i, mark in self._applied.items() if same(mark, now[i])]
        if again:
            p = self.params[again[0]]
            name = self.names.get(id(p)) or f"parameter {again[0]} (shape {tuple(p.shape)})"
            raise TierMemError(
                f"step {self._applied_step} failed part-way (swap.durability: scratch) after "
                f"updating {len(again)} parameter(s), {name} among them, with these "
                "gradients; an optimizer.step() on the same gradients would update them "
                "twice. Compute new gradients first (zero_grad, forward, backward), or use "
                "swap.durability: crash_consistent, which rolls a failed step back")
        self._applied = {}

    def begin_step(self, closure: Callable[[], Any] | None = None) -> StepStats:
        """The figures of the step about to run (the reads run ahead of it counted in).
        closure: hands the loss of the user's closure, evaluated, to the rule."""
        for part in self.parts:
            self.rule.check_group(part, self.opt.param_groups[part.group])
        self.rule.begin_step(self.opt.param_groups, closure=closure)
        stats = StepStats(step=self.steps_taken + 1, events=[] if self.record_events else None,
                          update_threads=self.threads.count())
        self._note_edits()  # (before this step's own writes of the weights)
        self.tiers.begin_step(stats)
        return stats

    def count_steps(self, parts: Sequence[Partition], done: set[int] | None = None) -> set[int]:
        """Count this step for every parameter of `parts` with a gradient, once: several
        segments (partitions) of one parameter share its count. `done`: the parameter
        indices already counted this step (updated). Returns the indices counted."""
        done = set() if done is None else done
        counted = {s.index for part in parts for s in part.segments
                   if s.index not in done and self.has_grad(s.param)}
        self._count_all(counted)
        done |= counted
        return counted

    def count_empty(self, done: set[int]) -> None:
        """Count this step for the parameters with no elements that have a gradient: no
        partition holds them, so no partition's count_steps reaches them, and the plain
        optimizer keeps a count (and empty state) for them too. `done`: as count_steps."""
        empty = {i for i, p in enumerate(self.params)
                 if p.numel() == 0 and i not in done and self.has_grad(p)}
        if empty:
            # (one a partition holds was counted by its count_steps, in `done`)
            empty -= {s.index for part in self.parts for s in part.segments}
        if empty:
            self._count_all(empty)
            done |= empty

    def has_grad(self, p: torch.Tensor) -> bool:
        """p has a gradient for this step (in p.grad, or with parameters.offload in the
        parameter tier)."""
        return p.grad is not None if self.weights is None else self.weights.has_gradient(p)

    def _count_all(self, indices: set[int]) -> None:
        """Parameters `indices` take this step: their counts (StepCounts: one add for a
        step of every parameter), and the host scalars their last step left (kept aside
        until now so every segment of the step started from the same)."""
        self.steps.increment(indices)
        self.updated_now = set()  # of those, the ones updated so far
        if self._next_scalars:
            for i in indices:
                if i in self._next_scalars:
                    self.scalars[i] = self._next_scalars.pop(i)

    def update(self, parts: Sequence[Partition], stats: StepStats, *,
               done: Sequence[Partition] = (), ahead: Sequence[Partition] = ()) -> None:
        """The one update loop: the tiers hand out each of `parts`' records ready (reads
        ahead, writes behind), the rule updates it, the tiers take it back. done/ahead:
        NVMe partitions visited earlier in this step / expected after `parts`."""
        after = self._after_update()
        while after is None and (together := self._together(parts)) > 1:
            self._update_together(parts[:together], stats)  # a group's host records
            parts = parts[together:]
        # the parameter tier reads weights and gradients as many partitions ahead as the
        # state pipeline reads records (one partition's update is too short to cover one
        # parameter's read)
        position = {part.id: k for k, part in enumerate(parts)}
        depth = self.settings.pipeline.prefetch_depth
        for rec in self.tiers.visit(parts, stats, done=done, ahead=ahead):
            nxt = rec.following
            if self.lanes is not None and nxt is not None and self._route(nxt) is not None:
                views = self.tiers.ready_views(nxt)
                if views is not None:  # its copy to the device overlaps this update
                    self.lanes.stage(nxt, views)
            opened = None
            if self.weights is not None:
                opened = self.weights.open_for_update(s.param for s in rec.part.segments)
                if nxt is not None:  # their reads overlap this update
                    k = position.get(nxt.id)
                    coming = [nxt] if k is None else parts[k: k + depth]
                    self.weights.read_ahead_update(s.param for q in coming
                                                   for s in q.segments)
            try:
                if rec.fresh:
                    self.rule.init(rec.part, rec.views)
                elif self._route(rec.part) != "device":  # (that one: on the device, below)
                    self._first_step_masters(rec.part, rec.views)
                digest = self._update(rec.part, rec.views, stats)
                self._synced(rec.part)
                self.updated_now.update(s.index for s in rec.part.segments)
            finally:
                # also when the update failed: the window must not keep them pinned (a
                # crash-consistent roll-back then rewrites their weights)
                if opened is not None:
                    self.weights.updated(opened)
            self.tiers.release(rec, stats, digest)  # the disk works while after() runs
            if after is not None:
                after(rec.part)

    def _first_step_masters(self, part: Partition, views: Views) -> None:
        """The masters `part`'s update starts from, as the model's weights have them.

        A parameter taking its first step: from its weights, as a record written now would
        have it (a record written earlier, at the block's entry under crash_consistent or
        at the first step of another parameter it holds, kept the weights of then, and a
        change since counted or not as the layout fell). A later step: the elements of its
        weights changed since the records last took them (optim/edits.py: take_edits).
        Without a master (master_weights kahan), the weights are what the update starts
        from, and an edited element drops a Kahan term that no longer fits it
        (keep_kahan_terms)."""
        master = views.get("master")
        kahan = views.get("kahan") if master is None else None
        if master is None and kahan is None:
            return
        kind = "master" if master is not None else "kahan"
        for s, sl in zip(part.segments, part.slices(kind)):
            if not self.has_grad(s.param):
                continue
            if master is not None and float(self.steps[s.index]) == 1.0:
                master[sl].copy_(flat(s.param.detach())[s.start: s.start + s.length])
            elif self._edited(part, s, master):
                weights = flat(s.param.detach())[s.start: s.start + s.length]
                if master is not None:
                    take_edits(master[sl], weights)
                else:
                    keep_kahan_terms(kahan[sl], weights)

    def _edited(self, part: Partition, s: Segment, master: torch.Tensor | None) -> bool:
        """The weights of `s`'s parameter were changed since the records last took them
        by someone other than tiermem, where the update starts from the master
        (low-precision weights, or a device model's updated on the host: the step would
        overwrite the change, where the plain optimizer steps from it), or from weights
        whose Kahan term no longer fits them. optim/edits.py says which: not an in-place
        change made through p.data without the parameter tier (its counter is its own:
        docs/guide/numerics.md)."""
        p = s.param
        if master is not None and p.dtype == torch.float32 and p.device == master.device \
                and self._route(part) != "offload":
            return False  # its own weights are what the update starts from
        return self.edits.take(s.index)

    def _synced(self, part: Partition) -> None:
        """`part`'s update wrote the weights of its parameters that took the step from their
        masters (or the masters from them): a parameter all of whose pieces were updated
        has its changes in its records."""
        self.edits.updated(s.index for s in part.segments if self.has_grad(s.param))

    def _note_edits(self) -> None:
        """The weights' changes since the last step (optim/edits.py; with parameters.offload
        the tier's), pending for the update about to begin."""
        self.edits.note(self.weights.take_pending_edits() if self.weights is not None else None)
        self.edits.begin(self.parts)

    def _together(self, parts: Sequence[Partition]) -> int:
        """How many of `parts`, from the first, one native update may run together:
        host-tier records of one group, with nothing to hash or to send after each (no
        crash-consistent write-through, no parameter tier)."""
        if self.weights is not None or not parts:
            return 0
        n = 0
        for part in parts:
            if (part.tier != "host" or part.group != parts[0].group
                    or self._wants_digest(part) or not self.runs_native(part)
                    or self._route(part) is not None):  # its grads come over the lanes
                break
            n += 1
        return n

    def close_tiers(self, *, remove_swap: bool, flush: bool = True) -> None:
        """TierManager.close, and the kept together updates dropped first: their views would
        keep the host records' memory (pinned, often gigabytes) after the tiers let it go."""
        self._plans.clear()
        self.tiers.close(remove_swap=remove_swap, flush=flush)

    def _update_together(self, parts: Sequence[Partition], stats: StepStats) -> None:
        """Update resident host records in one native call (the rule's prepare_together):
        its threads go from one record's runs to the next without a join."""
        held = self.tiers.hold(parts)
        for rec in held:
            if rec.fresh:
                self.rule.init(rec.part, rec.views)
            else:
                self._first_step_masters(rec.part, rec.views)
        run = self._together_call(held)
        label = f"update p{parts[0].id}-p{parts[-1].id}"
        with timed(stats, "update_seconds", label), update_range(label):
            run()
        for rec in held:
            self._synced(rec.part)
        self.updated_now.update(s.index for rec in held for s in rec.part.segments)
        for rec in held:
            self.tiers.release(rec, stats)

    def _together_call(self, held: Sequence[Ready]) -> Callable[[], None]:
        """The update of the held records of one group: the group's kept TogetherPlan when
        the records and parameters are where they were when it was made (a step then only
        fills in the gradients and step counts: gathering each partition's tensors anew
        costs ~0.1 ms of Python per 64 MiB partition, 3-4% of a step that runs at memory
        speed), else a new one; the rule's batches one after another where it has no
        joined update."""
        group = held[0].part.group
        plan = self._plans.get(group)
        if plan is None or not self._plan_fits(plan, held):
            built = [self._native_batch(rec.part, rec.views) for rec in held]
            batches = [b.batch for b in built if b.batch.params]
            prepared = self.rule.prepare_together(batches, kernel="native")
            if prepared is None:
                self._plans.pop(group, None)

                def apart() -> None:
                    self.rule.update_together(batches, kernel="native")
                    for b in built:
                        b.copy_out()
                return apart
            plan = self._plans[group] = TogetherPlan(
                group=group, ids=tuple(rec.part.id for rec in held),
                records=self._record_addresses(held), params=self._param_keys(held),
                prepared=prepared, copies=[c for b in built for c in b.copies])
        return lambda: self._run_plan(plan)

    def _run_plan(self, plan: TogetherPlan) -> None:
        grads = []
        for i in plan.prepared.slots:
            # the native pass reads the gradient in the parameter's memory order (a
            # channels_last weight's contiguous gradient is copied into its layout)
            p = self.params[i]
            grads.append(flat_like(p.grad, p))
        counts = self.steps.values()  # one read, not one .item() per parameter
        plan.prepared.run(grads=grads, steps=[counts[i] for i in plan.prepared.slots],
                          group=self.opt.param_groups[plan.group],
                          threads=self._update_threads())
        for to, src in plan.copies:
            to.copy_(src)

    def _update_threads(self) -> int | None:
        """The thread count of the native update about to run (optim/threads.py). Only a
        step on one thread fewer asks the engine whether the disk is busy (a few
        microseconds per update)."""
        idle = self.threads.reduced and not self.tiers.moving()
        return self.threads.current(disk_idle=idle)

    @staticmethod
    def _record_addresses(held: Sequence[Ready]) -> tuple[int, ...]:
        return tuple(next(iter(rec.views.values())).data_ptr() for rec in held)

    def _param_keys(self, held: Sequence[Ready]) -> tuple[tuple[int, int, torch.dtype, bool],
                                                          ...]:
        """Per parameter of the held records' segments, in order: what a plan was made for."""
        seen = dict.fromkeys(s.index for rec in held for s in rec.part.segments)
        out = []
        for i in seen:
            p = self.params[i]
            out.append((p.data_ptr(), p.numel(), p.dtype, p.grad is not None))
        return tuple(out)

    def _plan_fits(self, plan: TogetherPlan, held: Sequence[Ready]) -> bool:
        """The records and parameters are where they were when `plan` was made, and the
        same parameters have gradients."""
        return (plan.ids == tuple(rec.part.id for rec in held)
                and plan.records == self._record_addresses(held)
                and plan.params == self._param_keys(held))

    def _after_update(self) -> Callable[[Partition], None] | None:
        """after_update, called once a partition's weights can be read on this thread's
        stream: with the lanes, a host-updated partition's weights are still on their way
        on the h2d stream (step() waits for them only at its end), so the stream waits
        them first."""
        after, lanes = self.after_update, self.lanes
        if after is None or lanes is None:
            return after

        def weights_landed_then(part: Partition) -> None:
            lanes.weights_landed()
            after(part)
        return weights_landed_then

    def _scratch_for(self, device: torch.device, numel: int) -> torch.Tensor:
        buf = self._scratch.get(device)
        if buf is None or buf.numel() < numel:
            # One fp32 staging area per device for upcast/copied grads, kept for reuse.
            buf = torch.empty(max(numel, max(p.numel for p in self.parts)),
                              dtype=torch.float32, device=device)
            self._scratch[device] = buf
        return buf

    def _update(self, part: Partition, views: Views, stats: StepStats) -> int | None:
        """Update `part`'s record in place. Returns the record's CRC32C when the native
        kernel computed it in the same pass (a checksummed record about to be written),
        else None: the swap store then hashes the record itself."""
        route = self._route(part)
        if self.runs_native(part):
            return self._update_native(part, views, stats)
        if route == "device":
            def on_device(dev_views: Views, scratch: torch.Tensor | None) -> None:
                # the record was staged before this update: its master, on the device
                self._first_step_masters(part, dev_views)
                self._gathered_update(part, dev_views, scratch)

            self.lanes.update_on_device(part, views, on_device, stats)
            return None
        return self._gathered_update(part, views, None, stats,
                                     host_grads=self.lanes.grads_on_host(part, stats)
                                     if route == "offload" else None)

    def origin(self, s: Segment) -> tuple[int, int]:
        """The user's parameter `s` is part of, and the element of it `s` starts at."""
        index, start = (self.origins[s.index] if s.index < len(self.origins)
                        else (s.index, 0))
        return index, start + s.start

    def runs_native(self, part: Partition) -> bool:
        """Whether tiermem's native kernel updates `part` (in `_update_native`): the rule
        wants it for this kernel setting and the update runs on host memory."""
        return self.rule.wants_native(self.settings.optimizer.kernel, part,
                                      on_host=self._route(part) is None and not self.emulated)

    def _gathered_update(self, part: Partition, views: Views,
                         scratch: torch.Tensor | None, stats: StepStats | None = None, *,
                         host_grads: list[torch.Tensor | None] | None = None) -> None:
        """The rule's update on `part`'s record `views` wherever they are (host memory, a
        device slot of the lanes, or the GPU tier), then the model's weights refreshed
        from the master.

        scratch: an fp32 area for upcast grads (else one kept per device); host_grads: the
        grads the lanes copied to the host (step_device cpu). Without stats (the lanes run
        it on the compute stream and time it themselves) nothing is timed here."""
        if stats is None:
            stats = StepStats()  # figures of a queued kernel: the lanes time it
        group = self.opt.param_groups[part.group]
        master = views.get("master")
        batch = Batch(part, group, state={k: [] for k in part.kinds if k != "master"},
                      threads=self._update_threads())
        slices = {k: part.slices(k) for k in part.kinds}
        copies_back = []
        # (record's copy, model weights): master_weights kahan/none, or an fp32 CPU model's
        # master, committed
        kept = []
        updated = []
        off = 0
        # A host record updated from host grads (a CPU model's, or those the lanes already
        # copied over) gathers and writes back within host memory, copying nothing across
        # host<->device: a timeline shows these spans on the host optimizer's lane, so a
        # CPU-only run has no host<->device lane.
        on_host = all(v.device.type == "cpu" for v in views.values()) and (
            host_grads is not None or all(s.param.device.type == "cpu" for s in part.segments))
        track = "host optimizer" if on_host else None
        with timed(stats, "transfer_seconds", f"grads in p{part.id}", part.id, track):
            for i, s in enumerate(part.segments):
                sl = slice(off, off + s.length)
                off += s.length
                g = s.param.grad
                if g is None:
                    continue
                g = (host_grads[i] if host_grads is not None
                     else flat_like(g, s.param)[s.start: s.start + s.length])
                weights = flat(s.param.detach())[s.start: s.start + s.length]
                if master is not None and host_grads is None and \
                        weights.dtype == torch.float32 and weights.device == master.device:
                    # as in _native_batch: the fp32 model's own weights are stepped, and the
                    # record's master (what a commit keeps) copied from them after
                    target = weights
                    kept.append((master[sl], target))
                elif master is not None:
                    target = master[sl]
                    if g.dtype != torch.float32 or g.device != target.device:
                        if scratch is None:
                            scratch = self._scratch_for(target.device, part.numel)
                        g = scratch[sl].copy_(g)
                    copies_back.append((s, target))
                else:
                    target = weights
                    if "weight" in views:
                        kept.append((views["weight"][sl], target))
                batch.params.append(target)
                batch.grads.append(g)
                batch.segments.append(s)
                batch.origins.append(self.origin(s))
                self._gather_counts(batch, s)
                updated.append(s.index)
                for k, lst in batch.state.items():
                    lst.append(views[k][slices[k][i]])
        if not batch.params:
            # Every gradient of the partition is gone (zero_grad after a backward that was
            # cut short, its partition already queued for the worker): nothing to step.
            return None
        kernel = self.settings.optimizer.kernel
        if kernel == "auto":  # native where it runs (runs_native); here what the rule says
            kernel = self.rule.auto_for(group)
        if kernel == "match":  # what torch would run where this update runs
            kernel = kernel_matching(group, batch.params[0].device)
        with timed(stats, "update_seconds", f"update p{part.id}", part.id), \
                update_range(part.id):
            self.rule.update(batch, kernel=kernel)
            for rec, weights in kept:
                rec.copy_(weights)
        for index, sc in zip(updated, batch.scalars):
            if sc:
                self._next_scalars[index] = sc
        if host_grads is not None:
            self.lanes.weights_to_device(part, copies_back, stats)
            return None
        with timed(stats, "transfer_seconds", f"weights out p{part.id}", part.id, track):
            for s, target in copies_back:
                # Refresh the model's (low-precision or device) weights from the master.
                flat(s.param.detach())[s.start: s.start + s.length].copy_(target)
        return None

    def _gather_counts(self, batch: Batch, s: Any) -> None:
        """The segment's step count (after this step's increment), whether this is its
        parameter's first step, and private copies of its parameter's scalars as the last
        step left them."""
        step = self.steps[s.index]
        batch.steps.append(step)
        first = float(step) <= 1
        fills = first and self.fills(s.index)
        batch.first.append(fills)
        # an entry of step 0 (unstepped_state: loaded, held at entry) is started from,
        # its scalars too (ASGD's eta, saved by an ASGD with another lr), as torch's
        # step does for a parameter holding state: not the rule's starting values
        have = {} if fills else self.scalars[s.index]
        mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in have.items()}
        start = self.rule.initial_scalars(batch.group)
        for k in self.rule.scalar_keys(batch.group):
            if k not in mine:
                mine[k] = torch.tensor(start[k], dtype=torch.float32)
        batch.scalars.append(mine)

    def set_counts(self, index: int, step: float, scalars: dict[str, torch.Tensor]) -> None:
        """Parameter `index`'s step count and scalars, as a checkpoint gives them."""
        self.steps[index] = step
        self.scalars[index] = scalars
        self._next_scalars.pop(index, None)

    def latest_scalars(self, index: int) -> dict[str, torch.Tensor]:
        """Parameter `index`'s scalars as its last update left them."""
        return self._next_scalars.get(index, self.scalars[index])

    def _wants_digest(self, part: Partition) -> bool:
        """The record is written to a checksummed swap file right after its update."""
        return self.settings.swap.checksums and (part.tier == "nvme" or self.crash)

    def _update_native(self, part: Partition, views: Views, stats: StepStats) -> int | None:
        """CPU model, native kernel: one pass per segment reads the gradient (fp32, bf16
        or fp16), updates master and moments in the record, and writes the model's
        low-precision weights, with no staging copy before or after. When the record is
        about to be checksummed, the same pass returns the CRC32C of every array it
        wrote, and the record's CRC is assembled from them (returned; else None).

        With bf16 state (optimizer.state_dtype) every CPU model comes here: an fp32 model
        is its own master (no weight output), and the moments are stored rounded as
        optimizer.state_rounding says."""
        hashed = part.kinds if self._wants_digest(part) else ()
        # bf16 moments run here whatever the step device: a device model's partition
        # (step_device cpu) takes its grads from the lanes and sends its weights back by them
        host_grads = (self.lanes.grads_on_host(part, stats) if self._route(part) == "offload"
                      else None)
        built = self._native_batch(part, views, hashed, host_grads)
        batch = built.batch
        with timed(stats, "update_seconds", f"update p{part.id}", part.id), \
                update_range(part.id):
            got = self.rule.update(batch, kernel="native") if batch.params else []
            built.copy_out()
            digest = None
            if hashed:
                crcs: list[dict[str, int] | None] = [None] * len(part.segments)
                for n, c in zip(built.updated, got, strict=True):
                    crcs[n] = c if all(k in c for k in hashed) else None  # else hashed here
                digest = record_digest(part, views, crcs)
        if host_grads is not None:
            self.lanes.weights_to_device(part, built.to_device, stats)
        return digest

    def _native_batch(self, part: Partition, views: Views, hashed: Sequence[str] = (),
                      host_grads: list[torch.Tensor | None] | None = None) -> NativeBatch:
        """What the native kernel's update of `part` takes (see _update_native), and the
        copies to make after it. host_grads: the grads the lanes brought to the host
        (step_device cpu); the weights then go back by the lanes (`to_device`), from the
        master every such record keeps."""
        master = views.get("master")
        if host_grads is not None and master is None:
            raise TierMemError(f"partition {part.id} is updated on the host for a model off "
                               "the CPU but its record keeps no master weights")
        batch = Batch(part, self.opt.param_groups[part.group],
                      state={k: [] for k in part.kinds if k != "master"}, weights_out=[],
                      checksums=hashed, threads=self._update_threads())
        built = NativeBatch(batch)
        slices = {k: part.slices(k) for k in batch.state}  # int8 scales: one per block
        off = 0
        for n, s in enumerate(part.segments):
            sl = slice(off, off + s.length)
            off += s.length
            if s.param.grad is None:
                continue
            built.updated.append(n)
            weights = flat(s.param.detach())[s.start: s.start + s.length]
            # an fp32 CPU model's own weights are what the step starts from, as for the plain
            # optimizer (a clamp or a load_state_dict since the last step counts); the
            # record's master is only the copy a commit keeps
            own = master is None or (host_grads is None and weights.dtype == torch.float32)
            batch.params.append(weights if own else master[sl])
            if host_grads is not None:
                batch.weights_out.append(None)
                batch.grads.append(host_grads[n])
                built.to_device.append((s, master[sl]))
            else:
                batch.weights_out.append(None if own else weights)
                batch.grads.append(flat_like(s.param.grad, s.param)[s.start: s.start + s.length])
                if master is not None and own:
                    built.copies.append((master[sl], weights))
            batch.steps.append(self.steps[s.index])
            # SGD's buffer starts there; Adagrad's accumulator, unless it has state
            batch.first.append(float(self.steps[s.index]) <= 1 and self.fills(s.index))
            batch.segments.append(s)
            batch.origins.append(self.origin(s))
            for k, lst in batch.state.items():
                lst.append(views[k][slices[k][n]])
            if "weight" in views:
                built.copies.append((views["weight"][slices["weight"][n]], weights))
        return built

    # -- crash-consistent commits --------------------------------------------------

    def _meta(self, step: int | None = None) -> dict[str, Any]:
        """What a manifest says besides the records: step counts, parameters, groups."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [{**{k: jsonable(v) for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]}
                  for g in self.opt.param_groups]
        # with parameters.offload a parameter is empty between uses: its shape is the tier's
        shaped = (self.params if self.weights is None
                  else [self.weights.stand_in(p) for p in self.params])
        params = [{"name": self.names.get(id(p), ""), "shape": list(q.shape),
                   "dtype": str(p.dtype).removeprefix("torch.")}
                  for p, q in zip(self.params, shaped)]
        for i, (entry, q) in enumerate(zip(params, shaped)):
            # recover lays its state out as torch's would be; the parameter tier holds
            # contiguous parameters only, and its stand-ins have a shape, not a layout
            if self.weights is None and not q.is_contiguous():
                entry["stride"] = list(q.stride())
            scalars = self.latest_scalars(i)
            if scalars:
                entry["scalars"] = {k: scalar_to_json(v) for k, v in scalars.items()}
        changed = self.rule.step_values()
        values = {"groups": {g: {k: step_value_to_json(v) for k, v in vs.items()}
                             for g, vs in changed.get("groups", {}).items()},
                  "own": {k: step_value_to_json(v) for k, v in changed.get("own", {}).items()},
                  "state": {k: step_value_to_json(v)
                            for k, v in changed.get("state", {}).items()},
                  "absent": list(changed.get("absent", []))} if changed else {}
        return {"step": self.steps_taken if step is None else step,
                "steps": self.steps.values(), "params": params, "groups": groups,
                "rule": type(self.rule).__name__, "values": values, "share": self.share,
                **self._stateless_meta()}

    def _stateless_meta(self) -> dict[str, Any]:
        """The manifest's version 4 fields, or version 3 while which parameters hold state
        is not known (resumed from a version-3 manifest, Adagrad): a version 4 would say
        every never-stepped parameter holds the state its record has, where the first step
        fills it instead (and a group added then has zeros in its record)."""
        if not self.stateless_known:
            return {"version": 3}
        return {"defaults": {str(k): _default_json(v) for k, v in self.opt.defaults.items()},
                "stateless": sorted(i for i in self.stateless if self.steps[i].item() == 0),
                "unstepped_state": sorted(i for i in self.unstepped_state
                                          if self.steps[i].item() == 0),
                "late": [{"at": lay["at"], "params": list(lay["params"])}
                         for lay in self.late]}

    def commit(self, step: int | None = None) -> None:
        """Make the state as it is now the one a crash resumes to (crash_consistent)."""
        self._refresh_edited_masters()
        meta = self._meta(step)
        self.tiers.commit(**meta)
        self.committed_step = meta["step"]
        self.edits.settled()  # (the records took every change: _refresh_edited_masters)

    def weights_synced(self, index: int, before: int, after: int) -> None:
        """Parameter `index`'s weights went from version `before` to `after` by writes that
        changed none of this optimizer's elements of it (a rank's all-gather of its peers'
        pieces into the parameter its own piece is a view of): no edit, so the next commit
        need not take them (EditedWeights.synced)."""
        self.edits.synced(index, before, after)

    def _refresh_edited_masters(self) -> None:
        """A parameter that took no step since its weights were changed (a clamp, a
        load_state_dict) kept the record of before, so a resume put back its weights of
        before the change: the records take the changes before the commit (optim/edits.py
        says which; a rank's all-gather of its peers' pieces is no change: weights_synced).
        An fp32 CPU model's master is only the copy a commit keeps (its own weights are
        what a step starts from); any other's is what the next step starts from, which
        would take the change all the same (_first_step_masters). master_weights
        kahan/none keep a copy of the weights instead (_take_into_record)."""
        if self.weights is not None:
            self._refresh_tier_masters()
            return
        self.edits.note()
        pending = self.edits.pending
        for part in self.parts if pending else ():
            self._take_into_record(part, pending)

    def _take_into_record(self, part: Partition, edited: set[int],
                          weights: Any = None) -> None:
        """The record of `part` takes the changed weights of its parameters in `edited`:
        its masters (take_edits), or its copy of the weights and the Kahan terms that
        still fit them. `weights`: the parameter tier, which materialises them."""
        kind = "master" if "master" in part.kinds else "weight" if "weight" in part.kinds \
            else None
        if kind is None or self.tiers.is_fresh(part):
            return
        stale = [(n, s) for n, s in enumerate(part.segments) if s.index in edited]
        if not stale:
            return
        there = (weights.materialised([s.param for _, s in stale]) if weights is not None
                 else contextlib.nullcontext())
        with self.tiers.record(part, write=True) as (views, _), there:
            slices = {k: part.slices(k) for k in views}
            for n, s in stale:
                w = flat(s.param.detach())[s.start: s.start + s.length]
                if kind == "master":
                    take_edits(views["master"][slices["master"][n]], w)
                    continue
                views["weight"][slices["weight"][n]].copy_(w)
                if "kahan" in views:
                    keep_kahan_terms(views["kahan"][slices["kahan"][n]], w)

    def _refresh_tier_masters(self) -> None:
        """_refresh_edited_masters with parameters.offload: the tier says which weights were
        changed other than by a step since the last commit (an edit of a parameter that
        took no step since: a resume put back its weights of before the change)."""
        edited = self.weights.take_edited()
        for part in self.parts if edited else ():
            self._take_into_record(part, edited, self.weights)

    def close_step(self, stats: StepStats) -> None:
        """The step happened, whether or not its commit (crash-consistent) then succeeds:
        count it and keep its figures first."""
        if self.lanes is not None:
            self.lanes.end_step(stats)
        # The step's own writes of the weights are no edits (a parameter that is a view of
        # one buffer with others moved their version counters too); the changes its updates
        # did not take stay pending.
        self.edits.record()
        self.history.append(stats)
        self.steps_taken += 1
        if self.crash:
            self._commit_step(stats.step)

    def _commit_step(self, step: int) -> None:
        try:
            self.commit(step)
        except TierMemError as exc:
            # The step itself is complete in memory and in the swap files; only its commit
            # is missing, so nothing is rolled back and the next commit may succeed.
            raise TierMemError(
                f"step {step} completed but could not be committed to disk ({exc}); a crash "
                f"now would resume at step {self.committed_step}") from exc

    def roll_back(self, exc: BaseException, step: int, what: str | None = None) -> None:
        """A step (or `what`, a state method) failed part-way: reopen the last committed
        step, as a resume would, so the optimizer and the model are back where that step
        left them."""
        what = what or f"step {step}"
        run_dir = self.tiers.run_dir()
        try:
            # The failed step's writes went to copies no manifest names: drop them.
            self.close_tiers(remove_swap=False, flush=False)
            manifest = read_manifest(run_dir, self.parts)
            self.tiers = TierManager(self.parts, self.settings, swap_name=self.swap_name,
                                     resume=manifest, keep_previous=self.keep_previous)
            self._adopt_counts(manifest)
            self._restore_weights()
            self.rule.undo_step_values()
        except BaseException as err:
            self.broken = (f"{what} failed part-way and rolling back to committed step "
                           f"{self.committed_step} failed too ({err}); that step stays on disk "
                           f"in {run_dir}: leave the offload block and resume from it")
            exc.add_note(f"tiermem: {self.broken}")
            return
        exc.add_note(f"tiermem: {what} failed part-way; the optimizer state and the "
                     f"model's weights were rolled back to committed step {manifest.step}")
        if self.overlap is not None and self.weights is not None:
            # The updates during backward took their gradients from memory, where nothing
            # keeps them past the update (their records were never written): a step run
            # again would miss them, or read records that were never written.
            self.gradients_gone = (
                f"step {step} was rolled back after updates during backward had used "
                "gradients that the parameter tier does not keep (pipeline.overlap_backward "
                "with parameters.offload); call optimizer.zero_grad() and run that step's "
                "forward and backward again before optimizer.step()")
            exc.add_note(f"tiermem: {self.gradients_gone}")

    def _adopt_counts(self, manifest: Any) -> None:
        self.steps = StepCounts(manifest.steps)
        self.stateless = self._without_state(manifest.stateless)
        self.stateless_known = manifest.version >= 4 or not self.rule.eager_state
        self.unstepped_state = self._with_state(manifest.unstepped_state)
        self.scalars = [{k: scalar_from_json(v) for k, v in (entry.get("scalars") or {}).items()}
                        for entry in (manifest.params or [{} for _ in manifest.steps])]
        self._next_scalars = {}
        self.steps_taken = manifest.step
        self.committed_step = manifest.step if manifest.durability == "crash_consistent" else None

    def _restore_weights(self) -> None:
        """The model's weights from the committed records: fp32 masters, or the bf16
        weights a record keeps without one (master_weights kahan/none); with
        parameters.offload into the parameter tier, partition by partition."""
        for part in self.parts:
            with self.tiers.record(part, write=False) as (views, fresh):
                if fresh:
                    continue  # never stepped nor initialised: the model's weights are its own
                kind = "master" if "master" in views else "weight"
                with self._model_weights(part, changed=True):
                    for s, sl in zip(part.segments, part.slices(kind)):
                        flat(s.param.detach())[s.start: s.start + s.length].copy_(
                            views[kind][sl])
        # The weights are the commit's now, as after a commit: an edit from here on is one
        # the next commit must see (a resume never commits before its first step, so with no
        # snapshot an edit made before a step some parameters take no part in was lost)
        self.edits.settled()

    def _model_weights(self, part: Partition, *, changed: bool = False
                       ) -> contextlib.AbstractContextManager:
        """`part`'s parameters hold their weights for the duration (with
        parameters.offload: materialised from the tier, written back after if `changed`)."""
        if self.weights is None:
            return contextlib.nullcontext()
        return self.weights.materialised([s.param for s in part.segments], changed=changed)

    def _initialise(self, parts: list[Partition]) -> None:
        """Build every never-written record (zero state, master from the model) in place."""
        for part in parts:
            if self.tiers.is_fresh(part):
                with self.tiers.record(part, write=True) as (views, _), \
                        self._model_weights(part):
                    self.rule.init(part, views)

    def keep_on_disk(self) -> str:
        """Leave the state on disk with a manifest; returns the directory."""
        return self.tiers.keep_on_disk(**self._meta())

    # -- state in torch's format ------------------------------------------------

    def _import(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Scatter per-parameter state (torch's layout) into the partition records.

        copy_ casts: with bf16 state the moments are rounded to nearest even here."""
        index = {id(p): i for i, p in enumerate(self.params)}
        # (committed by the caller with the state imported: a load, or the entry)
        self.lay_out_late((index[id(p)] for p, st in state.items() if st), commit=False)
        state = {p: self.rule.from_torch_state(self._shaped(p), self.opt.param_groups[
            self._group_of(index[id(p)])], st) for p, st in state.items()}
        for p, st in state.items():
            self._refuse_misshapen(index[id(p)], st)
        for p, st in state.items():
            i = index[id(p)]
            if "step" in st:
                self.steps[i] = float(st["step"])
                if self.steps[i].item() == 0:  # an entry all the same (a skipped step's)
                    self.unstepped_state |= self._with_state([i])
            elif st and not self.rule.has_step:
                # torch keeps no count (SGD): state present means the first step is done.
                self.steps[i] = 1.0
            group = self.opt.param_groups[self._group_of(i)]
            self.scalars[i] = self.rule.host_scalars(st, group)
            self._next_scalars.pop(i, None)
        scatter(self.tiers, self.parts, self.rule.torch_keys, state)
        # the loaded state's masters (or the weights, where it has none) are the records
        # now: a change made to the weights before the load is superseded by it
        loaded = [index[id(p)] for p in state]
        self.edits.settled(loaded)
        if self.weights is not None:
            self.weights.forget_edits(self.params[i] for i in loaded)

    def _refuse_misshapen(self, i: int, st: dict[str, Any]) -> None:
        """Refuse state of parameter `i` that is not the size of what its record holds
        (a checkpoint of a model since resized, as by resize_token_embeddings): the
        records take a flat run of each tensor's elements, so a larger one was cut to fit,
        silently, where the plain optimizer's next step raises on the mismatch."""
        shaped = self._shaped(self.params[i])
        group = self.opt.param_groups[self._group_of(i)]
        expected = [(k, shape) for k, shape, _ in self.rule.torch_state_tensors(
            shaped, group, shaped.dtype)]
        if "master" in self.rule.torch_keys:  # an fp32 master of a low-precision weight
            expected.append((self.rule.torch_keys["master"], tuple(shaped.shape)))
        for key, shape in expected:
            value = st.get(key)
            if isinstance(value, torch.Tensor) and value.numel() != math.prod(shape):
                name = self.names.get(id(self.params[i])) or f"parameter {i}"
                raise TierMemError(
                    f"the state loaded for {name} (shape {tuple(shaped.shape)}) has "
                    f"{key!r} of shape {tuple(value.shape)}, where {shape} is expected: a "
                    "state_dict of another model (or of this one before it was resized) "
                    "cannot be loaded; the plain optimizer's next step would fail on it")

    def export_state(self, *, model_dtype: bool) -> dict[torch.Tensor, dict[str, Any]]:
        """Gather every record into per-parameter tensors (torch's layout), partition by partition.

        model_dtype: moments in each parameter's dtype (what a plain torch
        optimizer keeps); else fp32, plus the fp32 master weight of
        low-precision parameters under 'master_param'. bf16 moments (state_dtype) are
        widened exactly to those dtypes.
        """
        out: dict[torch.Tensor, dict[str, Any]] = {}
        # A rule with fixed keys exports what its records hold, not what the group's
        # settings ask for now: torch keeps (and hands back) a buffer made before its
        # setting was turned off, and makes none for one turned on until the next step
        # (SGD's momentum from 0, amsgrad), which tiermem refuses, records laid out as
        # they are.
        laid: dict[int, list[str]] = {}
        if self.rule.fixed_keys:
            for part in self.parts:
                keys = [self.rule.torch_keys[k] for k in part.kinds
                        if k != "master" and k in self.rule.torch_keys]
                for s in part.segments:
                    laid.setdefault(s.index, keys)
        for i, p in enumerate(self.params):
            if not self.has_state(i):
                continue  # never stepped: torch keeps no state for it either
            dtype = p.dtype if model_dtype else torch.float32
            st: dict[str, Any] = {"step": self.steps[i].clone()} if self.rule.has_step else {}
            st.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                       for k, v in self.latest_scalars(i).items()})
            group = self.opt.param_groups[self._group_of(i)]
            shaped = self._shaped(p)
            # (a parameter of no elements is in no record: what its group keeps, empty)
            tensors = ([(k, tuple(shaped.shape), dtype) for k in laid[i]] if i in laid
                       else self.rule.torch_state_tensors(shaped, group, dtype))
            for k, shape, kdtype in tensors:
                # torch keeps a non-contiguous (channels_last) parameter's state with its
                # strides (zeros_like, preserve_format); gather fills it in memory order
                st[k] = (torch.zeros_like(shaped, dtype=kdtype, device=p.device)
                         if shape == tuple(shaped.shape) and not shaped.is_contiguous()
                         else torch.zeros(shape, dtype=kdtype, device=p.device))
            if not st:
                continue  # torch keeps nothing for it (SGD without momentum)
            if not model_dtype and p.dtype != torch.float32:
                weights = p.detach() if self.weights is None else self.weights.current_weight(p)
                st[self.rule.torch_keys["master"]] = weights.float().clone()
            out[p] = st
        gather(self.tiers, self.parts, self.rule.torch_keys, out)
        if self.rule.eager_state and not self.stateless_known:
            # (resumed from a version-3 manifest) A parameter never stepped starts its
            # first step from what the rule fills in then (Adagrad: the defaults'
            # accumulator), not from its record, which holds zeros for a group added after
            # entry: a plain optimizer loading this state must start where tiermem's next
            # step would.
            for i, p in enumerate(self.params):
                if p in out and self.steps[i].item() == 0:
                    fill = self.rule.first_fill(self.opt.param_groups[self._group_of(i)])
                    for k, v in fill.items():
                        out[p][self.rule.torch_keys[k]].fill_(v)
        return {p: self.rule.to_torch_state(self._shaped(p), self.opt.param_groups[
            self._group_of(i)], out[p]) for i, p in enumerate(self.params) if p in out}

    def holds_state(self) -> bool:
        """Whether a plain optimizer would hold per-parameter state now (some parameter
        has stepped, or the optimizer makes its state eagerly): what `opt.state` answers
        to truth testing inside the block (hooks.HeldState)."""
        # (check_group refuses a group whose settings changed the state it keeps)
        return any(self.has_state(i)
                   and self.rule.keeps_entry(self.opt.param_groups[self._group_of(i)])
                   for i in range(len(self.params)))

    def has_state(self, index: int) -> bool:
        """Whether the plain optimizer would hold an entry for parameter `index` now (some
        keys, as the rule keeps them: none for SGD without momentum): it has stepped, or it
        holds state all the same (stateless, unstepped_state)."""
        if self.steps[index].item() != 0:
            return True
        if self.rule.eager_state:
            return index not in self.stateless
        return index in self.unstepped_state

    def skipped(self, indices: Iterable[int]) -> None:
        """A step GradScaler skipped, of the parameters `indices` with gradients: torch's
        fused step makes their state (_init_group) before it skips, where its rule says so
        (skip_makes_state): Adagrad's of a group added since construction, Adam's step 0
        and zero moments (which the records hold: the next step starts from them alike)."""
        if not self.rule.skip_makes_state:
            return
        indices = set(indices)
        self.lay_out_late(indices)  # frozen at entry, unfrozen since: the state is made now
        made = {i for i in indices if i in self.stateless and self.steps[i].item() == 0}
        if made:
            # torch makes that state with the rule's starting value (Adagrad's accumulator,
            # the defaults' initial_accumulator_value), and a parameter off `stateless`
            # (eager state) is one whose record holds its state: state_dict(), the next
            # step (fills), a commit's resume and recover all read the record from now
            # on. A group added inside the block has zeros there: fill it first, or every
            # one of them reads zeros where torch holds the starting value.
            self._fill_first(made)
        self.stateless -= indices
        self.unstepped_state |= self._with_state(i for i in indices
                                                 if self.steps[i].item() == 0)

    def _fill_first(self, indices: set[int]) -> None:
        """Write the rule's starting state (first_fill; zeros elsewhere) into the records
        of parameters `indices`, as torch makes it for a parameter holding none."""
        for part in self.parts:
            mine = [(n, s) for n, s in enumerate(part.segments) if s.index in indices]
            if not mine:
                continue
            self._initialise([part])  # a never-written record: zeros, master from the model
            fill = self.rule.first_fill(self.opt.param_groups[part.group])
            with self.tiers.record(part, write=True) as (views, _):
                for k in views:
                    if k in ("master", "weight", "kahan"):
                        continue  # the weights: no state of torch's
                    sl = part.slices(k)
                    for n, _s in mine:
                        views[k][sl[n]].fill_(fill.get(k, 0.0))

    def _refuse_unkept_keys(self, entries: dict[int, Any], groups: Sequence[dict],
                            where: str) -> None:
        """state_io.refuse_unkept_keys of this optimizer's parameters (`groups`: the param
        groups the state goes with, the current ones or a state_dict's)."""
        refuse_unkept_keys(self.rule, self.opt, entries, lambda i: groups[self._group_of(i)],
                           lambda i: self.names.get(id(self.params[i])) or f"param {i}",
                           where)

    def _without_state(self, indices: Iterable[int]) -> set[int]:
        """`indices` as self.stateless keeps them: only a rule with eager state has any."""
        return set(indices) if self.rule.eager_state else set()

    def _with_state(self, indices: Iterable[int]) -> set[int]:
        """`indices` as self.unstepped_state keeps them: a rule with eager state keeps the
        others (stateless), and one without a step count has none (a loaded entry counts
        as one step taken: _import)."""
        return set(indices) if not self.rule.eager_state and self.rule.has_step else set()

    def set_stateless(self, indices: Iterable[int], held: Iterable[int] = ()) -> None:
        """Parameters `indices` hold no state, every other one does, but never-stepped ones
        of a rule without eager state, which hold state only where listed in `held`: what
        a checkpoint loaded says (tiermem.dist.dcp)."""
        self.stateless = self._without_state(indices)
        self.unstepped_state = self._with_state(held)
        self.stateless_known = True

    def fills(self, index: int) -> bool:
        """Whether parameter `index`'s first step starts its state afresh (the rule's
        first_fill: Adagrad's accumulator) rather than from its record: always, but for
        a rule with eager state, whose optimizer starts from the state it holds (made in
        __init__, or loaded) and fills only where it holds none, and for a parameter
        holding an entry of step 0 all the same (unstepped_state), which torch's step
        starts from (len(state) != 0)."""
        if index in self.unstepped_state:
            return False  # it holds state (an entry of step 0): torch's step starts from it
        return (not self.rule.eager_state or not self.stateless_known
                or index in self.stateless)

    def _shaped(self, p: torch.Tensor) -> torch.Tensor:
        """`p` with its shape: with the weights in the parameter tier p is empty between
        uses, and its shape and weights come from the tier."""
        return p if self.weights is None else self.weights.stand_in(p)

    def _group_of(self, index: int) -> int:
        n = 0
        for g, group in enumerate(self.opt.param_groups):
            n += len(group["params"])
            if index < n:
                return g
        raise IndexError(index)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state_dict, gathered from the tiers (fp32 moments)."""
        if self.overlap is not None:
            self.overlap.require_idle("optimizer.state_dict()")
        self.check_groups("optimizer.state_dict()")
        # (a half-applied step's or a half-done load's records would be handed out as state)
        self.refuse_unusable("optimizer.state_dict()")
        return torch_state_dict(self.opt, self.export_state(model_dtype=False))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format into the tiers without casting moments to the model dtype,
        between the optimizer's load_state_dict hooks."""
        load_with_hooks(self.opt, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.overlap is not None:
            self.overlap.require_idle("optimizer.load_state_dict()")
        self.check_groups("optimizer.load_state_dict()")
        # torch's own checks of the groups' shape, first: the layout check below reads
        # each saved group (SGD's a missing one failed there with KeyError: 'momentum')
        groups, saved_groups = self.opt.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't "
                             "match the size of optimizer's group")
        for part in self.parts:
            self.rule.check_loaded(part, saved_groups[part.group])
        # A parameter's entry is one under a key the saved groups list, the n-th of them
        # each parameter's entry, by its place in the saved groups (torch's mapping)
        entries, others = param_entries(state_dict, "tiermem's records")
        self._refuse_unkept_keys(entries, saved_groups, "loaded has")
        for i, st in entries.items():  # before anything is replaced: a refusal changes nothing
            if 0 <= i < len(self.params) and isinstance(st, dict):
                self._refuse_misshapen(i, st)
        # torch's own load takes the groups, and the entries under keys that are no
        # parameter (MADGRAD's count in state['k']) into opt.state, where they stay; the
        # optimizer's own load_state_dict also gets whatever else its state_dict() added
        # beside them (pytorch_optimizer's StableSPAM keeps its total_step there)
        groups_only = {**{k: v for k, v in state_dict.items()
                          if k not in ("state", "param_groups")},
                       "state": others, "param_groups": state_dict["param_groups"]}
        before = load_snapshot(self.opt)
        try:
            self._replace_state(groups_only, entries)
        except BaseException as exc:
            # From torch's load on, the groups, the counts and the records are replaced one
            # after another: a failure leaves some loaded and some not, which no step and no
            # state_dict() may take for either. A load that succeeds replaces every piece.
            self.load_failed(exc, changed_since(self.opt, before))
            raise
        self.half_loaded = None
        if self.crash:
            self.commit()

    def load_failed(self, exc: BaseException, changed: bool) -> None:
        """A load failed after it began replacing the state (`changed`: torch's load of the
        groups, first, did not refuse it before changing anything): `half_loaded` (the
        first such failure's, until a load succeeds), named on `exc`."""
        if not changed:
            # the records come after torch's load, so they were not touched either
            exc.add_note("tiermem: the load changed nothing; the optimizer state is as "
                         "it was before it" + (f" ({self.half_loaded})" if self.half_loaded
                                               else ""))
            return
        if self.half_loaded:
            exc.add_note(f"tiermem: {self.half_loaded}")
            return
        kept = (f", or leave the block and resume committed step {self.committed_step} "
                f"from {self.tiers.run_dir()}" if self.committed_step is not None else "")
        self.half_loaded = (
            f"optimizer.load_state_dict() failed part-way ({type(exc).__name__}: {exc}), "
            "leaving the optimizer state partly loaded; load a state dict again (a load "
            f"that succeeds replaces all of it){kept}")
        exc.add_note(f"tiermem: {self.half_loaded}")

    def _replace_state(self, groups_only: dict[str, Any], entries: dict[int, Any]) -> None:
        """load_state_dict's replacing part: the groups (torch's own load), the counts and
        every record."""
        type(self.opt).load_state_dict(self.opt, groups_only)
        by_index = dict(enumerate(self.params))
        state = {by_index[i]: v for i, v in entries.items()}
        for i in range(len(self.params)):
            self.steps[i] = 0.0
            self.scalars[i] = {}
        self._next_scalars.clear()
        # torch's load replaces the state: a parameter the state_dict has no entry for
        # holds none (Adagrad's first step fills it then)
        self.stateless = self._without_state(i for i in range(len(self.params))
                                             if not entries.get(i))
        self.stateless_known = True
        self.unstepped_state = set()  # (_import below adds the entries of step 0)
        if self.weights is not None and any(k in part.kinds for part in self.parts
                                            for k in ("master", "weight", "kahan")):
            # a master missing from the checkpoint, a record's copy of the weights and a
            # Kahan term (the master less the weight) are taken from the model's weights
            with self.weights.materialised(self.params):
                self._import(state)
        else:
            self._import(state)
        drop_param_state(self.opt)

    @property
    def edits_taken(self) -> int:
        """Parameters whose changed weights an update took into its records so far."""
        return self.edits.taken

    @property
    def state_methods(self) -> tuple[str, ...]:
        """The optimizer's methods besides step() that use the per-parameter state
        (schedule-free's train()/eval()): the hooks route them to call_state_method."""
        return self.rule.state_methods()

    def call_state_method(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Run the optimizer's own `name`() over the tiers, one partition at a time, the
        way a step runs (its shadow holds the partition's weights, or fp32 masters, and the
        record's state); the model's weights are refreshed from the masters after."""
        if args or kwargs:
            raise TierMemError(f"optimizer.{name}() under tiermem takes no arguments")
        self.check_groups(f"optimizer.{name}()")
        self.refuse_unusable(f"optimizer.{name}()")
        if self.overlap is not None:
            self.overlap.require_idle(f"optimizer.{name}()")
        self.rule.begin_step(self.opt.param_groups)
        self._note_edits()  # (taken by the masters the method reads)
        try:
            self._run_state_method(name)
        except BaseException as exc:
            # The partitions before the failure went through the method (schedule-free's
            # eval() swapped their weights, its groups say eval) and the rest did not:
            # neither state, and calling it again would run it twice on the first ones.
            if self.crash:
                self.roll_back(exc, self.steps_taken, f"optimizer.{name}()")
            else:
                self.broken = (
                    f"optimizer.{name}() failed part-way ({type(exc).__name__}: {exc}): some "
                    "partitions' weights and state went through it and the rest did not, "
                    "and swap.durability scratch keeps no copy to go back to")
                exc.add_note(f"tiermem: {self.broken}")
            raise

    def _run_state_method(self, name: str) -> None:
        """call_state_method's pass over every partition."""
        with torch.no_grad(), deferred():
            for part in self.parts:
                group = self.opt.param_groups[part.group]
                # (parameters.offload: the weights it moves, from the tier and back)
                with self._model_weights(part, changed=True), \
                        self.tiers.record(part, write=True) as (views, fresh):
                    if fresh:
                        self.rule.init(part, views)
                    master = views.get("master")
                    batch = Batch(part, group, state={k: [] for k in part.kinds
                                                      if k != "master"})
                    slices = {k: part.slices(k) for k in part.kinds}
                    copies = []  # (to, from), once the method ran
                    for i, s in enumerate(part.segments):
                        weights = flat(s.param.detach())[s.start: s.start + s.length]
                        if master is None:
                            batch.params.append(weights)
                        elif weights.dtype == torch.float32 and \
                                weights.device == master.device:
                            # as in a step (_gathered_update): an fp32 CPU model's own
                            # weights, an edit since the last step included, are what the
                            # method reads; the master is only the copy a commit keeps
                            batch.params.append(weights)
                            copies.append((master[slices["master"][i]], weights))
                        else:
                            if not fresh and self._edited(part, s, master):
                                take_edits(master[slices["master"][i]], weights)
                            batch.params.append(master[slices["master"][i]])
                            copies.append((weights, master[slices["master"][i]]))
                        batch.segments.append(s)
                        batch.first.append(float(self.steps[s.index]) == 0)
                        batch.scalars.append({k: v.clone() if isinstance(v, torch.Tensor)
                                              else v for k, v in
                                              self.latest_scalars(s.index).items()})
                        for k, lst in batch.state.items():
                            lst.append(views[k][slices[k][i]])
                    self.rule.run_method(name, batch)
                    for to, src in copies:
                        to.copy_(src)
            # the weights and the records agree: the method wrote the one from the other
            # (every piece of a parameter cut over partitions took its changes first)
            self.edits.settled({s.index for part in self.parts for s in part.segments})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.overlap is not None:
            self.overlap.require_idle("optimizer.add_param_group()")
        self.check_groups("optimizer.add_param_group()")
        first_group = len(self.opt.param_groups)
        type(self.opt).add_param_group(self.opt, param_group)
        group = self.opt.param_groups[-1]
        left = dict(self.budgets.left)
        try:
            if self.weights is not None:
                self._check_weights_of(group["params"])
            # with parameters.offload the new parameters are empty between uses: their
            # records are laid out from their shapes, which the tier gives them meanwhile
            with (self.weights.shaped(group["params"]) if self.weights is not None
                  else contextlib.nullcontext()):
                self.rule.check(self.opt)
                new = build_partitions(
                    [group], self.names, self.settings.pipeline.partition_size,
                    self.settings.placement, first_id=len(self.parts),
                    first_index=len(self.params), keep_master=self._keep_master,
                    state_dtype=self.settings.optimizer.state_dtype,
                    master_weights=self.settings.optimizer.master_weights,
                    # every parameter, frozen or not: the user asked for them now (a
                    # group added before its parameters are unfrozen, which torch passes
                    # over until then), where _skip spares a LoRA run's frozen base weights
                    # the records they never need
                    **self._layouts([group]))
            for part in new:
                part.group = first_group
            if self.weights is not None:
                self.weights.check_partitions([s.param for s in part.segments] for part in new)
            self.budgets.assign(new)
            self._refuse_routes(new)
            self._add_lanes(new)  # slots grow to the largest record: harmless if refused below
            self.tiers.add(new)
        except BaseException:
            # A group the optimizer holds but tiermem does not would never be updated:
            # refused means not added at all.
            self.opt.param_groups.pop()
            self.budgets.left = left
            raise
        first = len(self.params)
        self.params.extend(group["params"])
        self.group_sizes.append(len(group["params"]))
        self.steps.extend(len(group["params"]))
        # torch's Adagrad makes state in __init__ only: a group added later has none
        self.stateless |= self._without_state(range(first, len(self.params)))
        self.scalars.extend({} for _ in group["params"])
        self.parts.extend(new)
        self.unlaid |= self._unlaid(new, range(first, len(self.params)))
        if self.weights is not None:
            self.weights.optimizer_holds(group["params"])
            self.weights.expect_updates(_pieces(new))
            if self.overlap is not None:
                # before the overlap's hooks below: the tier's stores each gradient first
                # (without overlap the tier hooks them at their next forward, which reads
                # their weights anyway)
                self.weights.take_gradients(group["params"])
        if self.crash:
            self._initialise(new)
            self.commit()
        if self.overlap is not None:
            self.overlap.add(new)

    def _check_weights_of(self, params: Sequence[torch.Tensor]) -> None:
        """A group added inside the block with parameters.offload: its parameters must be
        the model's, whose weights and gradients the tier holds (one made since, or of
        another module, has no record: the step could not open it)."""
        try:
            self.weights.indices(params)
        except TierMemError as e:
            raise TierMemError(
                f"optimizer.add_param_group() inside the block: {e}; add only parameters of "
                "the model passed to tiermem.offload(model=...)") from e
