"""The `tm` of `with tiermem.offload(...) as tm`: stats, the plan, and the way out.

Leaving the block (normally or by an exception) goes through `leave()`: every
write-back is completed first; then the state goes back into the optimizer as
ordinary tensors when it fits in host memory, and the swap files are removed.
When it does not fit, it stays on disk with a manifest, and a warning says
where and how to resume. Swap files are never removed before the state is safe
elsewhere. dist.sharded's handle overrides `leave()` for a rank's share.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any, ContextManager, Iterable

import torch

from tiermem.errors import TierMemError, TierMemWarning
from tiermem.optim import averaging, clipping
from tiermem.optim.hooks import KEPT
from tiermem.optim.offloaded import OffloadedOptimizer
from tiermem.optim.state_io import drop_param_state
from tiermem.sizes import format_size
from tiermem.sysinfo import available_memory
from tiermem.telemetry.stats import StepStats


def resume_call(name: str) -> str:
    """The exact call that resumes state kept under `name` (name= matters: it picks the
    directory)."""
    return (f"tiermem.offload(optimizer, config, model=model, name={name!r}, resume=True)"
            if name != "default" else
            "tiermem.offload(optimizer, config, model=model, resume=True)")


def mark_kept(opt: torch.optim.Optimizer, run_dir: str, name: str, step: int | None, *,
              rank: int | None = None) -> None:
    """After a block kept the state on disk, opt.state is empty: a plain opt.step() would
    start Adam over from step 1 without a word. Make it raise, saying where the state is.
    rank: under torch.distributed, the rank whose share `run_dir` holds."""
    which = f"of committed step {step} " if step is not None else ""
    if rank is None:
        what, how = "this optimizer's state", f"`with {resume_call(name)}:`"
    else:
        what = f"rank {rank}'s share of this optimizer's state"
        how = (f"`with {resume_call(name)}:` on every rank, with the same world size")
    message = (f"opt.step(): {what} {which}was kept on disk in {run_dir} when its "
               f"tiermem.offload block ended, and opt.state is empty; stepping now would "
               f"start Adam over from step 1. Resume it with {how}, or, to start over on "
               "purpose, call tiermem.optim.handle.forget_kept(optimizer)")
    put_kept(opt, (run_dir, message))


def mark_lost(opt: torch.optim.Optimizer, run_dir: str, why: str, *,
              rank: int | None = None) -> None:
    """After a block ended with the state not whole anywhere (`why`: unusable, neither one
    step's nor another's, or records lost with the disk) under swap.durability scratch,
    which keeps no committed copy: opt.step() says the state is lost rather than start the
    optimizer over. rank: under torch.distributed, the rank whose share it was."""
    what = ("the optimizer state" if rank is None
            else f"rank {rank}'s share of the optimizer state")
    message = (f"opt.step(): {what} is lost: {why}, and swap.durability scratch keeps no "
               "other copy; opt.state is empty. "
               "Load a state dict into the optimizer, then call "
               "tiermem.optim.handle.forget_kept(optimizer) (which also lets it start over "
               "on purpose)")
    put_kept(opt, (run_dir, message))


def put_kept(opt: torch.optim.Optimizer, kept: tuple[str, str]) -> None:
    """Install the guard `kept` = (run directory, the error opt.step() raises)."""
    message = kept[1]

    def step(opt_self, closure=None):
        raise TierMemError(message)

    opt.__dict__[KEPT] = kept
    opt.__dict__["step"] = types.MethodType(step, opt)


def kept_dir(opt: torch.optim.Optimizer) -> str | None:
    """The run directory a block kept `opt`'s state in (opt.step() raises until it is
    resumed or forgotten), or None."""
    kept = opt.__dict__.get(KEPT)
    return kept[0] if kept is not None else None


def forget_kept(opt: torch.optim.Optimizer) -> tuple[str, str] | None:
    """Let `opt.step()` run plainly again after a block kept its state on disk (the kept
    directory stays; `tiermem clean` removes it). Returns the guard lifted (for put_kept),
    or None."""
    kept = opt.__dict__.pop(KEPT, None)
    if kept is not None:
        opt.__dict__.pop("step", None)
    return kept


class Offload:
    """What `with tiermem.offload(...) as tm` gives: stats, the plan, and where state is."""

    def __init__(self, off: OffloadedOptimizer) -> None:
        self.offloaded = off
        # The framework wrapper(s) tiermem.offload took the optimizer out of, as
        # 'a.B -> c.D' (plan() says so), or None.
        self.unwrapped: str | None = None
        self.kept_on_disk: str | None = None
        self._discard = False
        if off.weights is not None:  # torch's clipping would see no gradient: route it
            clipping.open_tier(self)
            # AveragedModel would read the released weights' empty placeholders
            averaging.open_tier(self)

    def record_events(self, on: bool = True) -> None:
        """Keep a timeline of every step (`tm.events()`): NVMe reads and writes, updates,
        copies and stalls per partition, for traces and plots."""
        self.offloaded.record_events = on

    def accumulating(self):
        """`with tm.accumulating(): loss.backward()`: gradients accumulate, no update starts.

        With pipeline.overlap_backward every other backward starts the step's update, so
        wrap the backward of every micro-batch but the last in it (docs/guide/overlap.md). Without
        overlap it does nothing, so a loop may use it either way."""
        overlap = self.offloaded.overlap
        return overlap.accumulating() if overlap is not None else contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the optimizer's parameters; with
        parameters.offload over the gradients in the tiers (their norm was computed as they
        streamed; the step applies the coefficient as it reads each one). Returns the total
        norm. (With parameters.offload, torch.nn.utils.clip_grad_norm_ over the model's
        parameters comes here too: optim/clipping.py.)"""
        weights = self.offloaded.weights
        if weights is None:
            return torch.nn.utils.clip_grad_norm_(self.offloaded.params, max_norm, norm_type,
                                                  error_if_nonfinite)
        if self.offloaded.overlap is not None:
            # the updates started during backward, before the global norm was known
            raise TierMemError(
                "tm.clip_grad_norm_ cannot run with pipeline.overlap_backward: true and "
                "parameters.offload: backward already updated partitions with the unclipped "
                "gradients. Set pipeline.overlap_backward: false to clip by global norm")
        return weights.clip_grad_norm_(max_norm, norm_type,
                                       error_if_nonfinite=error_if_nonfinite)

    def clipped(self) -> bool:
        """With parameters.offload: the coming step's gradients were clipped (by
        tm.clip_grad_norm_, or torch's clip_grad_norm_ routed to it)."""
        weights = self.offloaded.weights
        return weights is not None and weights.clip_coef is not None

    # -- what optim/clipping.py asks of a block with a parameter tier (clipping.Clipper)

    def held(self, p: torch.Tensor) -> bool:
        """p's gradient lives in this block's parameter tier."""
        weights = self.offloaded.weights
        return weights is not None and id(p) in weights.index

    def clip_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                  error_if_nonfinite: bool, what: str) -> torch.Tensor:
        """torch's clip_grad_norm_ over `params`, some of which the parameter tier holds: the
        tier's clip where they are every parameter of it with a gradient, and only those."""
        weights = self.offloaded.weights
        with_grads = [p for p in weights.params if weights.has_gradient(p)]
        given = {id(p) for p in params}
        missing = [p for p in with_grads if id(p) not in given]
        if missing:
            raise TierMemError(
                f"{what} over {len(params)} parameters, {len(missing)} of the "
                f"{len(with_grads)} parameters with gradients in tiermem's parameter "
                "tier (parameters.offload) not among them: the tier clips all its gradients "
                "by one global norm. Pass model.parameters(), or call "
                "tm.clip_grad_norm_(max_norm)")
        outside = [p for p in params if not self.held(p) and p.grad is not None]
        if outside:
            raise TierMemError(
                f"{what} over parameters tiermem's parameter tier holds and {len(outside)} "
                "it does not, with gradients in p.grad: one global norm over both is not "
                "supported; clip the model's parameters only")
        return self.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_value(self, params: list[torch.Tensor], clip_value: float, what: str) -> None:
        raise TierMemError(
            f"{what} over parameters whose gradients are in tiermem's parameter tier "
            "(parameters.offload), not in p.grad: it would clip nothing. Clip by norm with "
            "tm.clip_grad_norm_(max_norm), or set parameters.offload: none")

    # -- what optim/averaging.py asks of it (averaging.Averager)

    def weights_in_memory(self, params: Iterable[torch.Tensor], *,
                          changed: bool = False) -> ContextManager[None]:
        """The parameter tier's `params` materialised (in host memory) for the duration;
        `changed`: written back to the tier after it, as weights the step updated."""
        return self.offloaded.weights.materialised(params, changed=changed)

    def weight_shape(self, p: torch.Tensor) -> torch.Size:
        return self.offloaded.weights.stand_in(p).shape

    def weight_bytes(self, p: torch.Tensor) -> int:
        return self.offloaded.weights.weight_nbytes(p)

    def window_bytes(self) -> int:
        return self.offloaded.weights.window

    def param_stats(self) -> dict[str, int]:
        """The parameter tier's counters (fetches, prefetched, on_demand, out_of_order,
        evictions, grads_stored, peak_window_bytes, bytes read/written); {} without
        parameters.offload. Under pipeline.overlap_backward the queued updates finish first:
        the worker counts its fetches and writes too."""
        weights = self.offloaded.weights
        if weights is None:
            return {}
        self.offloaded.wait_idle()
        return dict(weights.stats.as_dict(), bytes_read=weights.records.bytes_read,
                    bytes_written=weights.records.bytes_written)

    def events(self) -> list:
        """Timeline spans (telemetry.Event) of the steps recorded so far."""
        self.offloaded.wait_idle()
        self.offloaded.tiers.flush()  # the last step's write spans are known once they land
        return [e for s in self.offloaded.history for e in (s.events or [])]

    def discard(self) -> None:
        """Throw the optimizer state away at exit instead of returning it (benchmarks,
        stress runs): swap files are removed and the optimizer is left with no state. With
        parameters.offload the weights go too: the model is left with empty parameters."""
        self._discard = True

    @property
    def faults_survived(self) -> int:
        """NVMe transfers that failed and succeeded when reissued (io.retries)."""
        return self.offloaded.tiers.faults_survived

    @property
    def resumed_step(self) -> int | None:
        """With resume=True, the step the kept state had reached; else None."""
        return self.offloaded.resumed_step

    @property
    def committed_step(self) -> int | None:
        """swap.durability crash_consistent: the step a resume after a crash would restore."""
        return self.offloaded.committed_step

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.offloaded.opt

    def plan(self) -> dict[str, Any]:
        """Bytes of optimizer state per tier, pinned bytes, swap bytes, partition count."""
        tiers = self.offloaded.tiers
        return {"state_bytes": tiers.tier_bytes(), "pinned_bytes": tiers.pinned_bytes,
                "swap_bytes": tiers.store.total_bytes if tiers.store else 0,
                "swap_dirs": tiers.store.dirs if tiers.store else [],
                "partitions": len(self.offloaded.parts),
                **({"unwrapped": self.unwrapped} if self.unwrapped else {}),
                **({"parameters": self.offloaded.weights.plan()}
                   if self.offloaded.weights is not None else {})}

    def stats(self) -> list[dict[str, Any]]:
        """Per-step figures (bytes per tier, GB/s, update/transfer/stall time, overlap) of the
        last 1000 steps; `bytes_per_param`: NVMe bytes read and written in the step per
        parameter element this optimizer holds (optimizer.state_dtype and master_weights
        set it: 16 for fp32 state on an fp32 model all on NVMe, about 4 with int8)."""
        self.offloaded.wait_idle()
        self.offloaded.tiers.flush()  # completes the last step's writes and their timings
        numel = max(1, sum(p.numel for p in self.offloaded.parts))
        out = []
        for s in self.offloaded.history:
            row = s.as_dict()
            moved = sum(row["read_bytes"].values()) + sum(row["write_bytes"].values())
            row["bytes_per_param"] = moved / numel
            out.append(row)
        return out

    @property
    def last_step(self) -> StepStats | None:
        return self.offloaded.history[-1] if self.offloaded.history else None

    def where_state_is(self) -> str:
        """One sentence for the user: where the optimizer state is now."""
        if self.kept_on_disk:
            which = (f"of committed step {self.offloaded.committed_step} "
                     if self.offloaded.committed_step is not None else "")
            return (f"the optimizer state {which}stays on disk in {self.kept_on_disk}; resume "
                    f"with {resume_call(self.name)}")
        if self._discard:
            return "the optimizer state was discarded (stress/benchmark run)"
        return (f"the optimizer state of step {self.offloaded.steps_taken} was handed back to the "
                "optimizer and the swap files were removed")

    def _exit_after_failed_writes(self, exc: TierMemError) -> None:
        """Some write-backs failed for good: the records they carried are in buffers only.
        Hand everything back into the optimizer from memory if it fits; else the state is
        not whole anywhere: crash_consistent keeps its last commit (the failed writes went
        to records no commit names) for a resume, and under scratch it is lost; either way
        opt.step() says so rather than start the optimizer over. Raise saying which."""
        off = self.offloaded
        dirs = off.tiers.store.dirs if off.tiers.store else []
        off.detach()
        if not self._discard and self._state_nbytes() <= available_memory() * 0.8:
            try:
                state = off.export_state(model_dtype=True)
            except TierMemError:
                pass
            else:
                drop_param_state(off.opt)
                off.opt.state.update(state)
                off.close_tiers(remove_swap=True)
                raise TierMemError(f"writing optimizer state to swap failed ({exc}); the state "
                                   "was gathered from memory and handed back to the optimizer, "
                                   "and the swap files were removed") from exc
        if self._discard:
            off.close_tiers(remove_swap=True, flush=False)
            raise TierMemError(f"optimizer state could not be written back ({exc})") from exc
        if self._commit_or_lost("writing it back to swap failed as its tiermem.offload "
                                "block ended, and it did not fit in free memory to be "
                                "handed back", remove_swap=False):
            raise TierMemError(f"optimizer state could not be written back ({exc}), and it "
                               "does not fit in free memory to hand back; "
                               f"{self.where_state_is()}") from exc
        raise TierMemError(f"optimizer state could not be written back ({exc}); swap files "
                           f"were kept in {', '.join(dirs)}, but the records that failed are "
                           "lost with this process (swap.durability scratch keeps no "
                           "committed copy), so the optimizer state is lost") from exc

    def _state_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() * 2 for p in self.offloaded.params)

    def _exit(self) -> None:
        """Stop updates during backward before any state moves; an error the worker hit that
        no step() raised is raised once the state is safe (or noted on the exit's own)."""
        pending = self.offloaded.end_overlap()
        clipping.close_tier(self)
        averaging.close_tier(self)
        try:
            weights, self.offloaded.weights = self.offloaded.weights, None
            failed = None
            try:
                if weights is not None and self._discard:
                    weights.abandon()  # thrown away with the state: never gathered
                elif weights is not None:  # the model gets its weights back first
                    weights.close()
            except BaseException as exc:  # the optimizer state still leaves properly
                failed = exc
            if failed is not None and weights is not None and self.offloaded.crash:
                self._keep_commit(failed)
            # The weights that could not be given back left their parameters empty: the
            # state still has their shapes, which only the closed tier knows now.
            self.offloaded.weights = weights if failed is not None else None
            try:
                self._exit_state()
            finally:
                self.offloaded.weights = None
            if failed is not None:
                raise failed
        except BaseException as exc:
            if pending is not None:
                exc.add_note(f"tiermem: an update run during backward had failed too: "
                             f"{pending!r}")
            raise
        if pending is not None:
            raise pending

    def _keep_commit(self, why: BaseException) -> None:
        """The model did not get all its weights back: the last commit holds them with the
        optimizer state, and a resume puts both back. Keep it untouched (the state now in
        memory would be written against parameters that are empty)."""
        off = self.offloaded
        self.kept_on_disk = off.tiers.run_dir()
        off.detach()
        off.close_tiers(remove_swap=False, flush=False)
        self._mark_kept()
        if not isinstance(why, TierMemError):  # an interrupt stays one (signals.py)
            why.add_note(f"tiermem: {self.where_state_is()}")
            raise why
        raise TierMemError(f"the model's weights could not all be given back ({why}); "
                           f"{self.where_state_is()} (a resume puts the weights back "
                           "too)") from why

    def _exit_state(self) -> None:
        off = self.offloaded
        if off.unusable:
            self._exit_unusable()
            return
        try:
            off.tiers.flush()
        except TierMemError as exc:
            self._exit_after_failed_writes(exc)
            return
        if self._discard:
            off.detach()
            off.close_tiers(remove_swap=True)
            return
        need = self._state_nbytes()
        if need <= available_memory() * 0.8:
            try:
                state = off.export_state(model_dtype=True)
            except BaseException as exc:
                # A record that cannot be read back (I/O error, failed checksum) must not
                # take the others with it: keep everything on disk and say where.
                off.detach()
                kept = off.keep_on_disk()
                self.kept_on_disk = kept
                self._mark_kept()
                raise TierMemError(f"optimizer state could not be gathered back ({exc}); "
                                   f"everything was kept on disk in {kept}") from exc
            off.detach()
            drop_param_state(off.opt)
            off.opt.state.update(state)
            off.close_tiers(remove_swap=True)
            return
        self.kept_on_disk = off.keep_on_disk()
        off.detach()
        self._mark_kept()
        warnings.warn(
            f"tiermem: the optimizer state ({format_size(need)}) does not fit in free host "
            f"memory ({format_size(available_memory())}), so it stays on disk in "
            f"{self.kept_on_disk}, and opt.step() raises until it is resumed. Resume with "
            f"{resume_call(self.name)} and the same model, optimizer and config.",
            TierMemWarning, stacklevel=3)

    def _exit_unusable(self) -> None:
        """Memory holds state that is neither one step's nor another's (a failed step or
        state method that could not be rolled back, a load that failed part-way): it must
        reach neither opt.state nor a manifest. crash_consistent: the last commit stays on
        disk, untouched, to resume. scratch: nothing else holds the state: it is gone, and
        opt.step() says so rather than start the optimizer over."""
        off = self.offloaded
        off.detach()
        if self._commit_or_lost(f"{off.unusable}, before its tiermem.offload block ended",
                                remove_swap=True):
            warnings.warn(f"tiermem: the block ended with the optimizer state unusable "
                          f"({off.unusable}); {self.where_state_is()}", TierMemWarning,
                          stacklevel=4)
            return
        warnings.warn(f"tiermem: the block ended with the optimizer state unusable "
                      f"({off.unusable}); it is lost (swap.durability scratch keeps no "
                      "committed copy)", TierMemWarning, stacklevel=4)

    def _commit_or_lost(self, why: str, *, remove_swap: bool) -> bool:
        """Memory's state must reach no manifest, and no whole copy is on disk but the last
        commit: crash_consistent keeps that commit, untouched, for a resume (True);
        scratch has none, and opt.step() says the state is lost, `why` (False; the swap
        files removed with remove_swap). The tiers are closed either way."""
        off = self.offloaded
        run_dir = off.tiers.run_dir()
        if off.committed_step is not None:
            self.kept_on_disk = run_dir
            off.close_tiers(remove_swap=False, flush=False)
            self._mark_kept()
            return True
        off.close_tiers(remove_swap=remove_swap, flush=False)
        self._mark_lost(run_dir, why)
        return False

    def _mark_lost(self, run_dir: str, why: str) -> None:
        mark_lost(self.offloaded.opt, run_dir, why)

    @property
    def name(self) -> str:
        """The block's name= (what a resume must pass again)."""
        return self.offloaded.swap_name

    def _mark_kept(self) -> None:
        off = self.offloaded
        # steps_taken counts this block's steps only, not the state's: name a step only
        # where it is the state's (a crash_consistent commit).
        mark_kept(off.opt, self.kept_on_disk, self.name, off.committed_step)

    def leave(self, exc: BaseException | None) -> None:
        """The one way out of the block; `exc` is what ended it (None: it ended normally).
        Signals are held by the caller: the state is never left half moved."""
        self._exit()
