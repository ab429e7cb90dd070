"""`tiermem.offload` under torch.distributed: each rank tiers only its share of the state.

The user's optimizer is left holding the whole model's parameters; tiermem builds
a *shadow* optimizer of the same torch class (Adam for Adam/AdamW, or one of torch's
elementwise optimizers: their math is per element, so a share of a parameter steps as
that part of the whole does; torch's Adafactor and Muon over whole parameters; for the
generic path, an instance of the user's own class made as its shadows are, with the
values its step keeps outside the per-parameter state shared after each step) over this
rank's pieces (zero.py: 1-D views of each rank's share of replicated parameters, or
whole parameters; fsdp.py: the local shards of FSDP2 DTensors) and
wraps it in an ordinary OffloadedOptimizer, so partitions, tiers, the pipeline,
durability and resume work on a share exactly as they do on a whole model. The
user's optimizer is hooked to run, per step: the gradients in (reduce-scatter or
views), the shadow's tiered step, the weights out (all-gather); its param groups
(lr schedules) are copied into the shadow's before each step.

Swap paths may say `{rank}` and `{local_rank}`; every rank's run directory is
`tiermem-<name>-rank<global rank>`, so ranks sharing a path never collide.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from tiermem.dist.clip import AveragedClip
from tiermem.dist.collectives import Collectives, RankMismatch
from tiermem.config import Settings
from tiermem.errors import TierMemError, TierMemWarning
from tiermem.dist.fsdp import FsdpLayout, is_dtensor
from tiermem.dist.fsdp_whole import FsdpWholeLayout
from tiermem.optim import amp, clipping
from tiermem.optim.handle import Offload, mark_kept, mark_lost, resume_call
from tiermem.optim.hooks import (AMP, Installed, changed_since, in_torch_state_init,
                                 load_snapshot, load_with_hooks, run_post_hooks,
                                 run_pre_hooks, step_called)
from tiermem.optim.offloaded import (HISTORY, OffloadedOptimizer, check_optimizer,
                                     groups_changed)
from tiermem.optim.state_io import param_entries, refuse_unkept_keys, torch_state_dict
from tiermem.optim.rules import (UnsupportedOptimizer, group_values, loose_state_keys,
                                 own_attributes, own_values, shadow_of_groups)
from tiermem.optim.rules.generic import ATTR, value_put
from tiermem.optim.rules.nested import value_digest
from tiermem.optim.rules.adam import MASTER_KEY
from tiermem.sizes import format_size
from tiermem.sysinfo import available_memory
from tiermem.dist.zero import ZeroLayout


# What a rank in torch's state-making step says it is doing (Collectives.agree), and why
# the ranks then disagree
INIT_STEP = ("the step torch.distributed.checkpoint.state_dict's helpers take on an optimizer "
             "whose state is empty (zero gradients, lr 0)")
INIT_WHY = ("get_optimizer_state_dict, set_optimizer_state_dict, get_state_dict and "
            "set_state_dict take that step only on a rank where no parameter has a gradient, "
            "and here some ranks had gradients and others none; under a process group it is a "
            "collective. Call them when no rank holds gradients (before backward, or after "
            "opt.zero_grad()) or after the first opt.step(). On the ranks that took it, torch "
            "left every param group's lr at 0 and every gradient at zeros")

GRADS_WHY = ("distributed.grads: allreduced takes each rank's gradients as averaged already "
             "(DDP's), so every rank must have gradients for the same parameters; a "
             "parameter with one on some ranks only would not be stepped, or by some of its "
             "owners only. Average every parameter's gradient on every rank (DDP with "
             "find_unused_parameters=True), or use distributed.grads: reduce_scatter, which "
             "counts a missing gradient as zero")


ADDED_WHY = ("The ranks added param groups that differ (in the number of parameters, their "
             "shapes and dtypes, the group's settings, or which of the model's parameters "
             "they are: the digests say which): every rank must call "
             "optimizer.add_param_group() with the same group, its parameters in the same "
             "order (not the order of a set) and the same settings")


def _described(g: int, group: dict, names: dict[int, str]) -> str:
    """An added group as the ranks compare it at their next agreement: its parameters'
    count, a digest of their shapes and dtypes, one of its settings, and one of the
    parameters' names in the model (`names`, by id; none without a model): parameters of
    one shape in another order are other parameters."""
    shapes = hashlib.sha1(repr([(tuple(p.shape), str(p.dtype)) for p in group["params"]])
                          .encode()).hexdigest()[:8]
    named = hashlib.sha1(repr([names.get(id(p), "") for p in group["params"]])
                         .encode()).hexdigest()[:8]
    return (f"param_groups[{g}] of {len(group['params'])} parameters (shapes and dtypes "
            f"{shapes}, settings {value_digest(_hyper(group))[:8]}, names {named})")


def wanted(optimizer: torch.optim.Optimizer, process_group: Any) -> bool:
    """Shard when a group is given, torch.distributed is initialised, or the parameters are
    DTensors."""
    if process_group is not None:
        return True
    if dist.is_available() and dist.is_initialized():
        return True
    return any(is_dtensor(p) for g in optimizer.param_groups for p in g["params"])


def rank_paths(settings: Settings, rank: int, local_rank: int) -> Settings:
    """`settings` with `{rank}` / `{local_rank}` in swap paths replaced (0 and 0 in a single
    process), so one config can put each rank's state on its own drive."""
    paths = [p.replace("{rank}", str(rank)).replace("{local_rank}", str(local_rank))
             for p in settings.swap.paths]
    if paths == list(settings.swap.paths):
        return settings
    return dataclasses.replace(settings, swap=dataclasses.replace(settings.swap, paths=paths))


def _local_rank(coll: Collectives) -> int:
    """LOCAL_RANK (torchrun), else this rank's position among the ranks on this host."""
    if os.environ.get("LOCAL_RANK", "").isdigit():
        return int(os.environ["LOCAL_RANK"])
    host = int.from_bytes(hashlib.sha1(socket.gethostname().encode()).digest()[:6], "big")
    hosts = [row[0] for row in coll.table([float(host)], "finding the ranks on this host")]
    return sum(1 for r in range(coll.rank) if hosts[r] == host)


class _Names:
    """What OffloadedOptimizer reads placement-rule names from: a piece is named after its
    parameter, so rules written for the whole model match its pieces."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self._pairs = pairs

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._pairs)


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


class DistributedOffload(Offload):
    """`with tiermem.offload(...) as tm` under a process group: this rank's share."""

    def __init__(self, opt: torch.optim.Optimizer, settings: Settings, *,
                 model: torch.nn.Module | None, name: str, resume: bool,
                 process_group: Any, streams: Any = None) -> None:
        self.streams = streams  # the lanes' stream backend, for every OffloadedOptimizer built
        if settings.pipeline.overlap_backward:
            # Each rank's share is updated through views that backward's hooks never see,
            # and only after the gradients are reduce-scattered in step().
            raise TierMemError("pipeline.overlap_backward is not supported under "
                               "torch.distributed yet (process_group= or DTensor "
                               "parameters); set it to false")
        if not (dist.is_available() and dist.is_initialized()):
            raise TierMemError("tiermem shards the optimizer state over a process group, but "
                               "torch.distributed is not initialised (init_process_group)")
        fsdp = any(is_dtensor(p) for g in opt.param_groups for p in g["params"])
        self.opt = opt
        self.block_name = name  # the user's name=; each rank's directory adds -rank<r>
        d = settings.distributed
        self.coll = Collectives(process_group, d.timeout, name)
        try:
            # The check (the generic path's probes included) runs on synthetic parameters and
            # the user's groups, which every rank holds alike, so every rank should come to
            # the same answer; a rank that does not must not leave the others waiting in
            # set-up's collectives: every rank hears of every refusal, and all raise.
            error = None
            try:
                self.rule = self._check(opt, fsdp)
            except BaseException as exc:
                error = exc
                self.coll.post_failure(exc)
            flags = self.coll.table([float(error is None)], "checking the optimizer")
            if error is not None:
                raise error
            bad = [r for r, row in enumerate(flags) if not row[0]]
            if bad:
                why = "; ".join(f"rank {self.coll.global_rank(r)}: {self.coll.failed_why(r)}"
                                for r in bad)
                raise UnsupportedOptimizer(
                    f"rank {self.coll.global_rank(self.coll.rank)} accepted "
                    f"{type(opt).__module__}.{type(opt).__qualname__} but other ranks refused "
                    f"it ({why}); every rank must run the same optimizer with the same "
                    "settings")
            self._set_up(opt, settings, model, name, resume, fsdp)
        except BaseException:
            self.coll.close()  # this offload is over: stop its heartbeat
            raise

    def _check(self, opt: torch.optim.Optimizer, fsdp: bool) -> Any:
        """The rule that runs `opt` under a process group (refusing what none runs)."""
        rule = check_optimizer(opt)
        # A rule whose math spans a whole parameter steps whole parameters: ZeRO shares cut
        # between parameters give each rank whole ones; under FSDP2 each parameter is
        # gathered to one owner rank (fsdp_whole.py), for torch's Adafactor and Muon and the
        # generic path alike: the owner's step sees the whole parameter as one process's does.
        self.whole = not rule.elementwise
        # The generic path (a third-party optimizer, or a subclass with a step of its own):
        # a rank steps an optimizer of the user's class over its share (shadow_of_groups).
        self.generic = rule.optimizers[0] is torch.optim.Optimizer
        self.closure_refusal = None
        if self.generic:
            loose = loose_state_keys(opt) or rule.state_keys_made()
            if loose:
                raise UnsupportedOptimizer(
                    f"tiermem under torch.distributed cannot run {type(opt).__module__}."
                    f"{type(opt).__qualname__}: it keeps state under {loose[0]!r}, a key that "
                    "is no parameter, which no rank's share holds; in one process it works")
            self.closure_refusal = rule.closure_refusal()
        return rule

    def _set_up(self, opt: torch.optim.Optimizer, settings: Settings, model: Any, name: str,
                resume: bool, fsdp: bool) -> None:
        d = settings.distributed
        self.layout = ((FsdpWholeLayout(opt, self.coll) if self.whole else
                        FsdpLayout(opt, self.coll)) if fsdp
                       else ZeroLayout(opt, self.coll, d.grads, d.bucket_size, self.whole))
        self.rank = self.coll.global_rank(self.coll.rank)
        self.local_rank = _local_rank(self.coll)
        self._at = {pc.index: (g, k) for g, pcs in enumerate(self.layout.pieces)
                    for k, pc in enumerate(pcs)}
        self.comm: dict[int, dict[str, float]] = {}  # step -> communication figures
        self.steps_called = 0
        self._covers: dict[int, list[int]] | None = None  # partition id -> weight windows
        off, error = None, None
        try:
            off = self._build(settings, model, name, resume)
        except BaseException as exc:  # the others must hear of it, not wait for it
            error = exc
            self.coll.post_failure(exc)
        flags = self.coll.table([float(error is None), float(off.resumed_step or 0)
                                 if off else 0.0], "setting up tiermem.offload")
        if error is not None:
            raise error
        bad = [self.coll.global_rank(r) for r, row in enumerate(flags) if not row[0]]
        if bad:
            off.close_tiers(remove_swap=not resume)
            raise self.coll.failure("set-up", TierMemError(f"rank(s) {bad} failed to set up"))
        if resume and len({row[1] for row in flags}) > 1:
            off = self._one_step_back(off, flags, settings, model, name)
        super().__init__(off)
        if self.generic and resume:
            # Each rank's manifest holds the values its own step left, before they were
            # shared: a rank owning no parameter of a group has those of a step with none.
            # A group's owners stepped it for real: the lowest one's go to every rank.
            self._share_values(None, {g for g, pcs in enumerate(self.layout.pieces) if pcs})
        opt.state.clear()  # each rank's share of it is in the tiers now
        self.rank_plans = self._gather_plans()
        self._plans_stale = False  # a group added since: refreshed at the next step
        # groups added (no collective) since the last agreement, as the next one compares
        # them: a rank that added other parameters or settings is refused there
        self._added: list[str] = []
        # Each rank's p.grad is its own until the step reduces it: torch's clipping would
        # clip it by its own norm before the average (dist/clip.py)
        self.clip = (AveragedClip(self.layout) if self._local_grads() and not self.layout.fsdp
                     else None)
        self._hooks = Installed(opt, self)
        if self._local_grads():
            self._hooks.claim_amp()  # so every rank's GradScaler step reaches the refusal
        if resume and off.crash:
            # Each rank restored its own pieces' weights from its masters: share them.
            self.layout.weights_out(self._fresh_comm(), off.weights_synced)
        if self.clip is not None:  # last: a set-up that failed leaves nothing routed here
            clipping.open_tier(self)

    def _build(self, settings: Settings, model: Any, name: str,
               resume: bool, previous: bool = False) -> OffloadedOptimizer:
        opt, lay = self.opt, self.layout
        groups = [{**_hyper(g), "params": views} for g, views in zip(opt.param_groups,
                                                                     lay.views)]
        if self.generic:
            # the user's own class and attributes, its constructor not called (what it
            # takes is its own); the rule checked on the user's optimizer makes its
            # partitions' shadows from this one from now on
            self.shadow = shadow_of_groups(opt, groups)
            self.rule.bind(self.shadow)
        else:
            # torch's own class of the rule (AdamW is Adam with its groups' flags), built
            # from the user's groups
            self.shadow = self.rule.optimizers[0](groups)
        # and the user's defaults: a group added later and Adagrad's accumulators start
        # from them, not from the group's values (AdagradRule.first_fill)
        self.shadow.defaults.update(opt.defaults)
        # What the shadow's __init__ made (Adagrad's eager accumulators, filled from its
        # own defaults: 0) is not the user's state: a group the user added before the
        # block has none until its first step, which fills it from the user's defaults
        # (OffloadedOptimizer.stateless); kept, it started from zeros and state_dict()
        # listed it before torch's does. The state is exactly the user's, seeded next.
        self.shadow.state.clear()
        if not previous:
            # (A rebuild one step back runs on the ranks ahead only, where _seed's
            # collective, FSDP2 whole parameters' full_entries, would pair with another
            # collective of the others; a resume drops this state anyway.)
            self._seed(opt.state)
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._names = names  # for the pieces of a group added later
        named = _Names([(names.get(id(lay.params[pc.index]), ""), v)
                        for pcs, vs in zip(lay.pieces, lay.views) for pc, v in zip(pcs, vs)])
        origins = [(pc.index, pc.start) for pcs in lay.pieces for pc in pcs]
        index = {id(p): i for i, p in enumerate(lay.params)}
        share = {"world": self.coll.world, "rank": self.coll.rank,
                 "ranks": [self.coll.global_rank(r) for r in range(self.coll.world)],
                 "pieces": [list(o) for o in origins],
                 "params": [{"name": names.get(id(p), ""), "shape": list(p.shape),
                             "dtype": str(p.dtype).removeprefix("torch.")}
                            for p in lay.params],
                 "group_params": [[index[id(p)] for p in g["params"]]
                                  for g in opt.param_groups]}
        return OffloadedOptimizer(self.shadow, rank_paths(settings, self.rank, self.local_rank),
                                  model=named if model is not None else None,
                                  swap_name=f"{name}-rank{self.rank}", resume=resume,
                                  resume_previous=previous, keep_previous=True,
                                  streams=self.streams, origins=origins, share=share,
                                  rule=self.rule if self.generic else None)

    def _one_step_back(self, off: OffloadedOptimizer, flags: list[list[float]],
                       settings: Settings, model: Any, name: str) -> OffloadedOptimizer:
        """The ranks resumed different steps: a crash-consistent run commits each rank's share
        on its own, and a crash between two ranks' commits leaves them one step apart. The
        ranks ahead reopen the commit before their last (manifest.PREVIOUS), whose records
        are still whole; any other difference is refused."""
        steps = {self.coll.global_rank(r): int(row[1]) for r, row in enumerate(flags)}
        low, high = min(steps.values()), max(steps.values())
        error = None
        if high - low == 1 and off.crash and int(off.resumed_step or 0) == high:
            off.detach()
            off.close_tiers(remove_swap=False)
            off = None
            try:
                off = self._build(settings, model, name, True, previous=True)
            except BaseException as exc:  # the others must hear of it, not wait for it
                error = exc
                self.coll.post_failure(exc)
        again = self.coll.table([float(off.resumed_step if off else -1)],
                                "resuming the same step on every rank")
        if error is not None:
            raise error
        if len({row[0] for row in again}) == 1:
            return off
        if off is not None:
            off.detach()
            off.close_tiers(remove_swap=False)
        raise TierMemError(f"cannot resume: the ranks kept different steps {steps}; ranks one "
                           "crash-consistent step apart go back to the lower one, but not "
                           "these")

    def _refuse_misshapen(self, entries: dict[int, Any]) -> None:
        """Refuse a parameter's per-element state whose size is not the parameter's (a
        checkpoint of the model before it was resized): its pieces were cut from it as
        from the parameter, silently, where the plain optimizer's next step raises. Every
        parameter's entry is checked, not only this rank's pieces', so that every rank,
        given the same state, refuses alike. Whole parameters (Adafactor, Muon) keep state
        in the rule's own shapes: their owner's OffloadedOptimizer checks those as in one
        process, and a refusal there reaches the other ranks as a PeerError naming it."""
        if self.whole:
            return
        for i, st in entries.items():
            if not (0 <= i < len(self.layout.params)) or not isinstance(st, dict):
                continue
            whole = self.layout.params[i]
            for key, v in st.items():
                if (isinstance(v, torch.Tensor) and key != "step" and v.dim() > 0
                        and v.numel() != whole.numel()):
                    raise TierMemError(
                        f"the state loaded for parameter {i} (shape {tuple(whole.shape)}) "
                        f"has {key!r} of shape {tuple(v.shape)}: a state_dict of another "
                        "model (or of this one before it was resized) cannot be loaded; the "
                        "plain optimizer's next step would fail on it")

    def _seed(self, state: dict) -> None:
        """State already in the user's optimizer (a checkpoint loaded before offload): its
        pieces become the shadow's, which OffloadedOptimizer imports into the tiers."""
        index = {id(p): i for i, p in enumerate(self.layout.params)}
        if self.whole and self.layout.fsdp:  # a collective: the owners need whole entries
            full = self.layout.full_entries({index[id(p)]: st for p, st in state.items()
                                             if id(p) in index})
            state = {self.layout.params[i]: st for i, st in full.items()}
        self._refuse_misshapen({index[id(p)]: st for p, st in state.items()
                                if id(p) in index})
        for p, st in state.items():
            i = index.get(id(p))
            if not st or i is None or i not in self._at:
                continue
            g, k = self._at[i]
            pc = self.layout.pieces[g][k]
            self.shadow.state[self.layout.views[g][k]] = {
                key: self._piece(key, v, pc) for key, v in st.items()}

    def _piece(self, key: str, value: Any, pc: Any) -> Any:
        """This rank's piece of one entry of a parameter's state: of a tensor with one value
        per element; a count or another per-parameter scalar (ASGD's eta) as it is."""
        if isinstance(value, torch.Tensor) and key != "step" and value.dim() > 0:
            return self.layout.piece_of(value, pc).clone()
        return value.clone() if isinstance(value, torch.Tensor) else value

    def _gather_plans(self) -> list[dict[str, Any]]:
        """Every rank's memory plan; and whether any rank's share holds state (a checkpoint
        loaded before the block, a resumed run, Adagrad's eager state): see holds_state."""
        tiers = self.offloaded.tiers
        b = tiers.tier_bytes()
        row = [float(self.layout.share_elements), b["gpu"], b["host"], b["nvme"],
               tiers.pinned_bytes, tiers.store.total_bytes if tiers.store else 0,
               float(self.offloaded.holds_state())]
        table = self.coll.table(row, "sharing the memory plans")
        self._held = any(t[6] for t in table)
        return [{"rank": self.coll.global_rank(r), "share_elements": int(t[0]),
                 "state_bytes": {"gpu": int(t[1]), "host": int(t[2]), "nvme": int(t[3])},
                 "pinned_bytes": int(t[4]), "swap_bytes": int(t[5])}
                for r, t in enumerate(table)]

    # -- hooks on the user's optimizer ---------------------------------------------------

    def holds_state(self) -> bool:
        """Whether a plain optimizer would hold per-parameter state now: what `opt.state`
        answers to truth testing inside the block (hooks.HeldState). torch's state_dict
        helpers step an optimizer whose opt.state is empty, with zero gradients and lr 0;
        here that step is a collective, so the answer must be the same on every rank
        without asking the others: a rank's own share may hold no piece of the parameters
        that stepped (or nothing at all). So it is kept as the ranks learn it together: at
        set-up (from every rank's share), at each step (a gradient on any rank), at a load
        (every rank is given the same state dict, or checkpoint)."""
        return self._held

    def _keeps_entries(self, stepped: set[int]) -> bool:
        """Parameters `stepped` (indices into the user's, the same on every rank) leave
        torch an entry in opt.state (not of an SGD group without momentum)."""
        ids = {id(self.layout.params[i]) for i in stepped}
        return any(self.rule.keeps_entry(group) for group in self.opt.param_groups
                   if any(id(p) in ids for p in group["params"]))

    def counts_loaded(self, steps: torch.Tensor, stateless: list[int] | None = None) -> None:
        """tiermem.dist.dcp.load gave every parameter its step count (`steps`, the whole
        model's, the same on every rank) and named those holding no state (`stateless`;
        None from an earlier tiermem's checkpoint)."""
        if stateless is None:
            held = self.rule.eager_state or bool((steps != 0).any())
        else:  # every parameter it does not name holds state (stepped, or not: Adagrad's)
            held = len(set(stateless)) < len(self.layout.params)
        self._held = bool(self.layout.params) and held

    def values_loaded(self, restore: Callable[[], None]) -> None:
        """tiermem.dist.dcp.load set the user's groups' values from a checkpoint: they go to
        this rank's optimizer, `restore` sets what the step keeps on that one (its rule's
        restore_step_values), and of the generic path those come back to the user's
        optimizer, as after a step. The same on every rank (replicated in the checkpoint)."""
        self._sync_groups()
        restore()
        if self.generic:
            self._values_to_user()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Every rank adds the same group: torch's add_param_group on the user's optimizer,
        the group cut into shares as at set-up (a group's cut depends on its own parameters
        only, so the groups before keep their shares), and this rank's pieces added to the
        shadow optimizer, whose OffloadedOptimizer partitions and tiers them (and commits,
        under crash_consistent) as in one process. Over ZeRO shares and FSDP2's own shards
        it is no collective (the next operation's agreement refuses ranks that did not add
        it); for whole-parameter rules over fully_shard parameters it is one (_add_together:
        the new parameters' shard spans and weights go to their owners)."""
        opt, lay, off = self.opt, self.layout, self.offloaded
        self._check_groups("optimizer.add_param_group()")
        if self.clip is not None and self.clip.early is not None:
            # the clip reduced the gradients of the groups before it only: the new group's
            # would never be reduced for the coming step
            raise TierMemError("optimizer.add_param_group() between a gradient clip and "
                               "opt.step() under distributed.grads: reduce_scatter: add the "
                               "group before clipping, or after the step")
        if self.whole and lay.fsdp:
            self._add_together(param_group)
        else:
            type(opt).add_param_group(opt, param_group)
            try:
                if self.generic:
                    # the new group probed on the user's optimizer, as at set-up: every rank
                    # holds all of it, so all come to one answer (a rank's optimizer, which
                    # its OffloadedOptimizer checks again, may hold none of the group)
                    check_optimizer(opt)
                lay.add_group(opt.param_groups[-1])
            except BaseException:
                opt.param_groups.pop()  # refused means not added at all
                raise
        group = opt.param_groups[-1]
        first = len(lay.params) - len(group["params"])
        pieces, views = lay.pieces[-1], lay.views[-1]
        shadow = len(off.origins)
        # Before the shadow's add, which may commit: the manifest's share and the pieces'
        # origins (stochastic rounding's streams) must cover the new pieces.
        off.origins.extend((pc.index, pc.start) for pc in pieces)
        off.names.update({id(v): self._names.get(id(lay.params[pc.index]), "")
                          for pc, v in zip(pieces, views)})
        share = off.share
        saved = {k: list(share[k]) for k in ("pieces", "params", "group_params")}
        share["pieces"] += [[pc.index, pc.start] for pc in pieces]
        share["params"] += [{"name": self._names.get(id(p), ""), "shape": list(p.shape),
                             "dtype": str(p.dtype).removeprefix("torch.")}
                            for p in group["params"]]
        share["group_params"].append(list(range(first, len(lay.params))))
        try:
            self.shadow.add_param_group({**_hyper(group), "params": views})
        except BaseException:
            share.update(saved)
            del off.origins[shadow:]
            lay.pop_group()
            opt.param_groups.pop()
            raise
        self._at.update({pc.index: (len(lay.pieces) - 1, k) for k, pc in enumerate(pieces)})
        self._covers = None  # new partitions, new windows
        self._plans_stale = True
        if not (self.whole and lay.fsdp):  # (_add_together compared them already)
            self._added.append(_described(len(opt.param_groups) - 1, group, self._names))
        if self.clip is not None:
            self.clip.reindex()

    def _add_together(self, param_group: dict[str, Any]) -> None:
        """add_param_group of a whole-parameter rule over fully_shard parameters: a
        collective. The ranks agree they are all adding a group; each checks the group as
        the plain optimizer and set-up would (torch's add_param_group, the rule, the FSDP2
        placement), and the ranks compare what they added (the parameters' shapes and
        dtypes, the group's settings): a refusal on any rank, or groups that differ, is
        raised on every rank, naming it, with nothing added anywhere. Then the layout
        gives the new parameters owners and gathers their weights (collectives)."""
        opt, lay = self.opt, self.layout
        self.agree("opt.add_param_group()")
        error: BaseException | None = None
        added = False
        try:
            type(opt).add_param_group(opt, param_group)
            added = True
            check_optimizer(opt)  # the rule (the generic path's probe), as at set-up
            lay.check_group(opt.param_groups[-1])
        except BaseException as exc:
            error = exc
        if error is None:
            group = opt.param_groups[-1]
            mine: Any = ("added", [(tuple(p.shape), str(p.dtype)) for p in group["params"]],
                         {k: value_digest(v) for k, v in _hyper(group).items()},
                         {k: repr(v)[:80] for k, v in _hyper(group).items()},
                         # parameters of one shape in another order are other parameters
                         [self._names.get(id(p), "") for p in group["params"]])
        else:
            mine = ("refused", f"{type(error).__name__}: {error}"[:1000])
        said = self.coll.from_lowest({self.coll.rank: mine}, self.coll.world,
                                     "comparing the param group each rank adds")
        rows = [said[r] for r in range(self.coll.world)]
        if all(row[0] == "added" for row in rows) and all(
                row[1:3] == rows[0][1:3] and row[4] == rows[0][4] for row in rows):
            try:
                lay.add_group(opt.param_groups[-1])  # collectives
            except BaseException:
                opt.param_groups.pop()
                raise
            return
        if added:
            opt.param_groups.pop()  # refused means not added at all, on every rank
        if error is not None:
            raise error
        who = lambda r: f"rank {self.coll.global_rank(r)}"  # noqa: E731
        refused = [f"{who(r)} refused it ({row[1]})" for r, row in enumerate(rows)
                   if row[0] == "refused"]
        if refused:
            raise TierMemError(
                "optimizer.add_param_group() inside tiermem.offload over fully_shard "
                "parameters is a collective that adds the group on every rank or on none: "
                + "; ".join(refused) + "; not added on any rank")
        diff = []
        if len({len(row[1]) for row in rows}) > 1:
            diff.append("the number of parameters (" + ", ".join(
                f"{who(r)}: {len(row[1])}" for r, row in enumerate(rows)) + ")")
        else:
            for k in range(len(rows[0][1])):
                if len({row[1][k] for row in rows}) > 1:
                    diff.append(f"parameter {k}'s shape and dtype (" + ", ".join(
                        f"{who(r)}: {list(row[1][k][0])} {row[1][k][1]}"
                        for r, row in enumerate(rows)) + ")")
                    break
            else:  # the same shapes: which parameters of the model they are
                for k in range(len(rows[0][4])):
                    if len({row[4][k] for row in rows}) > 1:
                        diff.append(f"parameter {k} (" + ", ".join(
                            f"{who(r)}: {row[4][k]}" for r, row in enumerate(rows)) + ")")
                        break
        keys = sorted({k for row in rows for k in row[2]})
        for k in keys:
            if len({row[2].get(k) for row in rows}) > 1:
                diff.append(f"{k!r} (" + ", ".join(
                    f"{who(r)}: {row[3].get(k, 'absent')}" for r, row in enumerate(rows))
                    + ")")
        raise TierMemError(
            "optimizer.add_param_group() inside tiermem.offload over fully_shard parameters "
            "adds the same group on every rank (each parameter is stepped whole by one "
            "owner rank), but the ranks' groups differ in " + "; ".join(diff)
            + "; not added on any rank. Add the same group, with the same settings, on "
            "every rank")

    def _check_groups(self, what: str) -> None:
        """The user's param groups hold the parameters the shares were cut from, group by
        group, as in one process (OffloadedOptimizer.check_groups, which sees only the
        shadow's): a group appended to param_groups, or groups replaced (Lightning's
        BaseFinetuning on a resume), hold parameters no rank tiers, which every step passed
        over without a word. Every rank runs the same code, so all refuse alike."""
        groups, lay = self.opt.param_groups, self.layout
        changed = groups_changed(groups, lay.group_sizes, lay.params)
        if changed is None:
            return
        sizes, new = changed
        which = (f"{len(new)} parameters no rank's share holds (the first of shape "
                 f"{tuple(new[0].shape)})" if new else "parameters moved, removed or regrouped")
        raise TierMemError(
            f"{what}: the optimizer's param_groups changed inside the tiermem.offload block "
            f"other than through add_param_group: {len(groups)} groups of {sizes} parameters "
            f"where the shares were cut from {len(lay.group_sizes)} of {lay.group_sizes}, "
            f"with {which}. tiermem would not update them; add a group with "
            "optimizer.add_param_group() on every rank, or set param_groups before entering "
            "the block")

    def _sync_groups(self) -> None:
        """Hyperparameters (an lr scheduler's lr, ...) from the user's groups to the shadow's."""
        for ug, sg in zip(self.opt.param_groups, self.shadow.param_groups):
            sg.update(_hyper(ug))

    @staticmethod
    def _fresh_comm() -> dict[str, float]:
        return {"comm_seconds": 0.0, "comm_wait_seconds": 0.0, "comm_bytes": 0,
                "weights_seconds": 0.0, "weights_wait_seconds": 0.0, "windows_early": 0}

    def _local_grads(self) -> bool:
        """Each rank's p.grad is its own until the step reduces it (or FSDP's shard of
        it): a GradScaler there sees only this rank's gradients."""
        return self.coll.world > 1 and self.layout.grads_mode != "allreduced"

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        opt = self.opt
        args, kwargs = run_pre_hooks(opt, (closure,), {})
        closure = args[0] if args else kwargs.get("closure")
        if closure is not None and self.closure_refusal:  # the same on every rank
            raise UnsupportedOptimizer(f"optimizer.step(closure) under torch.distributed: "
                                       f"{self.closure_refusal}")
        # GradScaler's hand-over (optim/amp.py) is the user's optimizer's, not the shadow's;
        # every rank takes the same branch (GradScaler steps each rank alike)
        scaled = amp.handover(opt)
        if scaled is not None:
            if self._local_grads():
                amp.refuse(opt, "fully_shard parameters" if self.layout.fsdp else
                           f"distributed.grads: {self.layout.grads_mode}",
                           "each rank's GradScaler looks for inf/NaN in its own gradients "
                           "before tiermem reduces them, so the ranks would disagree on "
                           "which steps to skip (DDP's all-reduced gradients, "
                           "distributed.grads: allreduced, work)")
            if self.generic:  # every rank alike: each one's GradScaler handed it over
                amp.refuse_own_step(opt)
            if amp.apply(opt, scaled):
                # Every rank must be skipping this step: DDP's all-reduced gradients give
                # each one the same inf flag, but gradients that were not all-reduced (a
                # loop without DDP, under grads: allreduced) would let one rank skip while
                # another steps, pairing its next step's collectives with this one's
                # without a word. One small all-reduce names the mismatch instead.
                # (grads: allreduced here: the other modes were refused above)
                self.agree("opt.step() skipped by GradScaler (inf/NaN gradients)"
                           + self.layout.grads_signature(), self.steps_called + 1)
                # torch's fused step makes the state of the parameters with gradients before
                # it skips (OffloadedOptimizer.skipped): of this rank's pieces of them. DDP
                # gives every rank the same set, so opt.state's truth stays alike on all.
                graded = [p.grad is not None for p in self.layout.params]
                # (origins: the user's parameter each of the shadow's pieces is of)
                self.offloaded.skipped(j for j, (i, _) in enumerate(self.offloaded.origins)
                                       if graded[i])
                if self.rule.skip_makes_state and any(graded):
                    self._held = True
                step_called(opt)
                run_post_hooks(opt, args, kwargs)
                return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        called = self.steps_called + 1
        self.coll.arrive(called)
        # an FSDP2 step of an elementwise rule communicates nothing: it pairs with nothing
        if not self.layout.fsdp or self.whole:
            op = INIT_STEP if in_torch_state_init() else "opt.step()"
            if self.layout.grads_mode == "allreduced":
                # No collective agrees on which parameters have gradients (DDP gives every
                # rank the same set): a parameter with one on some ranks only would be
                # stepped by none, or by some of its owners, without a word.
                op += self.layout.grads_signature()
            if self.clip is not None:
                op += self.clip.state()
            self.agree(op + self._unusable_here(), called)
        if self.clip is not None:
            self.clip.refuse_edited("opt.step()")  # every rank agreed on what it found
        self._check_groups("optimizer.step()")
        self.steps_called = called  # not before: a refused step is no step
        if self._plans_stale:  # a collective every rank reaches here, after the same adds
            self.rank_plans = self._gather_plans()
            self._plans_stale = False
        comm = self._fresh_comm()
        with torch.no_grad():
            before = self._values_from_user()
            t0 = time.monotonic()
            # the same on every rank; a clip since the last step reduced them already
            present = self.clip.take(comm) if self.clip is not None else None
            if present is None:
                present = self.layout.present()
                self.layout.grads_in(present, comm)
            comm["comm_seconds"] += time.monotonic() - t0
            gather = self._start_weights(comm)
            try:
                self.shadow.step()  # the OffloadedOptimizer's tiered step over this share
                self._held = self._held or self._keeps_entries(present)
            except BaseException as exc:
                self.coll.post_failure(exc)  # the others are about to wait for this rank
                raise
            finally:
                self.offloaded.after_update = None
                self.layout.release_grads()
            if gather is not None:
                gather.finish()  # the windows left, and a peer's failure during the update
            if self.generic:
                self._share_values(before)
        self.comm[self.offloaded.steps_taken] = comm
        self.comm.pop(self.offloaded.steps_taken - HISTORY, None)
        step_called(opt)
        run_post_hooks(opt, args, kwargs)
        return loss

    # -- clipping the averaged gradient (grads: reduce_scatter; optim/clipping.py routes
    # torch's clip_grad_norm_ / clip_grad_value_ here: clipping.Clipper) ----------------

    def held(self, p: torch.Tensor) -> bool:
        return self.clip is not None and self.clip.held(p)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the optimizer's parameters, of the gradients the
        step takes (under distributed.grads: reduce_scatter the averaged ones: dist/clip.py).
        A collective: every rank calls it. Returns the total norm."""
        params = [p for g in self.opt.param_groups for p in g["params"]]
        if self.clip is None:  # p.grad is what the step takes (DDP's mean, FSDP2's shard)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                  error_if_nonfinite)
        return self.clip_norm(params, max_norm, float(norm_type), error_if_nonfinite,
                              "tm.clip_grad_norm_")

    def _clip_start(self, params: list[torch.Tensor], what: str) -> tuple[list[int], set[int]]:
        clip = self.clip
        order, which = clip.subset(params, what)
        self.agree(f"{what} {which}{clip.state()}")
        clip.refuse_edited(f"another {what}")
        self._check_groups(what)
        comm = self._fresh_comm()
        t0 = time.monotonic()
        present = clip.reduce(comm)
        comm["comm_seconds"] += time.monotonic() - t0
        return order, present

    def clip_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                  error_if_nonfinite: bool, what: str) -> torch.Tensor:
        if not self.whole and (norm_type <= 0 or norm_type != norm_type):
            # ||x||_p of a vector is the p-norm of its parts' p-norms only for p > 0 (and
            # inf); torch's 0-"norm" of norms counts tensors, which a piece is not
            raise TierMemError(
                f"{what} with norm_type {norm_type} under distributed.grads: reduce_scatter: "
                "the shares cut parameters into pieces, and that norm of the pieces' norms "
                "is not the norm of the parameters'. Use a positive norm_type (2.0, inf)")
        with torch.no_grad():
            order, present = self._clip_start(params, what)
            total = self.clip.clip_norm(order, present, max_norm, norm_type,
                                        error_if_nonfinite)
        return total

    def clip_value(self, params: list[torch.Tensor], clip_value: float, what: str) -> None:
        with torch.no_grad():
            order, present = self._clip_start(params, what)
            self.clip.clamp(order, present, clip_value)

    # -- the generic path's values besides the per-parameter state ----------------------

    def _share_values(self, before: dict | None, settled: set[int] | None = None) -> None:
        """Every rank's optimizer ends a step (or a state method) with the values a rank that
        stepped each group left there (a count kept in the group, schedule-free's `k`,
        `weight_sum`, `train_mode`), and with the values the optimizer keeps on itself, as
        one that stepped any group left them; the user's optimizer gets them too. A rank
        that owns no parameter of a group (or none with a gradient) stepped it as a shadow
        with no parameters (ShadowRule.end_step), which an optimizer that counts only
        parameters it updates leaves behind. Collective."""
        sh, n = self.shadow, len(self.shadow.param_groups)
        if settled is None:
            settled = self.rule.settled_groups()
        offers: dict[int, Any] = {g: group_values(sh.param_groups[g]) for g in settled}
        if settled:
            offers[n] = own_values(sh)
        got = self.coll.from_lowest(offers, n + 1, "sharing the optimizer's group values")
        for g in range(n):
            if g in got:
                sh.param_groups[g].update(got[g])
        for key, v in got.get(n, {}).items():
            value_put(sh, key, v)
        self._values_to_user(before)

    def _values_to_user(self, before: dict | None = None) -> None:
        """The rank's optimizer's group values and the attributes it keeps on itself onto
        the user's optimizer, which state_dict() reads and the next step hands back
        (_values_from_user). Of the attributes, those that changed since `before` (its
        own_values() as the step began; None: every one, as a resume set them), never the
        one GradScaler reads (tiermem's machinery sets it on the rank's optimizer)."""
        for ug, sg in zip(self.opt.param_groups, self.shadow.param_groups):
            ug.update(group_values(sg))
        for key, v in own_values(self.shadow).items():
            if key[0] != ATTR or key[1] == AMP:
                continue
            if before is not None and key in before \
                    and value_digest(before[key]) == value_digest(v):
                continue
            value_put(self.opt, key, v)

    def _values_from_user(self) -> dict:
        """The user's group values (an lr scheduler's lr, ...) and public attributes (a flag
        set between steps) onto the rank's optimizer, before its step; returns that one's
        own_values() then, for _values_to_user."""
        self._sync_groups()
        if not self.generic:
            return {}
        for k, v in own_attributes(self.opt).items():
            if not k.startswith("_"):
                value_put(self.shadow, (ATTR, k), v)
        return own_values(self.shadow)

    @property
    def state_methods(self) -> tuple[str, ...]:
        """The optimizer's methods besides step() that use the per-parameter state
        (schedule-free's train()/eval()): the hooks route them to call_state_method."""
        return self.offloaded.state_methods if self.generic else ()

    def call_state_method(self, name: str, *args: Any, **kwargs: Any) -> None:
        """The optimizer's own `name`() (schedule-free's train()/eval(), which set the
        weights from the state) over every rank's share, as in one process, then the
        weights every rank set shared with every rank (a collective: every rank calls it)."""
        self.agree(f"opt.{name}()")
        self._check_groups(f"optimizer.{name}()")
        with torch.no_grad():
            before = self._values_from_user()
            if self.whole and self.layout.fsdp:  # the owners' buffers are what it reads
                self.layout.weights_in(self._fresh_comm())
            try:
                self.offloaded.call_state_method(name, *args, **kwargs)
            except BaseException as exc:
                self.coll.post_failure(exc)  # the others are about to wait for this rank
                raise
            self._share_values(before)
            self.layout.weights_out(self._fresh_comm(), self.offloaded.weights_synced)

    def _unusable_here(self) -> str:
        """What an operation's agreement adds when this rank's share is unusable (a load
        that failed part-way here, a failed step that could not be rolled back): the other
        ranks then refuse it with this one, naming why, instead of entering collectives
        that this rank leaves at its refusal (they would wait for it until the timeout)."""
        why = self.offloaded.unusable
        return f", refused on this rank: {why}" if why else ""

    def agree(self, op: str, step: int | None = None) -> None:
        """Before an operation's collectives (a step, a state_dict, a DCP checkpoint, the
        exit): every rank must be entering the same one (Collectives.agree), or all raise."""
        # the layout too: a rank that did not add a param group the others did would
        # communicate other shapes
        groups = self.opt.param_groups
        op += (f" over {sum(len(g['params']) for g in groups)} parameters in {len(groups)} "
               "param groups")
        if self._added:
            op += ", after adding " + ", ".join(self._added)
        try:
            self.coll.agree(op, self.steps_called if step is None else step)
            self._added = []
        except RankMismatch as exc:
            said = [d or "" for d in exc.doing]
            if any(", after adding " in d for d in said):
                raise RankMismatch(f"{exc}. {ADDED_WHY}", exc.doing) from None
            if any(INIT_STEP in d for d in said):
                raise RankMismatch(f"{exc}. {INIT_WHY}", exc.doing) from None
            marker = " with gradients on "
            if all(marker in d for d in said) and len({d.split(marker)[0] for d in said}) == 1 \
                    and len({d.split(marker)[1] for d in said}) > 1:
                raise RankMismatch(f"{exc}. {GRADS_WHY}", exc.doing) from None
            raise

    def _start_weights(self, comm: dict[str, float]) -> Any:
        """The weight all-gather of this step, launched window by window from the step loop
        as partitions are updated (None when nothing is gathered: one rank, or FSDP2)."""
        if self.layout.fsdp and not self.whole:
            return None
        if self.coll.world == 1 and not self.layout.fsdp:  # FSDP2 whole: buffers -> shards
            return None
        off = self.offloaded
        if self._covers is None:  # the partitions never change under a process group
            self._covers = self.layout.covers(off.parts)
        active = [p for p in off.parts if any(s.param.grad is not None for s in p.segments)]
        # The pipeline walks its partitions backwards on odd steps (zig-zag); every rank
        # takes the direction from the step number, so all launch windows in one order.
        backwards = off.settings.pipeline.zigzag and self.steps_called % 2 == 0
        gather = self.layout.start_weights(self._covers, active, backwards, comm,
                                           off.weights_synced)
        off.after_update = gather.updated
        return gather

    # -- state in torch's layout ---------------------------------------------------------

    def _kinds(self, *, model_dtype: bool) -> list[list[str]]:
        """State tensors (one value per element) of every parameter, as export_state gives
        them."""
        out = []
        for group in self.opt.param_groups:
            kinds = self.rule.torch_state_keys(group)
            for p in group["params"]:
                extra = [MASTER_KEY] if not model_dtype and p.dtype != torch.float32 else []
                out.append(kinds + extra)
        return out

    def _whole_state(self, shadow_state: dict, *, model_dtype: bool
                     ) -> dict[torch.Tensor, dict[str, Any]]:
        """The user's per-parameter state from every rank's shares (collective)."""
        by_view = {id(v): i for i, (g, k) in self._at.items()
                   for v in [self.layout.views[g][k]]}
        if self.whole:  # each parameter's entry is whole, on its one owner
            whole = self.layout.gather_whole({by_view[id(v)]: st
                                              for v, st in shadow_state.items()})
            return {self.layout.params[i]: st for i, st in whole.items()}
        at = {id(v): j for j, v in enumerate(self.offloaded.params)}
        mine = {}
        for v, st in shadow_state.items():
            # every rank holding a piece knows the parameter's step count, kept or not
            # (SGD keeps none in its state)
            step = st.get("step", self.offloaded.steps[at[id(v)]].clone())
            mine[by_view[id(v)]] = {**st, "step": step}
        scalar_keys = [list(self.rule.scalar_keys(g)) for g in self.opt.param_groups
                       for _ in g["params"]]
        whole = self.layout.gather_state(mine, self._kinds(model_dtype=model_dtype),
                                         scalar_keys, model_dtype=model_dtype,
                                         has_step=self.rule.has_step)
        return {self.layout.params[i]: st for i, st in whole.items()}

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state_dict of the whole model (fp32 moments), gathered from every
        rank's share: a collective every rank must call; each gets the whole state (DTensors
        under FSDP2). For states larger than RAM use tiermem.dist.dcp.save."""
        self.agree("opt.state_dict()" + self._unusable_here())
        self._check_groups("optimizer.state_dict()")
        return torch_state_dict(self.opt, self._whole_state(
            self.offloaded.export_state(model_dtype=False), model_dtype=False))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's format (every rank given the whole state, or DTensors under FSDP2): each
        rank loads its pieces, between the optimizer's load_state_dict hooks. Not a
        collective, except for whole-parameter rules (torch's Adafactor and Muon, the
        generic path) over fully_shard parameters, whose DTensor entries are gathered to
        each parameter's owner."""
        self._check_groups("optimizer.load_state_dict()")
        load_with_hooks(self.opt, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # each parameter's entry by its place in the saved groups (torch's mapping); every
        # rank is given the same state dict, so all refuse alike, before anything changes
        entries, _ = param_entries(state_dict, "each rank's share")
        if self.whole and self.layout.fsdp:  # a collective: the owners need whole entries
            self.agree("opt.load_state_dict()")
            entries = self.layout.full_entries(entries)
        # every parameter's, whichever rank holds pieces of it: all refuse alike
        group_of = [g for g, group in enumerate(state_dict["param_groups"])
                    for _ in group["params"]]
        refuse_unkept_keys(self.rule, self.opt, entries,
                           lambda i: state_dict["param_groups"][group_of[i]],
                           lambda i: "of the whole model", "loaded has")
        self._refuse_misshapen(entries)
        before = load_snapshot(self.opt)
        try:
            self._replace_state(state_dict, entries)
        except BaseException as exc:
            # the user's groups replaced and this rank's share not (or partly: the shadow's
            # load names its own failure): no step or state_dict() may take the mix
            self.offloaded.load_failed(exc, changed_since(self.opt, before))
            raise

    def _replace_state(self, state_dict: dict[str, Any], entries: dict[int, Any]) -> None:
        """_load_state_dict's replacing part: the user's groups, then this rank's share in
        the shadow optimizer."""
        type(self.opt).load_state_dict(self.opt, {"state": {},
                                                  "param_groups": state_dict["param_groups"]})
        self._sync_groups()
        shadow_state: dict[int, dict[str, Any]] = {}
        # every rank is given the same state: the same answer on each (holds_state). torch's
        # load replaces the state, eager or not: a parameter without an entry holds none
        # (Adagrad's too, as OffloadedOptimizer's stateless says in one process)
        self._held = bool(self.layout.params) and any(
            entries.get(i) for i in range(len(self.layout.params)))
        order = [i for g, pcs in enumerate(self.layout.pieces) for i in (pc.index for pc in pcs)]
        for j, i in enumerate(order):
            st = entries.get(i)
            if not st:
                continue
            g, k = self._at[i]
            pc = self.layout.pieces[g][k]
            shadow_state[j] = {key: self._piece(key, v, pc) for key, v in st.items()}
        groups, j = [], 0
        for sg in self.shadow.param_groups:
            groups.append({**_hyper(sg), "params": list(range(j, j + len(sg["params"])))})
            j += len(sg["params"])
        self.shadow.load_state_dict({"state": shadow_state, "param_groups": groups})

    # -- the handle ------------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.opt

    def plan(self) -> dict[str, Any]:
        """This rank's figures (as in one process), plus every rank's in `ranks` (gathered at
        set-up, and again at the first step after an add_param_group: a collective)."""
        out = super().plan()
        out.update(rank=self.rank, local_rank=self.local_rank, world=self.coll.world,
                   mode="fsdp2" if self.layout.fsdp else "zero",
                   grads=self.layout.grads_mode, share_elements=self.layout.share_elements,
                   ranks=self.rank_plans)
        return out

    def stats(self) -> list[dict[str, Any]]:
        """Per step as in one process, plus communication: comm_seconds (packing and
        collectives of the gradients in and weights out), comm_wait_seconds (blocked on
        them), comm_bytes (sent and received by this rank, padding included); of these
        seconds, weights_seconds and weights_wait_seconds were the weight all-gather's;
        windows_early: weight windows launched while the update still ran."""
        out = super().stats()
        for d in out:
            d.update(self.comm.get(d["step"], self._fresh_comm()))
        return out

    # -- leaving the block -----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.block_name

    def _mark_kept(self) -> None:
        # The user's optimizer (not the shadow) is what the user steps: guard that one.
        mark_kept(self.opt, self.kept_on_disk, self.name, self.offloaded.committed_step,
                  rank=self.rank)

    def _mark_lost(self, run_dir: str, why: str) -> None:
        mark_lost(self.opt, run_dir, why, rank=self.rank)  # the user's optimizer, as above

    def _full_state_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() * 2 for p in self.layout.params)

    def leave(self, exc: BaseException | None) -> None:
        """The block's way out for this rank: with an error no collective runs (the other
        ranks may be gone) and this rank's share stays on disk."""
        clipping.close_tier(self)  # torch's clipping is its own again for these parameters
        try:
            if exc is None:
                self._exit()
            else:
                self._exit_on_error(exc)
        finally:
            self.coll.close()  # this offload is over: stop its heartbeat

    def _exit_on_error(self, exc: BaseException) -> None:
        """No collective: the other ranks may be gone. This rank's share stays on disk."""
        self.coll.post_failure(exc)
        off = self.offloaded
        self._hooks.remove()
        off.detach()
        try:
            if self._discard:
                off.close_tiers(remove_swap=True)
                return
            if off.unusable:
                where = self._leave_unusable()
            else:
                self.kept_on_disk = off.keep_on_disk()
                self._mark_kept()  # a caught exception must not let opt.step() start over
                where = self.where_state_is()
        except BaseException as err:
            exc.add_note(f"tiermem: rank {self.rank} could not keep its share on disk ({err})")
            return
        exc.add_note(f"tiermem: rank {self.rank} left on {type(exc).__name__}; {where}")

    def _leave_unusable(self) -> str:
        """This rank's share is neither one step's nor another's (a failed load or state
        method): it must reach no manifest (handle.Offload._exit_unusable). crash_consistent:
        the last commit stays on disk, untouched, to resume; scratch: nothing else holds the
        share, it is gone, and opt.step() says so rather than start it over. Returns where
        the state is, in a sentence."""
        off = self.offloaded
        if self._commit_or_lost(f"{off.unusable}, before its tiermem.offload block ended",
                                remove_swap=True):
            return f"its share was unusable ({off.unusable}); {self.where_state_is()}"
        return (f"its share is lost ({off.unusable}; swap.durability scratch keeps no "
                "committed copy)")

    def _leave_failed(self, flushed: bool) -> str:
        """This rank's share could not be handed back: a record could not be read back
        (`flushed`: every record reached the disk, which keeps them with a manifest, as when
        the state does not fit in memory), or some write-backs failed for good, and those
        records are in buffers only: crash_consistent keeps the last commit (the failed
        writes went to records no commit names), and under scratch the share is lost.
        opt.step() says which rather than start the optimizer over. Returns it in a
        sentence."""
        off = self.offloaded
        if flushed:
            self.kept_on_disk = off.keep_on_disk()
            self._mark_kept()
            return self.where_state_is()
        if self._commit_or_lost("writing it back to swap failed as its tiermem.offload "
                                "block ended", remove_swap=False):
            return self.where_state_is()
        return ("its share is lost: the records whose writes failed are lost with this "
                "process (swap.durability scratch keeps no committed copy)")

    def _exit(self) -> None:
        off = self.offloaded
        self._hooks.remove()
        if self._discard:
            off.detach()
            off.close_tiers(remove_swap=True)
            return
        state, failed, flushed = None, None, False
        fits = self._full_state_nbytes() <= available_memory() * 0.8
        try:
            if off.unusable:
                raise TierMemError(off.unusable)
            off.tiers.flush()
            flushed = True
            if fits:
                state = off.export_state(model_dtype=True)
        except TierMemError as exc:
            failed = exc
            self.coll.post_failure(exc)
        try:
            self.agree("leaving tiermem.offload")
        except RankMismatch as exc:
            # The others are elsewhere: no collective may follow, as on an exception.
            self._exit_on_error(exc)
            raise
        flags = self.coll.table([float(failed is None), float(fits)], "leaving tiermem.offload")
        off.detach()
        if all(row[0] for row in flags) and all(row[1] for row in flags):
            whole = self._whole_state(state, model_dtype=True)
            self.opt.state.clear()
            self.opt.state.update(whole)
            off.close_tiers(remove_swap=True)
            return
        if off.unusable:
            raise TierMemError(f"rank {self.rank}: leaving tiermem.offload, "
                               f"{self._leave_unusable()}") from failed
        if failed is not None:
            raise TierMemError(f"rank {self.rank}: its share of the optimizer state could not "
                               f"be {'gathered' if flushed else 'written back'} ({failed}); "
                               f"{self._leave_failed(flushed)}") from failed
        self.kept_on_disk = off.keep_on_disk()
        self._mark_kept()
        bad = [self.coll.global_rank(r) for r, row in enumerate(flags) if not row[0]]
        if bad:
            raise TierMemError(f"rank(s) {bad} could not write back their share of the "
                               f"optimizer state; rank {self.rank} kept its share on disk in "
                               f"{self.kept_on_disk}")
        warnings.warn(
            f"tiermem: the whole optimizer state ({format_size(self._full_state_nbytes())}) "
            f"does not fit in the free host memory of every rank, so each rank keeps its "
            f"share on disk (rank {self.rank}: {self.kept_on_disk}), and opt.step() raises "
            f"until it is resumed. Resume with {resume_call(self.name)} on every rank, with "
            "the same world size.",
            TierMemWarning, stacklevel=4)
