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
from typing import Any, ClassVar, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.partition import Partition

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
    offsets: list[int] = field(default_factory=list)  # each segment's element offset in the record


class UnsupportedOptimizer(TierMemError, TypeError):
    """An optimizer (or a setting of one) no rule runs exactly."""


class UpdateRule(ABC):
    """One optimizer family's record layout and per-partition update."""

    #: torch.optim classes (and subclasses) the rule runs exactly
    optimizers: ClassVar[tuple[type, ...]] = ()
    #: the math is elementwise, so a parameter may be cut across partitions
    elementwise: ClassVar[bool] = True
    #: state kind -> key in torch's per-parameter state
    torch_keys: ClassVar[dict[str, str]] = {}

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

    @abstractmethod
    def init(self, part: Partition, views: Views) -> None:
        """Build a never-written record (the model's weights are in the segments)."""

    @abstractmethod
    def update(self, batch: Batch, *, kernel: str) -> list[dict[str, int]] | None:
        """Update the batch in place with `kernel`; the per-segment CRC32Cs of
        `batch.checksums` when the kernel computed them in its pass, else None."""
