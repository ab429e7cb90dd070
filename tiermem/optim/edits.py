"""The model's weights changed between steps by someone other than tiermem (a clamp, a
pruning mask, model.load_state_dict(), new weights assigned to p.data): which ones, until
the records take them.

Where a step starts from a record's master (a bf16/fp16 model, a device model updated on
the host), a change to the weights would be overwritten by it; the plain optimizer steps
the weights it is given. So each parameter's mark is kept when tiermem last wrote its
weights or read them into its record (the end of a step, a commit, a restore, a load),
and a mark moved since then makes the parameter *pending*: its master takes the change
at its next update (every piece of a parameter cut over several partitions), or at the
next commit for one that takes no step. A pending parameter stays pending until all of its
pieces were updated, so a step that fails part-way leaves the rest for the next one.

Marks are looked at once, when a step begins, before any write of its own: parameters
that are views of one buffer share a version counter, which an update of one moves for
all of them. With the parameter tier, the tier's own record of changes says which
(ParamTier.take_pending_edits: it sees changes through p.data too).
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Iterable, Sequence

import torch


def weights_mark(p: torch.Tensor) -> tuple[int, int, Any]:
    """What tells a parameter's weights from an edit of them: its version counter, which
    every in-place change through it or a view of it moves, and where its data lives,
    which new weights assigned to p.data change (an assignment moves no counter): the
    address, and the storage itself (weakly: one freed since may have left its address
    to the new weights). A tensor without a storage of its own (a sparse one) has
    neither: its version counter only."""
    try:
        return p._version, p.data_ptr(), weakref.ref(p.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return p._version, 0, None


def moved(mark: tuple[int, int, Any] | None, p: torch.Tensor) -> bool:
    if mark is None:
        return False  # (a parameter added since: its first step starts from its weights)
    version, ptr, storage = mark
    if storage is None:
        return version != p._version
    return (version != p._version or ptr != p.data_ptr()
            or storage() is not p.untyped_storage())


class EditedWeights:
    """The marks and the pending set of an optimizer's parameters (see the module). No
    mark is kept until the first record(): the owner's, once its set-up is done."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params  # (the optimizer's list: parameters added later are in it)
        self.marks: dict[int, tuple[int, int, Any]] = {}
        self.pending: set[int] = set()
        self.taken = 0  # parameters whose edits an update took into its master
        self._taking: set[int] = set()  # of this step's pending, those counted in `taken`
        self._pieces: Counter[int] = Counter()  # per parameter, its partitions
        self._done: Counter[int] = Counter()  # per parameter, its pieces updated this step

    def record(self, indices: Iterable[int] | None = None) -> None:
        """The weights and the records agree now (tiermem wrote the one from the other)."""
        for i in range(len(self.params)) if indices is None else indices:
            self.marks[i] = weights_mark(self.params[i])

    def note(self, tier_edits: Iterable[int] | None = None) -> None:
        """Parameters whose weights changed since their marks were kept become pending; with
        the parameter tier (whose weights come and go from p.data), `tier_edits` instead:
        those the tier saw changed."""
        if tier_edits is not None:
            self.pending.update(tier_edits)
            return
        for i, p in enumerate(self.params):
            if moved(self.marks.get(i), p):
                self.pending.add(i)

    def begin(self, parts: Sequence[Any]) -> None:
        """A step begins (after note) over the layout `parts` (partitions of segments)."""
        self._pieces = Counter(s.index for part in parts for s in part.segments)
        self._done.clear()
        self._taking.clear()

    def take(self, i: int) -> bool:
        """Whether parameter i's update takes its weights' changes first (pending)."""
        if i not in self.pending:
            return False
        if i not in self._taking:
            self._taking.add(i)
            self.taken += 1
        return True

    def updated(self, indices: Iterable[int]) -> None:
        """One piece of each of `indices` was updated: a parameter all of whose pieces
        were is no longer pending."""
        for i in indices:
            self._done[i] += 1
            if self._done[i] >= self._pieces.get(i, 1):
                self.pending.discard(i)

    def settled(self, indices: Iterable[int] | None = None) -> None:
        """The records took the changes of `indices` (all: None) or gave them theirs (a
        commit, a restore, a load): not pending, marks kept now."""
        if indices is None:
            self.pending.clear()
        else:
            indices = list(indices)
            self.pending.difference_update(indices)
        self.record(indices)

    def synced(self, index: int, before: int, after: int) -> None:
        """Parameter `index`'s version counter went from `before` to `after` by writes that
        changed none of this optimizer's elements of it (a rank's all-gather of its peers'
        pieces into the parameter its own piece is a view of): no edit. An edit before it
        still counts: the version then no longer is the one the mark kept."""
        mark = self.marks.get(index)
        if mark is not None and mark[0] == before:
            self.marks[index] = (after, *mark[1:])
