"""BackwardOverlap: each partition's update starts during backward (pipeline.overlap_backward).

A post-accumulate-grad hook on every parameter says when backward has finished
its gradient. A partition is ready once every parameter of its segments that
requires grad has fired; it is queued to one worker thread, which runs the step's
own per-partition path (wait for its read, update, issue its write-back) while
backward goes on. The NVMe order is the order gradients completed in the step
before, so the reads of the first partitions are issued (by the worker, into
every buffer) as the previous step() ends, before backward starts, and each
partition's read is issued while the ones before it are updated.

optimizer.step() waits for the worker, raises the first error it hit, checks
that no gradient changed after its hook fired, updates the partitions no hook
made ready (parameters unused in this step, frozen ones) and closes the step
(crash-consistent runs commit it there, or roll it back when it raised: the
worker's writes went to copies no manifest names yet). A backward inside
`accumulating()` only accumulates. docs/guide/overlap.md has the rules.

Threads. Autograd's thread runs the hooks: they only mark and enqueue, under
`_lock`. Everything else (the pipeline, the tiers, the round's bookkeeping, the
step counts) belongs to the worker while it holds a queued item, and to the
user's thread once `_queue.join()` returned. step() queues one last item, the
next step's run-ahead reads (they fill every buffer while forward runs); so
everything of the user's thread that touches the tiers between steps (stats,
state_dict, checkpoints, the exit) joins the queue first.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from tiermem.errors import TierMemError, TierMemWarning
from tiermem.optim import amp
from tiermem.optim.hooks import run_post_hooks, run_pre_hooks, step_called
from tiermem.optim.rules import UnsupportedOptimizer
from tiermem.partition import Partition
from tiermem.telemetry.stats import Event, StepStats

if TYPE_CHECKING:
    from tiermem.optim.offloaded import OffloadedOptimizer

_STOP = None  # queued by close(): the worker returns
_RUN_AHEAD = "run ahead"  # queued by step(): the next step's reads, issued during forward


def _queued_event(grad: torch.Tensor) -> Any:
    """On a GPU a post-accumulate-grad hook fires once the gradient's kernels are queued, not
    run: an event recorded now on the hook's current stream (autograd's stream for that
    node) completes when they have. None on the CPU. It lives until the round is reset;
    dropping it then is safe even if a wait on it is still queued (CUDA releases a
    destroyed event once the device is done with it)."""
    if not grad.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(grad.device))
    return event


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Copies of each group's values of the keys the optimizer's defaults name, what users
    and lr schedulers set (tensors cloned: a scheduler fills a tensor lr in place)."""
    return [{k: copy.deepcopy(g[k]) for k in opt.defaults if k in g}
            for g in opt.param_groups]


def _unchanged(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_unchanged(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN kept
    return bool(a == b)


class BackwardOverlap:
    """Hooks, the worker thread, and the bookkeeping of the step being run ahead."""

    def __init__(self, off: "OffloadedOptimizer", model: torch.nn.Module | None) -> None:
        if off.rule.writes_grads:
            # Its updates would run during backward: after backward the user (clipping,
            # logging a norm) would see gradients the step already rewrote, where the plain
            # run shows them as backward left them.
            raise UnsupportedOptimizer(
                f"pipeline.overlap_backward cannot run {type(off.opt).__module__}."
                f"{type(off.opt).__qualname__}: its step writes into the gradients (seen on "
                "tiermem's probe), so updating during backward would leave other gradients "
                "after backward than the plain run has; set pipeline.overlap_backward: false")
        kernel = off.settings.optimizer.kernel
        for g, group in enumerate(off.opt.param_groups):
            # (with parameters.offload the gradients are the tier's, which no one sees)
            if off.weights is None and off.rule.writes_group_grads(group, kernel):
                raise UnsupportedOptimizer(
                    f"pipeline.overlap_backward cannot run param_groups[{g}] of "
                    f"{type(off.opt).__qualname__}: with these settings (foreach=True, "
                    "nesterov=True, no weight decay, no maximize) its step adds the momentum "
                    "into p.grad, so updating during backward would leave other gradients "
                    "after backward than the plain run has; set foreach=False (the same "
                    "weights) or pipeline.overlap_backward: false")
        self.off = off
        self._handles: list[Any] = []
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._forward_check))
        self._hooked: set[int] = set()  # parameter indices with a hook
        self._planned = False  # the tiers visit NVMe partitions in the order we plan
        self._accumulating = 0  # depth of accumulating() blocks
        self._stopping = False
        # Guards what the hooks write (_fired, _remaining, _error): hooks may run on an
        # autograd thread while the worker reads _error; held only for dict updates.
        self._lock = threading.Lock()
        # Ready partitions, autograd thread -> worker. Queue's own lock makes put/get
        # safe; join() (every item task_done) is how the user's thread takes the
        # pipeline back, and it orders the worker's writes before what step() reads.
        self._queue: queue.Queue[Partition | str | None] = queue.Queue()
        self._reset_round()
        self.add(off.parts)
        self._worker = threading.Thread(target=self._run, name="tiermem-overlap", daemon=True)
        self._worker.start()

    # -- set-up ----------------------------------------------------------------

    def add(self, parts: Sequence[Partition]) -> None:
        """Hook the parameters of new partitions (called between steps)."""
        for part in parts:
            for s in part.segments:
                if s.index not in self._hooked and s.param.requires_grad:
                    self._handles.append(
                        s.param.register_post_accumulate_grad_hook(self._hook_for(s.index)))
                    self._hooked.add(s.index)
        self._reset_round()
        tiers = self.off.tiers
        if not self._planned and any(p.tier == "nvme" for p in self.off.parts):
            # Before any step is seen, guess backward's order: last parameter first. The
            # reads run ahead at start-up followed the zig-zag order; redo them.
            tiers.plan_order([p for p in reversed(self.off.parts) if p.tier == "nvme"],
                             run_ahead=True)
            self._planned = True

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def grad_final(param: torch.Tensor) -> None:
            self._grad_final(index, param)
        return grad_final

    def _forward_check(self, module: torch.nn.Module, args: Any) -> None:
        """A forward of the model while backward's updates run would read weights being
        written (the next micro-batch's, outside tm.accumulating()): refuse it."""
        off = self.off
        with self._lock:
            started = bool(self._fired)
        if not started:
            # a parameter unfrozen since the block opened (it has no record), or given a
            # gradient by hand (torch steps a frozen one too), is laid out before this
            # forward's backward can update the others, which step() would be too late for
            off.lay_out_late(i for i in off.unlaid if off.params[i].requires_grad
                             or off.params[i].grad is not None)
        if started:
            raise TierMemError(
                "the model's forward ran between a backward and optimizer.step(): with "
                "pipeline.overlap_backward: true that backward started updating the weights. "
                "Call optimizer.step() first, or, accumulating gradients, run the backward of "
                "every micro-batch but the last inside `with tm.accumulating():`")

    # -- autograd's thread -----------------------------------------------------

    def _grad_final(self, index: int, param: torch.Tensor) -> None:
        """param's gradient is final for this backward: mark it, queue what became ready."""
        if self._accumulating:  # set by the user's thread before it called backward
            return
        weights = self.off.weights
        if weights is not None:
            # the parameter tier's hook ran first and took the gradient (param.grad is
            # None); what is checked at step() is that no zero_grad or clip came since
            if not weights.has_gradient(param):
                return
            grad, version, queued = None, weights.grad_edits, None
        else:
            grad = param.grad
            if grad is None:  # autograd sets it before this hook; never seen, never counted
                return
            version = grad._version
            queued = _queued_event(grad)  # outside the lock, which guards dict updates only
        with self._lock:
            if self._error is not None or self._stopping:
                return  # step() raises the error; nothing more starts
            if grad is not None and grad.is_sparse:
                self._error = TierMemError(
                    f"{type(self.off.opt).__name__} under tiermem does not support sparse "
                    f"gradients ({self._name(index)})")
                return
            if not self._fired:
                self._rewait()
            if index in self._fired:
                self._error = TierMemError(
                    f"{self._name(index)} received a second gradient before "
                    "optimizer.step(): with pipeline.overlap_backward: true every backward "
                    "outside tm.accumulating() starts the update, so wrap the backward of all "
                    "micro-batches but the last in `with tm.accumulating():`")
                return
            self._fired[index] = (grad, version, queued)
            for part in self._parts_of.get(index, ()):
                self._remaining[part.id] -= 1
                if self._remaining[part.id] == 0:
                    if self.off.weights is not None:
                        self.off.weights.queue_update()
                    self._queue.put(part)

    # -- the worker ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            part = self._queue.get()
            try:
                if part is _STOP:
                    return
                if self._stopping or self._failed():
                    continue  # step() raises the first error; later partitions wait for it
                if part is _RUN_AHEAD:
                    self._run_ahead()
                    continue
                if self._groups_seen is None:  # what the round's first update reads
                    self._groups_seen = _hyperparameters(self.off.opt)
                with torch.no_grad():  # grad mode is per thread
                    stats = self._process(part, self._upcoming())
                stats.early_partitions += 1
            except BaseException as exc:  # handed to step() (or the exit), never lost
                with self._lock:
                    if self._error is None:
                        self._error = exc
                        self._error_in_update = True
            finally:
                if isinstance(part, Partition) and self.off.weights is not None:
                    self.off.weights.unqueue_update()  # a backward waiting for room goes on
                self._queue.task_done()

    def _run_ahead(self) -> None:
        """Fill every pipeline buffer with the next step's first reads. step() leaves this to
        the worker: waiting for the last write-backs to free the buffers would hold up the
        caller, and the disk would otherwise idle through forward with only prefetch_depth + 1
        reads. It gives way as soon as backward queues a partition."""
        self.off.tiers.run_ahead(fill=True, stop=lambda: not self._queue.empty())

    def _failed(self) -> bool:
        with self._lock:
            return self._error is not None

    def _upcoming(self) -> list[Partition]:
        """NVMe partitions expected next: the planned order less those done this step."""
        return [p for p in self.off.tiers.nvme_order() if p.id not in self._done_ids]

    # -- one partition (the worker's or the user's thread) ------------------------

    def _process(self, part: Partition, upcoming: Sequence[Partition]) -> StepStats:
        """Update one partition through the optimizer's update loop; `upcoming`: NVMe
        partitions likely next, in order, read ahead of this one."""
        off = self.off
        stats = self._round_stats()
        self._after_grad_kernels(part)
        if off.weights is None:
            # A parameter whose hook did not say its gradient was final (frozen, its p.grad
            # the zeros of zero_grad(set_to_none=False)) is updated with the p.grad it has
            # now: step() checks that nothing changed it since, as it does the hooked ones'.
            # (The parameter tier's gradients change only by zero_grad and clipping, which
            # any hooked one's check sees.)
            with self._lock:
                fired = set(self._fired)
            unfired = [s.index for s in part.segments
                       if s.index not in fired and s.index not in self._unfired]
            if unfired:
                self._unfired.update(off.grad_marks(unfired))
        off.count_steps([part], self._stepped)
        off.update([part], stats, done=self._done_nvme,
                   ahead=[p for p in upcoming if p.id != part.id])
        if part.tier == "nvme":
            self._done_nvme.append(part)
        self._done_ids.add(part.id)
        return stats

    def _after_grad_kernels(self, part: Partition) -> None:
        """Order this thread's stream, on which the update's device work (the lanes' copies,
        a gpu-tier kernel) is queued, after the kernels that produced the partition's
        gradients, which autograd queued on its own stream (the forward's, maybe not
        ours). A no-op on the CPU, where a hook fires after the gradient is computed."""
        for s in part.segments:
            fired = self._fired.get(s.index)  # set before the partition was queued
            if fired is not None and fired[2] is not None:
                torch.cuda.current_stream(fired[0].device).wait_event(fired[2])

    def _round_stats(self) -> StepStats:
        """This step's StepStats, made when its first partition is updated."""
        if self._stats is None:
            self._stats = self.off.begin_step()
        return self._stats

    # -- optimizer.step() --------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None) -> None:
        """The rest of the step, in the caller's thread, once the worker is idle."""
        off = self.off
        t0 = time.monotonic()
        self._queue.join()  # the worker is idle: the pipeline is this thread's now
        args, kwargs = run_pre_hooks(off.opt, (closure,), {})
        if (args[0] if args else kwargs.get("closure")) is not None:
            raise TierMemError(
                "optimizer.step(closure) cannot run with pipeline.overlap_backward: true: "
                "the update runs during backward, before the closure could compute the "
                "gradients. Call backward yourself and step() without a closure, or set "
                "pipeline.overlap_backward: false")
        try:
            with self._lock:
                error, in_update = self._error, self._error_in_update
            if error is not None:
                # An update during backward that read a gradient the user then edited (p.grad
                # set to None while the worker read it) fails in whatever way it fell: the
                # edit is what to report. (Not instead of a hook's own refusal: a second
                # gradient changes the first one too, and the refusal says what to do.)
                try:
                    if in_update:
                        self._check_grads_unchanged()
                except TierMemError as edited:
                    raise edited from error
                raise error
            if off.weights is not None:
                off.weights.before_step(off.params)
            off.refuse_unlaid(i for i, p in enumerate(off.params) if off.has_grad(p))
            # before the gradients' check: GradScaler's own inf check rewrites them (times 1)
            amp.refuse(off.opt, "pipeline.overlap_backward: true",
                       "backward already updated parts of this step with the gradients "
                       "still scaled, before GradScaler could unscale them or skip the step")
            self._check_grads_unchanged()
            self._check_groups_unchanged()
            for i, p in enumerate(off.params):
                if p.grad is not None and p.grad.is_sparse:
                    raise TierMemError(f"{type(off.opt).__name__} under tiermem does not "
                                       f"support sparse gradients ({self._name(i)})")
            aside = (off.weights.guard_aside() if off.weights is not None
                     else contextlib.nullcontext())
            with torch.no_grad(), aside:
                stats = self._round_stats()
                rest = self._rest()
                nvme = [p for p in rest if p.tier == "nvme"]
                for part in rest:
                    self._process(part, nvme[nvme.index(part):] if part in nvme else nvme)
                off.count_empty(self._stepped)
                off.rule.end_step(off.opt.param_groups)
                if off.weights is not None:
                    off.weights.step_done()
                self._close_round(stats)
        except BaseException as exc:
            if off.weights is not None:
                off.weights.round_over()
            if off.crash:  # the worker is idle: reopening the last commit is safe now
                off.roll_back(exc, off.steps_taken + 1)
            else:
                off.failed_part_way(self._stepped, off.steps_taken + 1)
            raise
        finally:
            self._reset_round()
        # What timed() does, from before the wait for the worker.
        t1 = time.monotonic()
        stats.step_seconds += t1 - t0
        if stats.events is not None:
            stats.events.append(Event("step", "step", t0, t1, stats.step))
        off.close_step(stats)  # commits (crash_consistent): before the worker moves again
        off.threads.observe(stats)  # the next step's update threads (optim/threads.py)
        if any(p.tier == "nvme" for p in off.parts):
            # After _reset_round: an error of the run-ahead belongs to the next step.
            self._queue.put(_RUN_AHEAD)
        step_called(off.opt)
        run_post_hooks(off.opt, args, kwargs)

    def _rest(self) -> list[Partition]:
        """Partitions with a gradient that no hook made ready: resident ones, then NVMe ones
        in the planned order."""
        nvme = self.off.tiers.nvme_order()
        resident = [p for p in self.off.parts if p.tier != "nvme"]
        return [p for p in resident + nvme if p.id not in self._done_ids
                and any(self.off.has_grad(s.param) for s in p.segments)]

    def _check_grads_unchanged(self) -> None:
        """A gradient edited after its hook fired (clip_grad_norm_, GradScaler.unscale_, a
        pre-hook) would make this step mix edited and unedited gradients: refuse it."""
        weights = self.off.weights
        changed_ones = []
        for index, (grad, version, _) in self._fired.items():
            p = self.off.params[index]
            if weights is not None:  # the tier holds it: any zero_grad or clip since counts
                changed = weights.grad_edits != version or not weights.has_gradient(p)
            else:
                changed = p.grad is not grad or grad._version != version
            if changed:
                changed_ones.append(index)
        now = self.off.grad_marks(self._unfired)
        for index, was in self._unfired.items():
            if was is None or now[index] is None:
                changed = was is not now[index]
            else:
                changed = (was[0]() is None or was[0]() is not now[index][0]()
                           or was[1] != now[index][1])
            if changed:
                changed_ones.append(index)
        if changed_ones:
            raise TierMemError(
                f"the gradient of {self._name(changed_ones[0])} changed between backward and "
                "optimizer.step() (gradient clipping, GradScaler.unscale_, zero_grad or "
                "another edit, or an optimizer whose own step writes into its gradients, "
                "which tiermem's probe did not see): with pipeline.overlap_backward: true "
                "updates start during backward with the gradients as backward leaves them, "
                "so parts of this step already used the unedited ones. Set "
                "pipeline.overlap_backward: false to edit gradients before the step")

    def _check_groups_unchanged(self) -> None:
        """A group value set after backward began updating (an lr warm-up written just before
        step(), a scheduler stepped there) would reach only the partitions step() updates
        (and the generic path's shadows start every partition from the step's first
        values): refuse it, as an edited gradient is."""
        seen = self._groups_seen
        if seen is None:
            return
        now = _hyperparameters(self.off.opt)
        # (values the optimizer's own step sets in its groups, as the generic path's probe
        # saw, are its to change)
        own = self.off.rule.step_values().get("groups", {})
        for g, (was, is_) in enumerate(zip(seen, now)):
            for k in sorted(was.keys() | is_.keys()):
                if k in own.get(str(g), {}):
                    continue
                if k not in was or k not in is_ or not _unchanged(was[k], is_[k]):
                    raise TierMemError(
                        f"param_groups[{g}][{k!r}] changed between backward and "
                        f"optimizer.step() ({was.get(k, 'absent')!r} -> "
                        f"{is_.get(k, 'absent')!r}): with pipeline.overlap_backward: true "
                        "updates start during backward with the group's values as they are "
                        "then, so parts of this step already used the old one. Set "
                        "hyperparameters before backward (an lr scheduler stepped after "
                        "optimizer.step() is right), or set pipeline.overlap_backward: false")

    def _close_round(self, stats: StepStats) -> None:
        # The next step is predicted to follow this one's gradient order.
        done = {p.id for p in self._done_nvme}
        self.off.tiers.plan_order(self._done_nvme + [p for p in self.off.tiers.nvme_order()
                                                     if p.id not in done])
        self.off.tiers.end_step(stats, run_ahead=False)  # the worker runs the reads ahead

    def _waits(self) -> tuple[frozenset[int], dict[int, list[Partition]], dict[int, int]]:
        """What each partition waits for: the hooks of its parameters that require a
        gradient now. (One without a hook, unfrozen since add() and laid out, as Adagrad's
        state makes it, keeps its partition for step(): no hook says its gradient is
        final.) Returns (those parameters, index -> partitions, partition id -> count)."""
        wanted = frozenset(i for i, p in enumerate(self.off.params) if p.requires_grad)
        parts_of: dict[int, list[Partition]] = {}
        remaining: dict[int, int] = {}
        for part in self.off.parts:
            need = {s.index for s in part.segments if s.index in wanted}
            if not need:
                continue  # nothing tells when it is ready: step() updates it
            remaining[part.id] = len(need)
            for index in need:
                parts_of.setdefault(index, []).append(part)
        return wanted, parts_of, remaining

    def _rewait(self) -> None:
        """At a backward's first hook (under the lock): a parameter frozen or unfrozen since
        the last step changes what its partitions wait for. Counted at the last step's end,
        a partition would wait for a frozen parameter's hook (updated at step(), late but
        right) or, worse, not for an unfrozen one's: updated before its gradient came."""
        if frozenset(i for i, p in enumerate(self.off.params)
                     if p.requires_grad) != self._wanted:
            self._wanted, self._parts_of, self._remaining = self._waits()

    def _reset_round(self) -> None:
        """Forget the step just closed; count afresh what each partition waits for."""
        wanted, parts_of, remaining = self._waits()
        with self._lock:
            # index -> (grad, its version, the CUDA event after its kernels or None)
            self._fired: dict[int, tuple[torch.Tensor, int, Any]] = {}
            self._wanted = wanted
            self._remaining = remaining
            self._parts_of = parts_of
            self._error: BaseException | None = None
            self._error_in_update = False  # _error is the worker's (not a hook's refusal)
        self._done_ids: set[int] = set()
        # index -> its gradient's mark (OffloadedOptimizer.grad_marks) when an update during
        # backward read it without its hook having fired
        self._unfired: dict[int, Any] = {}
        self._done_nvme: list[Partition] = []
        self._stepped: set[int] = set()
        self._stats: StepStats | None = None
        # the groups' hyperparameters as backward's first update read them (None: none yet)
        self._groups_seen: list[dict[str, Any]] | None = None

    # -- the user's thread, between steps ----------------------------------------

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward inside this block only accumulates gradients; no update starts."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def wait_idle(self) -> None:
        """Wait for the worker (stats, events: they read what it writes)."""
        self._queue.join()

    def require_idle(self, what: str) -> None:
        """Wait for the worker; refuse `what` while a step is half done by it."""
        self._queue.join()
        if self._done_ids:
            raise TierMemError(
                f"{what} was called between backward and optimizer.step(): with "
                "pipeline.overlap_backward: true backward already updated part of this step; "
                "call it after optimizer.step()")

    def close(self) -> BaseException | None:
        """Remove the hooks and stop the worker once it is done; return the error it hit
        that no step() raised, if any. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        if self._worker.is_alive():
            with self._lock:
                self._stopping = True  # what is still queued is not started
            self._queue.put(_STOP)
            self._worker.join()
        with self._lock:
            error = self._error
        if self._done_ids:
            self._abandon_round()
        self._reset_round()
        return error

    def _abandon_round(self) -> None:
        """Backward updated part of a step that step() never closed (the block ended, or an
        exception left backward). Crash-consistent runs promise whole steps: reopen the last
        commit, as a step failing part-way does. Scratch runs keep what was done, and say so."""
        off, done = self.off, len(self._done_ids)
        what = (f"tiermem: backward updated {done} of {len(off.parts)} partitions "
                "(pipeline.overlap_backward) but optimizer.step() was not called before the "
                "block ended")
        if not off.crash:
            warnings.warn(f"{what}: the state holds that part of a step", TierMemWarning,
                          stacklevel=5)
            return
        # The worker has stopped: nothing else touches the tiers while they are reopened.
        notes = TierMemError(what)
        off.roll_back(notes, off.steps_taken + 1)
        warnings.warn("; ".join([what, *getattr(notes, "__notes__", [])]), TierMemWarning,
                      stacklevel=5)

    def _name(self, index: int) -> str:
        p = self.off.params[index]
        name = self.off.names.get(id(p))
        return f"parameter {name!r}" if name else (
            f"parameter {index} (shape {tuple(p.shape)})")
