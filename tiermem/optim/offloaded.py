"""OffloadedOptimizer: a torch Adam/AdamW whose state lives in tiers.

It validates the optimizer, gathers its parameters into partitions, and hooks
the optimizer *instance* (step, state_dict, load_state_dict, add_param_group)
so the user's object keeps behaving as a torch.optim.Optimizer: param_groups,
lr schedulers and zero_grad are untouched. `detach()` puts everything back.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any, Callable

import torch
from torch.autograd.profiler import record_function

from tiermem.config import Settings
from tiermem.device.lanes import DeviceLanes, emulating
from tiermem.errors import TierMemError
from tiermem.kernels.adam import adam_update, kernel_matching
from tiermem.swap.manifest import read_manifest, write_manifest
from tiermem.optim.hooks import Installed, run_post_hooks, run_pre_hooks, step_called
from tiermem.optim.overlap import BackwardOverlap
from tiermem.kernels.checksum import record_digest
from tiermem.partition import Partition, assign_tiers, build_partitions
from tiermem.tiers.pipeline import Views
from tiermem.signals import deferred
from tiermem.telemetry.stats import StepStats, timed
from tiermem.swap.rundir import run_dirs
from tiermem.tiers.manager import TierManager

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MASTER_KEY = "master_param"  # fp32 master weight of a low-precision param, in state_dict()
HISTORY = 1000  # steps of StepStats kept for tm.stats()
MIXED_OUT = (torch.bfloat16, torch.float16)  # model dtypes the native kernel writes directly


def _jsonable(value: Any) -> Any:
    """A param-group value as JSON keeps it (a tensor lr as its number)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def torch_state_dict(opt: torch.optim.Optimizer, state: dict[torch.Tensor, dict[str, Any]]
                     ) -> dict[str, Any]:
    """torch's own state_dict() of `opt` as if `state` were its per-parameter state (the
    tiers hold the real one: opt.state itself stays empty)."""
    saved = opt.state
    try:
        opt.state = defaultdict(dict, state)
        return type(opt).state_dict(opt)
    finally:
        opt.state = saved


class UnsupportedOptimizer(TierMemError, TypeError):
    """tiermem offloads torch.optim.Adam and torch.optim.AdamW only."""


def check_optimizer(opt: torch.optim.Optimizer) -> None:
    if not isinstance(opt, torch.optim.Adam):
        raise UnsupportedOptimizer(
            f"tiermem.offload supports torch.optim.Adam and torch.optim.AdamW (and their "
            f"subclasses), not {type(opt).__module__}.{type(opt).__qualname__}")
    for g, group in enumerate(opt.param_groups):
        if group.get("differentiable"):
            raise UnsupportedOptimizer(f"param_groups[{g}]: differentiable=True is not supported")
        for p in group["params"]:
            if not p.is_floating_point() or p.is_complex():
                raise UnsupportedOptimizer(f"param_groups[{g}]: parameters must be real "
                                           f"floating point, got {p.dtype}")
            if not p.is_contiguous():
                raise UnsupportedOptimizer(f"param_groups[{g}]: a parameter of shape "
                                           f"{tuple(p.shape)} is not contiguous")


def _check_state_dtype(opt: torch.optim.Optimizer, settings: Settings) -> None:
    """bf16 moments are updated by the native CPU kernel only: refuse what it cannot run."""
    if settings.optimizer.state_dtype != "bf16":
        return
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if p.device.type != "cpu":
                raise TierMemError(
                    f"param_groups[{g}]: optimizer.state_dtype bf16 needs the Adam step on "
                    f"the CPU for now, and a parameter is on {p.device}; use state_dtype "
                    "fp32 for models off the CPU")
            if p.dtype not in (torch.float32, *MIXED_OUT):
                raise TierMemError(
                    f"param_groups[{g}]: optimizer.state_dtype bf16 supports fp32, bf16 and "
                    f"fp16 parameters, not {p.dtype}")


class OffloadedOptimizer:
    """The tiered state of one Adam/AdamW instance, and the hooks that route to it."""

    def __init__(self, optimizer: torch.optim.Optimizer, settings: Settings, *,
                 model: torch.nn.Module | None = None, swap_name: str = "default",
                 resume: bool = False, resume_previous: bool = False,
                 keep_previous: bool = False) -> None:
        """resume_previous: resume from the commit before the last (manifest.PREVIOUS);
        keep_previous: every commit keeps the one before it (both: torch.distributed)."""
        check_optimizer(optimizer)
        _check_state_dtype(optimizer, settings)
        self.opt = optimizer
        self.settings = settings
        self.swap_name = swap_name
        self.crash = settings.swap.durability == "crash_consistent"
        self.keep_previous = keep_previous
        # Set when a failed step could not be rolled back: why no step may run any more.
        self.broken: str | None = None
        self.names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        if model is None and any(r.match != "*" for r in settings.placement):
            raise TierMemError("placement rules match parameter names: pass model= to "
                               "tiermem.offload so tiermem knows them")
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.steps = [torch.tensor(0.0) for _ in self.params]
        # The last HISTORY steps' figures: a long run keeps a bounded amount of them.
        self.history: deque[StepStats] = deque(maxlen=HISTORY)
        self.steps_taken = 0
        self.record_events = False  # timeline spans per step (tracing, plots)
        # Called with each partition once step() has updated it (its weights are final for
        # the step): distributed.py starts the weight all-gather of a window from it.
        self.after_update: Callable[[Partition], None] | None = None
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self.step_device = settings.optimizer.step_device
        # Under device_lanes.emulate_device() CPU parameters count as device ones: like a
        # CUDA model's, their records keep an fp32 master and their updates cross the lanes.
        self.emulated = emulating()
        self._keep_master = self.crash or self.emulated
        self.parts = build_partitions(optimizer.param_groups, self.names,
                                      settings.pipeline.partition_size, settings.placement,
                                      keep_master=self._keep_master,
                                      state_dtype=settings.optimizer.state_dtype)
        self._left = {"gpu": settings.tiers.gpu.capacity, "host": settings.tiers.host.capacity}
        self._assign(self.parts)
        # Streams, events and buffers between host memory and the device, made once.
        self.lanes: DeviceLanes | None = None
        self._add_lanes(self.parts)
        self.committed_step: int | None = None  # crash-consistent: the step a crash returns to
        manifest = None
        if resume:
            manifest = read_manifest(run_dirs(settings.swap.paths, swap_name)[0], self.parts,
                                     settings.swap.durability, previous=resume_previous)
            self._adopt_counts(manifest)
        self.resumed_step = manifest.step if manifest else None
        self.tiers = TierManager(self.parts, settings, swap_name=swap_name, resume=manifest,
                                 keep_previous=keep_previous)
        try:
            existing = {p: s for p, s in optimizer.state.items() if s}
            if resume_previous:
                # The commit gone back to is the latest from now on: a crash, or a step
                # rolled back, must not find the later one (its records get overwritten).
                write_manifest(self.tiers.run_dir(), manifest)
            if resume:
                if self.crash:
                    self._restore_weights()
                optimizer.state.clear()  # the kept state is the one to continue from
            elif existing:
                self._import(existing)
                optimizer.state.clear()  # the tiers hold it now; free the RAM
            if self.crash and not resume:
                # Step 0 committed: every record, weights included, on disk before training.
                self._initialise(self.parts)
                self._commit()
        except BaseException:
            # A failed resume must leave the kept state exactly as it was.
            self.tiers.close(remove_swap=not resume)
            raise
        self._hooks = Installed(optimizer, self)
        # Updates that start during backward (pipeline.overlap_backward; tiermem/overlap.py).
        self.overlap: BackwardOverlap | None = None
        if settings.pipeline.overlap_backward:
            try:
                self.overlap = BackwardOverlap(self, model)
            except BaseException:
                self.detach()
                self.tiers.close(remove_swap=True)
                raise

    # -- set-up ----------------------------------------------------------------

    def _assign(self, parts: list[Partition]) -> None:
        for p in parts:
            devices = {s.param.device.type for s in p.segments}
            if p.forced == "gpu" or (p.forced is None and self._left["gpu"] >= p.record_bytes):
                if not torch.cuda.is_available():
                    raise TierMemError("tiers.gpu.capacity > 0 (or a rule sends state to the "
                                       "gpu tier) but no CUDA device is available")
                if devices != {"cuda"}:
                    raise TierMemError("the gpu tier holds state of CUDA parameters only; "
                                       "this model's parameters are on the CPU")
        assign_tiers(parts, self._left["gpu"], self._left["host"])
        for p in parts:
            if p.tier in self._left:
                self._left[p.tier] -= p.record_bytes

    def _route(self, part: Partition) -> str | None:
        """How `part` is updated: "device" (record streamed to the device, step_device
        device), "offload" (grads to the host, weights back; step_device cpu), or None
        (in place: GPU-tier records, and CPU models' host/NVMe records)."""
        if part.tier == "gpu":
            return None
        if self.step_device == "device":
            return "device"
        on_device = self.emulated or any(s.param.device.type != "cpu" for s in part.segments)
        return "offload" if on_device else None

    def _add_lanes(self, parts: list[Partition]) -> None:
        routed = [p for p in parts if self._route(p) is not None]
        if not routed:
            return
        if self.lanes is None:
            self.lanes = DeviceLanes(routed, self.step_device)
        else:
            self.lanes.add(routed)

    def _stage(self, part: Partition, views: Views) -> None:
        if self.lanes is not None and self._route(part) is not None:
            self.lanes.stage(part, views)

    def detach(self) -> None:
        """Remove the hooks (state must have been exported or kept on disk first)."""
        self.end_overlap()
        self._hooks.remove()

    # -- the step --------------------------------------------------------------

    def end_overlap(self) -> BaseException | None:
        """Stop updating during backward (hooks off, worker done); return an error the worker
        hit that no step() raised."""
        overlap, self.overlap = self.overlap, None
        return overlap.close() if overlap is not None else None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.broken:
            raise TierMemError(self.broken)
        if self.overlap is not None:
            # Ctrl-C / SIGTERM leave only between partitions (signals.safe_point), never
            # with a record's write half issued.
            with deferred():
                return self.overlap.step(closure)
        args, kwargs = run_pre_hooks(self.opt, (closure,), {})
        closure = args[0] if args else kwargs.get("closure")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with deferred():  # as above; the closure (forward, backward) stays interruptible
            self._step_tiers()
        run_post_hooks(self.opt, args, kwargs)
        return loss

    def _step_tiers(self) -> None:
        stats = StepStats(step=self.steps_taken + 1,
                          events=[] if self.record_events else None)
        with timed(stats, "step_seconds"), torch.no_grad():
            self._check_groups()
            stepped = set()
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise TierMemError("Adam does not support sparse gradients")
                    stepped.add(i)
            for i in stepped:  # only once nothing can refuse the step
                self.steps[i] += 1

            def active(part: Partition) -> bool:
                return any(s.index in stepped for s in part.segments)

            try:
                self.tiers.step(stats, active, self._init_record,
                                lambda part, views: self._update(part, views, stats),
                                self._after_update(),
                                stage=self._stage if self.lanes is not None else None)
            except BaseException as exc:
                if self.lanes is not None:
                    self.lanes.settle()  # queued copies and kernels done, nothing staged
                if self.crash:
                    self._roll_back(exc, stats.step)
                raise
            self._close_step(stats)
        step_called(self.opt)

    def _check_groups(self) -> None:
        for part in self.parts:
            group = self.opt.param_groups[part.group]
            if bool(group.get("amsgrad")) != ("max_exp_avg_sq" in part.kinds):
                raise TierMemError(f"param_groups[{part.group}]: amsgrad changed after "
                                   "tiermem.offload laid out the state; set it before")

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
        group = self.opt.param_groups[part.group]
        if self.settings.optimizer.state_dtype == "bf16" or (
                self.settings.optimizer.kernel == "native" and not self.emulated and all(
                    s.param.device.type == "cpu" and s.param.dtype in (torch.float32,
                                                                       *MIXED_OUT)
                    for s in part.segments)):
            return self._update_mixed_native(part, views, group, stats)
        route = self._route(part)
        if route == "device":
            self.lanes.update_on_device(
                part, views, lambda dev_views, scratch: self._adam(part, dev_views, group,
                                                                   scratch), stats)
            return None
        return self._adam(part, views, group, None, stats,
                          host_grads=self.lanes.grads_on_host(part, stats)
                          if route == "offload" else None)

    def _adam(self, part: Partition, views: Views, group: dict,
              scratch: torch.Tensor | None, stats: StepStats | None = None, *,
              host_grads: list[torch.Tensor | None] | None = None) -> None:
        """Adam on `part`'s record `views` wherever they are (host memory, a device slot of
        the lanes, or the GPU tier), then the model's weights refreshed from the master.

        scratch: an fp32 area for upcast grads (else one kept per device); host_grads: the
        grads the lanes copied to the host (step_device cpu). Without stats (the lanes run
        it on the compute stream and time it themselves) nothing is timed here."""
        if stats is None:
            stats = StepStats()  # figures of a queued kernel: the lanes time it
        master = views.get("master")
        lists: dict[str, list[torch.Tensor]] = {k: [] for k in
                                                 ("params", "grads", "steps", *MOMENTS)}
        copies_back = []
        off = 0
        with timed(stats, "transfer_seconds", f"grads in p{part.id}", part.id):
            for i, s in enumerate(part.segments):
                sl = slice(off, off + s.length)
                off += s.length
                g = s.param.grad
                if g is None:
                    continue
                g = (host_grads[i] if host_grads is not None
                     else g.reshape(-1)[s.start: s.start + s.length])
                if master is not None:
                    target = master[sl]
                    if g.dtype != torch.float32 or g.device != target.device:
                        if scratch is None:
                            scratch = self._scratch_for(target.device, part.numel)
                        g = scratch[sl].copy_(g)
                    copies_back.append((s, target))
                else:
                    target = s.param.detach().view(-1)[s.start: s.start + s.length]
                lists["params"].append(target)
                lists["grads"].append(g)
                lists["steps"].append(self.steps[s.index])
                for k in MOMENTS:
                    if k in views:
                        lists[k].append(views[k][sl])
        if not lists["params"]:
            # Every gradient of the partition is gone (zero_grad after a backward that was
            # cut short, its partition already queued for the worker): nothing to step.
            return None
        lr = group["lr"]
        beta1, beta2 = (float(b) for b in group["betas"])
        kernel = self.settings.optimizer.kernel
        if kernel == "match":  # what torch would run where this update runs
            kernel = kernel_matching(group, views[part.kinds[-1]].device)
        with timed(stats, "update_seconds", f"adam p{part.id}", part.id), \
                record_function(f"tiermem.adam p{part.id}"):
            adam_update(kernel=kernel, params=lists["params"], grads=lists["grads"],
                        exp_avgs=lists["exp_avg"], exp_avg_sqs=lists["exp_avg_sq"],
                        max_exp_avg_sqs=lists["max_exp_avg_sq"], steps=lists["steps"],
                        lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], amsgrad=bool(group["amsgrad"]),
                        maximize=bool(group["maximize"]),
                        decoupled_weight_decay=bool(group.get("decoupled_weight_decay",
                                                              False)))
        if host_grads is not None:
            self.lanes.weights_to_device(part, copies_back, stats)
            return None
        with timed(stats, "transfer_seconds", f"weights out p{part.id}", part.id):
            for s, target in copies_back:
                # Refresh the model's (low-precision or device) weights from the master.
                s.param.detach().view(-1)[s.start: s.start + s.length].copy_(target)
        return None

    def _wants_digest(self, part: Partition) -> bool:
        """The record is written to a checksummed swap file right after its update."""
        return self.settings.swap.checksums and (part.tier == "nvme" or self.crash)

    def _update_mixed_native(self, part: Partition, views: Views, group: dict,
                             stats: StepStats) -> int | None:
        """CPU model, native kernel: one pass per segment reads the gradient (fp32, bf16
        or fp16), updates master and moments in the record, and writes the model's
        low-precision weights, with no staging copy before or after. When the record is
        about to be checksummed, the same pass returns the CRC32C of every array it
        wrote, and the record's CRC is assembled from them (returned; else None).

        With bf16 state (optimizer.state_dtype) every CPU model comes here: an fp32 model
        is its own master (no weight output), and the moments are stored rounded as
        optimizer.state_rounding says. Stochastic rounding draws the bits of stream
        (step, partition id) at each element's position in the record, so a rerun, or
        another cut of the same partition into segments, rounds the same way."""
        from tiermem.kernels.native_adam import adam_fused_mixed, state_seed

        beta1, beta2 = (float(b) for b in group["betas"])
        bf16 = self.settings.optimizer.state_dtype == "bf16"
        master = views.get("master")
        hashed = part.kinds if self._wants_digest(part) else ()
        crcs: list[dict[str, int] | None] = []  # per segment; None: not updated this step
        off = 0
        with timed(stats, "update_seconds", f"adam p{part.id}", part.id), \
                record_function(f"tiermem.adam p{part.id}"):
            for s in part.segments:
                sl = slice(off, off + s.length)
                off += s.length
                if s.param.grad is None:
                    crcs.append(None)
                    continue
                weights = s.param.detach().view(-1)[s.start: s.start + s.length]
                # An fp32 model with a master (crash-consistent runs): the kernel writes
                # low-precision weights only, so the model copies its weights after.
                fp32_model = master is not None and weights.dtype == torch.float32
                rounding = {}
                if bf16:
                    rounding = dict(rounding=self.settings.optimizer.state_rounding,
                                    seed=state_seed(step=self.steps[s.index],
                                                    partition=part.id), offset=sl.start)
                crcs.append(adam_fused_mixed(
                    master=weights if master is None else master[sl],
                    grad=s.param.grad.reshape(-1)[s.start: s.start + s.length],
                    exp_avg=views["exp_avg"][sl], exp_avg_sq=views["exp_avg_sq"][sl],
                    max_exp_avg_sq=views["max_exp_avg_sq"][sl] if group["amsgrad"] else None,
                    weight_out=None if master is None or fp32_model else weights,
                    step=self.steps[s.index], lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                    decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
                    checksums=hashed, **rounding))
                if fp32_model:
                    weights.copy_(master[sl])
            return record_digest(part, views, crcs) if hashed else None

    def _init_record(self, part: Partition, views: Views) -> None:
        """A never-written record: zero moments, master weights from the model."""
        for k in MOMENTS:
            if k in views:
                views[k].zero_()
        if "master" in views:
            off = 0
            for s in part.segments:
                views["master"][off: off + s.length].copy_(
                    s.param.detach().reshape(-1)[s.start: s.start + s.length])
                off += s.length

    # -- crash-consistent commits --------------------------------------------------

    def _meta(self, step: int | None = None) -> dict[str, Any]:
        """What a manifest says besides the records: step counts, parameters, groups."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [{**{k: _jsonable(v) for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]}
                  for g in self.opt.param_groups]
        params = [{"name": self.names.get(id(p), ""), "shape": list(p.shape),
                   "dtype": str(p.dtype).removeprefix("torch.")} for p in self.params]
        return {"step": self.steps_taken if step is None else step,
                "steps": [float(t) for t in self.steps], "params": params, "groups": groups}

    def _commit(self, step: int | None = None) -> None:
        meta = self._meta(step)
        self.tiers.commit(**meta)
        self.committed_step = meta["step"]

    def _close_step(self, stats: StepStats) -> None:
        """The step happened, whether or not its commit (crash-consistent) then succeeds:
        count it and keep its figures first."""
        if self.lanes is not None:
            self.lanes.end_step(stats)
        self.history.append(stats)
        self.steps_taken += 1
        if self.crash:
            self._commit_step(stats.step)

    def _commit_step(self, step: int) -> None:
        try:
            self._commit(step)
        except TierMemError as exc:
            # The step itself is complete in memory and in the swap files; only its commit
            # is missing, so nothing is rolled back and the next commit may succeed.
            raise TierMemError(
                f"step {step} completed but could not be committed to disk ({exc}); a crash "
                f"now would resume at step {self.committed_step}") from exc

    def _roll_back(self, exc: BaseException, step: int) -> None:
        """A step failed part-way: reopen the last committed step, as a resume would, so the
        optimizer and the model are back where that step left them."""
        run_dir = self.tiers.run_dir()
        try:
            # The failed step's writes went to copies no manifest names: drop them.
            self.tiers.close(remove_swap=False, flush=False)
            manifest = read_manifest(run_dir, self.parts)
            self.tiers = TierManager(self.parts, self.settings, swap_name=self.swap_name,
                                     resume=manifest, keep_previous=self.keep_previous)
            self._adopt_counts(manifest)
            self._restore_weights()
        except BaseException as err:
            self.broken = (f"step {step} failed part-way and rolling back to committed step "
                           f"{self.committed_step} failed too ({err}); that step stays on disk "
                           f"in {run_dir}: leave the offload block and resume from it")
            exc.add_note(f"tiermem: {self.broken}")
            return
        exc.add_note(f"tiermem: step {step} failed part-way; the optimizer state and the "
                     f"model's weights were rolled back to committed step {manifest.step}")

    def _adopt_counts(self, manifest: Any) -> None:
        self.steps = [torch.tensor(float(s)) for s in manifest.steps]
        self.steps_taken = manifest.step
        self.committed_step = manifest.step if manifest.durability == "crash_consistent" else None

    def _restore_weights(self) -> None:
        """The model's weights from the committed fp32 masters."""
        for part in self.parts:
            def put(views: Views, fresh: bool, part=part) -> None:
                if fresh:
                    return  # never stepped nor initialised: the model's weights are its own
                off = 0
                for s in part.segments:
                    s.param.detach().view(-1)[s.start: s.start + s.length].copy_(
                        views["master"][off: off + s.length])
                    off += s.length
            self.tiers.with_record(part, put, write=False)

    def _initialise(self, parts: list[Partition]) -> None:
        """Build every never-written record (zero moments, master from the model) in place."""
        for part in parts:
            if self.tiers.is_fresh(part):
                self.tiers.with_record(
                    part, lambda views, fresh, part=part: self._init_record(part, views),
                    write=True)

    def keep_on_disk(self) -> str:
        """Leave the state on disk with a manifest; returns the directory."""
        return self.tiers.keep_on_disk(**self._meta())

    # -- state in torch's format ------------------------------------------------

    def _import(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Scatter per-parameter state (torch's layout) into the partition records.

        copy_ casts: with bf16 state the moments are rounded to nearest even here."""
        index = {id(p): i for i, p in enumerate(self.params)}
        for p, st in state.items():
            if "step" in st:
                self.steps[index[id(p)]] = torch.as_tensor(st["step"], dtype=torch.float32
                                                           ).detach().clone().cpu()
        for part in self.parts:
            def fill(views: Views, fresh: bool, part=part) -> None:
                off = 0
                for s in part.segments:
                    st = state.get(s.param, {})
                    sl = slice(off, off + s.length)
                    off += s.length
                    for k in views:
                        src = st.get(MASTER_KEY if k == "master" else k)
                        if src is None:
                            src = s.param.detach() if k == "master" else None
                        dst = views[k][sl]
                        if src is None:
                            dst.zero_()
                        else:
                            dst.copy_(src.reshape(-1)[s.start: s.start + s.length])
            self.tiers.with_record(part, fill, write=True)

    def export_state(self, *, model_dtype: bool) -> dict[torch.Tensor, dict[str, Any]]:
        """Gather every record into per-parameter tensors (torch's layout), partition by partition.

        model_dtype: moments in each parameter's dtype (what a plain torch
        optimizer keeps); else fp32, plus the fp32 master weight of
        low-precision parameters under 'master_param'. bf16 moments (state_dtype) are
        widened exactly to those dtypes.
        """
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for i, p in enumerate(self.params):
            if self.steps[i].item() == 0:
                continue  # never stepped: torch keeps no state for it either
            dtype = p.dtype if model_dtype else torch.float32
            st: dict[str, Any] = {"step": self.steps[i].clone()}
            group = self.opt.param_groups[self._group_of(i)]
            for k in MOMENTS:
                if k != "max_exp_avg_sq" or group.get("amsgrad"):
                    st[k] = torch.zeros(p.shape, dtype=dtype, device=p.device)
            if not model_dtype and p.dtype != torch.float32:
                st[MASTER_KEY] = p.detach().float().clone()
            out[p] = st
        for part in self.parts:
            def copy_out(views: Views, fresh: bool, part=part) -> None:
                if fresh:
                    return
                off = 0
                for s in part.segments:
                    sl = slice(off, off + s.length)
                    off += s.length
                    st = out.get(s.param)
                    if st is None:
                        continue
                    for k, src in views.items():
                        key = MASTER_KEY if k == "master" else k
                        if key in st:
                            st[key].view(-1)[s.start: s.start + s.length].copy_(src[sl])
            self.tiers.with_record(part, copy_out, write=False)
        return out

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
        return torch_state_dict(self.opt, self.export_state(model_dtype=False))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format into the tiers without casting moments to the model dtype."""
        if self.overlap is not None:
            self.overlap.require_idle("optimizer.load_state_dict()")
        for part in self.parts:
            saved = state_dict["param_groups"][part.group] if part.group < len(
                state_dict["param_groups"]) else {}
            if bool(saved.get("amsgrad")) != ("max_exp_avg_sq" in part.kinds):
                raise TierMemError(f"param_groups[{part.group}]: the checkpoint has amsgrad="
                                   f"{saved.get('amsgrad')}, the state laid out by "
                                   "tiermem.offload has not; load it before entering offload")
        groups_only = {"state": {}, "param_groups": state_dict["param_groups"]}
        type(self.opt).load_state_dict(self.opt, groups_only)
        by_index = dict(enumerate(self.params))
        state = {by_index[int(k)]: v for k, v in state_dict["state"].items()}
        for i in range(len(self.params)):
            self.steps[i] = torch.tensor(0.0)
        self._import(state)
        self.opt.state.clear()
        if self.crash:
            self._commit()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.overlap is not None:
            self.overlap.require_idle("optimizer.add_param_group()")
        first_group = len(self.opt.param_groups)
        type(self.opt).add_param_group(self.opt, param_group)
        group = self.opt.param_groups[-1]
        left = dict(self._left)
        try:
            check_optimizer(self.opt)
            _check_state_dtype(self.opt, self.settings)
            new = build_partitions([group], self.names, self.settings.pipeline.partition_size,
                                   self.settings.placement, first_id=len(self.parts),
                                   first_index=len(self.params), keep_master=self._keep_master,
                                   state_dtype=self.settings.optimizer.state_dtype)
            for part in new:
                part.group = first_group
            self._assign(new)
            self._add_lanes(new)  # slots grow to the largest record: harmless if refused below
            self.tiers.add(new)
        except BaseException:
            # A group the optimizer holds but tiermem does not would never be updated:
            # refused means not added at all.
            self.opt.param_groups.pop()
            self._left = left
            raise
        self.params.extend(group["params"])
        self.steps.extend(torch.tensor(0.0) for _ in group["params"])
        self.parts.extend(new)
        if self.crash:
            self._initialise(new)
            self._commit()
        if self.overlap is not None:
            self.overlap.add(new)
