"""Every parameter's step count, in one tensor.

torch keeps a 0-d float32 `step` tensor per parameter and increments them all with one
foreach add; on the CPU that add still dispatches once per tensor (~4 us each, ~0.1 ms
a step on a model of 25 tensors, most of the offload step's own Python on a host-tier
step that runs at memory speed), and the native kernels then read each count back with
its own .item(). Here the counts are one 1-D float32 tensor: a step of every parameter
is one add, the kernels read every count with one tolist(), and parameter i's count is
still a 0-d tensor (a view of element i) for the rules and torch's kernels that take
one. A view stays live: like the tensor torch increments in place, it shows later
steps; whoever keeps a count clones it (state_dict).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


class StepCounts:
    """The step counts of parameters 0..n-1 (float32, as torch keeps them: exact to 2**24)."""

    def __init__(self, values: Iterable[float] = ()) -> None:
        self._set_all(torch.tensor([float(v) for v in values], dtype=torch.float32))

    def _set_all(self, counts: torch.Tensor) -> None:
        self._counts = counts
        # made once: a view per access would cost what the one tensor saves
        self._views = list(counts.unbind())

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._views[i]

    def __setitem__(self, i: int, value: float | torch.Tensor) -> None:
        self._counts[i] = float(value)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._views)

    def values(self) -> list[float]:
        """Every count as a float, in one read."""
        return self._counts.tolist()

    def increment(self, indices: set[int]) -> None:
        """Parameters `indices` take a step."""
        self._add(indices, 1.0)

    def decrement(self, indices: set[int]) -> None:
        """Parameters `indices` did not take the step they were counted for after all."""
        self._add(indices, -1.0)

    def _add(self, indices: set[int], amount: float) -> None:
        if len(indices) == len(self._views):
            self._counts.add_(amount)
        elif indices:
            self._counts.index_add_(0, torch.tensor(sorted(indices), dtype=torch.long),
                                    torch.full((len(indices),), amount))

    def extend(self, n: int) -> None:
        """n more parameters, never stepped (add_param_group). Views handed out before
        still show the counts as they were, no later step."""
        self._set_all(torch.cat([self._counts, torch.zeros(n)]))
