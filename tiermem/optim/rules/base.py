"""The update-rule seam: what a partition's record holds and how one partition is updated.

A rule knows one optimizer family. The offloaded optimizer gathers a partition's
segments (weights, gradients, step counts, state views) into a `Batch` and asks
the rule to update it; tiers, pipeline and swap never see a rule: to them a
record is bytes laid out by `kinds`. A new optimizer is a new rule registered in
`rules/__init__.py`, with no change below optim/.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.partition import Partition, Segment, flat, is_dense

Views = dict[str, torch.Tensor]


@dataclass
class Batch:
    """One partition's update, gathered by the optimizer: per segment with a gradient, the
    fp32 tensor to update (`params`: the model's own weights, or the record's master), the
    gradient, the step count after this step's increment, and each state kind's view."""

    part: Partition
    group: dict[str, Any]
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    state: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # In-pass work only the native kernel does (see kernels.adam.adam_native):
    weights_out: list[torch.Tensor | None] | None = None  # low-precision model weights
    checksums: Sequence[str] = ()  # arrays whose CRC32C the pass returns per segment
    # Per segment: whether its parameter had no state before this step (torch builds
    # state lazily at a parameter's first step), and private copies of the parameter's
    # host scalars (UpdateRule.scalar_keys) as the last step left them; the rule updates
    # those copies and the optimizer keeps them as the parameter's new values.
    first: list[bool] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)  # of each entry, in order
    # Per segment: the user's parameter and the element of it the segment starts at (a
    # rank's share is a piece of one): what keys stochastic rounding's random streams.
    origins: list[tuple[int, int]] = field(default_factory=list)
    scalars: list[dict[str, torch.Tensor]] = field(default_factory=list)
    # Threads tiermem's native pass may use (None: torch's count; optim.threads decides).
    threads: int | None = None


class PreparedUpdate(ABC):
    """Several partitions' update made ready once (UpdateRule.prepare_together) for records
    and weights that stay where they are from step to step; run() takes what changes."""

    #: per gradient slot, the parameter (Segment.index) whose gradient and step count
    #: run() takes in that place
    slots: list[int]

    @abstractmethod
    def run(self, *, grads: Sequence[torch.Tensor], steps: Sequence[torch.Tensor],
            group: dict[str, Any], threads: int | None) -> None:
        """Update every segment in place: grads[k] (1-D: the parameter's whole gradient, in
        the parameter's memory order) and steps[k] (the count after this step's increment)
        of parameter slots[k], the hyperparameters of `group` as they are now."""


class UnsupportedOptimizer(TierMemError, TypeError):
    """An optimizer (or a setting of one) no rule runs exactly."""


def check_group_tensors(g: int, group: dict[str, Any], *, elementwise: bool = False) -> None:
    """What no rule runs: differentiable steps, a parameter listed twice in a group, and
    parameters that are not real floating-point tensors laid out as a record holds them
    (flat): dense (channels_last included) for an `elementwise` rule, whose segments
    address a parameter in memory order, else contiguous (a whole-parameter rule hands the
    optimizer its state shaped as the parameter, row-major)."""
    if group.get("differentiable"):
        raise UnsupportedOptimizer(f"param_groups[{g}]: differentiable=True is not supported")
    seen: set[int] = set()
    for n, p in enumerate(group["params"]):
        if id(p) in seen:
            # torch only warns, and steps such a parameter once per listing (twice its
            # update, on one state); its records would hold it once per listing instead
            raise UnsupportedOptimizer(
                f"param_groups[{g}]: params[{n}] (shape {tuple(p.shape)}) is listed twice in "
                "the group (tied weights gathered from two modules?): list each parameter "
                "once, as torch will require")
        seen.add(id(p))
        if not p.is_floating_point() or p.is_complex():
            raise UnsupportedOptimizer(f"param_groups[{g}]: parameters must be real "
                                       f"floating point, got {p.dtype}")
        if p.dtype == torch.float64:
            # every record keeps its state, and the master of a parameter that is not fp32,
            # in fp32: each float64 update would come back rounded to fp32
            raise UnsupportedOptimizer(
                f"param_groups[{g}]: {p.dtype} parameters are not supported (tiermem keeps "
                "optimizer state and master weights in fp32, which would round every "
                "update); train in fp32, or leave this optimizer untiered")
        if p.is_contiguous():
            continue
        if not is_dense(p):
            raise UnsupportedOptimizer(
                f"param_groups[{g}]: params[{n}] (shape {tuple(p.shape)}, strides "
                f"{tuple(p.stride())}) is not dense (a view with gaps or overlaps, as "
                "t.expand or t[:, ::2] make): tiermem keeps a parameter as one run of "
                "memory; make it a tensor of its own (.contiguous())")
        if not elementwise:
            raise UnsupportedOptimizer(
                f"param_groups[{g}]: params[{n}] (shape {tuple(p.shape)}, strides "
                f"{tuple(p.stride())}) is not contiguous (channels_last?), and this "
                "optimizer keeps whole-parameter state, which tiermem lays out row-major "
                "only: tiermem tiers non-contiguous parameters for elementwise optimizers "
                "(Adam, AdamW, torch's SGD ... Rprop); convert the model with "
                "model.to(memory_format=torch.contiguous_format), or leave this optimizer "
                "untiered")


class UpdateRule(ABC):
    """One optimizer family's record layout and per-partition update."""

    #: torch.optim classes (and subclasses) the rule runs exactly
    optimizers: ClassVar[tuple[type, ...]] = ()
    #: the math is elementwise, so a parameter may be cut across partitions
    elementwise: ClassVar[bool] = True
    #: state kind -> key in torch's per-parameter state
    torch_keys: ClassVar[dict[str, str]] = {}
    #: torch's state has a "step" count per parameter (SGD's has not)
    has_step: ClassVar[bool] = True
    #: torch builds every parameter's state when the optimizer is made, not at its first
    #: step (Adagrad): exported state includes parameters never stepped
    eager_state: ClassVar[bool] = False
    #: torch's fused step makes the state of every parameter with a gradient
    #: (_init_group: Adam's step 0 and zero moments) before it skips a step GradScaler
    #: found inf/NaN in: such a parameter holds state although it never stepped
    skip_makes_state: ClassVar[bool] = False
    #: the optimizer's own step() runs (the generic path), which would honour a GradScaler
    #: hand-over tiermem honoured already: refused (amp.refuse_own_step)
    own_step: ClassVar[bool] = False
    #: what the rule keeps of a parameter's torch-format state is a fixed set of keys
    #: (see unkept_keys): a loaded key outside it is refused, never dropped. Rules laid
    #: out from the state itself (the generic path) refuse in from_torch_state instead.
    fixed_keys: ClassVar[bool] = False
    #: its step writes into the gradients it is given (schedule-free divides them in place;
    #: set by the generic rule's probe): updates during backward would hand the user other
    #: gradients after backward than the plain run does
    writes_grads: bool = False

    def writes_group_grads(self, group: dict[str, Any], kernel: str) -> bool:
        """The plain optimizer's step, with `group`'s flags and the implementation
        optimizer.kernel `kernel` matches, writes into the gradients it is given."""
        return False
    #: the kernel optimizer.kernel auto runs where the native one does not: Adam's torch
    #: fused kernel (faster, within 1e-6), the torch family's match (bitwise with plain)
    auto_kernel: ClassVar[str] = "fused"

    def auto_for(self, group: dict[str, Any]) -> str:
        """The kernel optimizer.kernel auto runs for this group where the native one does
        not (auto_kernel, unless the group's flags need the plain optimizer's own)."""
        return self.auto_kernel

    def scalar_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """Per-parameter 0-d state besides step (ASGD's eta, mu), kept on the host and in
        the manifest rather than in the record."""
        return ()

    def initial_scalars(self, group: dict[str, Any]) -> dict[str, float]:
        """The scalar_keys' values before a parameter's first step."""
        return {}

    def keeps_entry(self, group: dict[str, Any]) -> bool:
        """A parameter of a group with these flags, once stepped, has an entry in torch's
        opt.state (SGD without momentum keeps none, and opt.state stays empty)."""
        return True

    def torch_state_keys(self, group: dict[str, Any]) -> list[str]:
        """The per-parameter state tensors torch keeps for a group with these flags."""
        return [self.torch_keys[k] for k in self.kinds_for(group)]

    def unkept_keys(self, group: dict[str, Any], state: dict[str, Any]) -> list[Any]:
        """The keys of one parameter's torch-format state (loaded, or held at entry) the
        rule would not keep: step, scalar_keys, the group's state tensors and an fp32
        master are all it keeps. torch keeps any other key unused (an amsgrad checkpoint's
        max_exp_avg_sq loaded with amsgrad=False) and hands it back in state_dict()."""
        if not self.fixed_keys:
            return []
        kept = {*self.torch_state_keys(group), *self.scalar_keys(group),
                self.torch_keys["master"]}
        if self.has_step:
            kept.add("step")
        return [k for k in state if k not in kept]

    def host_scalars(self, state: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
        """The host scalars (scalar_keys) in one parameter's torch-format state."""
        return {k: torch.as_tensor(state[k], dtype=torch.float32).detach().clone().cpu()
                for k in self.scalar_keys(group) if k in state}

    def torch_state_tensors(self, param: torch.Tensor, group: dict[str, Any],
                            dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(key, shape, dtype) of each state tensor torch keeps for `param` (`dtype`: the
        one asked for the per-element state)."""
        return [(k, tuple(param.shape), dtype) for k in self.torch_state_keys(group)]

    def to_torch_state(self, param: torch.Tensor, group: dict[str, Any],
                       state: dict[str, Any]) -> dict[str, Any]:
        """One parameter's exported state (a tensor per record kind) in torch's own form
        (the generic path puts lists and dicts of tensors back together)."""
        return state

    def from_torch_state(self, param: torch.Tensor, group: dict[str, Any],
                         state: dict[str, Any]) -> dict[str, Any]:
        """One parameter's torch-format state as a tensor per record kind (the inverse of
        to_torch_state; raises where it cannot be laid out so)."""
        return state

    def kinds_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state kinds (besides a master) a group with these flags keeps."""
        return ()

    def wants_native(self, kernel: str, part: Partition, *, on_host: bool) -> bool:
        """Whether tiermem's native kernel runs this partition (Adam only)."""
        return False

    def begin_step(self, groups: Sequence[dict[str, Any]], *,
                   closure: Callable[[], Any] | None = None) -> None:
        """A step starts (before any partition of it is updated). closure: the user passed
        step() one, which tiermem has evaluated: this one returns its loss."""

    def end_step(self, groups: Sequence[dict[str, Any]]) -> None:
        """Every partition of the step is updated: move what the plain step moves even for a
        group none of whose parameters has a gradient (no partition of it was updated), as
        a count kept in the group."""

    def uses_loss(self) -> bool:
        """Whether the optimizer's step reads the loss its closure returns (so an update
        started before that loss exists, during backward, would not be the plain one)."""
        return False

    def check_closure(self) -> None:
        """The user passes step() a closure, which tiermem evaluates once, before any
        partition: raise UnsupportedOptimizer if that is not what the optimizer's own step
        would do with it (nothing has changed yet)."""

    def undo_step_values(self) -> None:
        """A step failed part-way and its state is rolled back: put back whatever values of
        the optimizer's own (outside its per-parameter state) the step changed."""

    def step_changed_values(self) -> list[str]:
        """The values outside the per-parameter state that the optimizer's step changes
        (a counter in its groups or on itself), which a manifest does not keep: a resume
        from disk would start them over."""
        return []

    def step_values(self) -> dict[str, Any]:
        """The values step_changed_values() names, as they are now, for a manifest to keep:
        {"groups": {group index: {key: value}}, "own": {attribute: value}}."""
        return {}

    def restore_step_values(self, values: dict[str, Any]) -> None:
        """Set back what step_values() gave (a resume); raise UnsupportedOptimizer when a
        value the step changes is not among them."""

    def state_methods(self) -> tuple[str, ...]:
        """The optimizer's methods besides step() that use the per-parameter state
        (schedule-free's train()/eval()); tiermem routes them to run_method()."""
        return ()

    def run_method(self, name: str, batch: Batch) -> None:
        """Run the optimizer's `name`() (one of state_methods()) on one partition."""
        raise NotImplementedError(name)

    def check_loaded(self, part: Partition, saved: dict[str, Any]) -> None:
        """Raise if a checkpoint's param group `saved` needs another record layout."""
        want = tuple(k for k in part.kinds if k != "master")
        if self.kinds_for(saved) != want:
            raise TierMemError(
                f"param_groups[{part.group}]: the checkpoint's group keeps state "
                f"{list(self.kinds_for(saved))}, the state tiermem.offload laid out keeps "
                f"{list(want)}; load it before entering offload")

    @abstractmethod
    def check(self, opt: torch.optim.Optimizer) -> None:
        """Raise UnsupportedOptimizer for anything the rule cannot do exactly."""

    @abstractmethod
    def kinds(self, param: torch.Tensor, group: dict[str, Any], *, keep_master: bool
              ) -> tuple[str, ...]:
        """The state tensors a record keeps per element of `param`, in record order."""

    @abstractmethod
    def check_group(self, part: Partition, group: dict[str, Any]) -> None:
        """Raise if `group` changed since `part`'s record was laid out (before a step)."""

    def init(self, part: Partition, views: Views) -> None:
        """Build a never-written record: state zero (a rule whose torch optimizer starts
        elsewhere fills it at the parameter's first step, as torch does), the master
        weights from the model."""
        for k, v in views.items():
            if k != "master":
                v.zero_()
        if "master" in views:
            for s, sl in zip(part.segments, part.slices("master")):
                views["master"][sl].copy_(flat(s.param.detach())[s.start: s.start + s.length])

    @abstractmethod
    def update(self, batch: Batch, *, kernel: str) -> list[dict[str, int]] | None:
        """Update the batch in place with `kernel`; the per-segment CRC32Cs of
        `batch.checksums` when the kernel computed them in its pass, else None."""

    def prepare_together(self, batches: Sequence[Batch], *, kernel: str
                         ) -> PreparedUpdate | None:
        """Several partitions' batches (nothing to hash: no checksums) as one update whose
        threads go on from one partition to the next without a join, made ready for these
        records and weights, or None where the rule has no such update (update_together
        then runs them)."""
        return None

    def update_together(self, batches: Sequence[Batch], *, kernel: str) -> None:
        """Update several partitions' batches (nothing to hash) in place, one after
        another."""
        for batch in batches:
            self.update(batch, kernel=kernel)
