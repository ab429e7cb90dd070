"""Gradient clipping of the averaged gradient under `distributed.grads: reduce_scatter`.

In that mode each rank's p.grad is its own gradient until opt.step() reduce-scatters it.
torch.nn.utils.clip_grad_norm_ over the model's parameters would clip each rank's
gradient by its own norm before the average, where DDP (whose p.grad is the mean
already) clips the mean by the mean's norm: another update, with nothing said. While
such a block is open torch's clip_grad_norm_ and clip_grad_value_ come here
(optim/clipping.py routes them) and clip what DDP clips:

- the gradients are reduce-scattered at the clip instead of at the step (the step then
  takes the shares as the clip left them);
- the norm is torch's norm of norms, over every piece's norm: each rank computes its
  pieces' norms, one all-reduce puts them in a vector in the order torch would stack
  the parameters' norms (pieces of one parameter in element order), and torch's own
  vector_norm of that vector is the total. Where shares hold whole parameters (rules
  whose math spans one: Adafactor, Muon) a piece's norm is the parameter's and the
  total has the same bits as DDP's; where shares cut parameters it is the same norm
  with another rounding;
- the coefficient (torch's expression) multiplies this rank's shares of the
  parameters clipped; clip_grad_value_ clamps them.

p.grad itself is left as the rank computed it (docs/guide/distributed.md), so a change of
it between the clip and the step cannot be applied on top of the clip as it would be
under DDP. A step (or another clip) after such a change is refused, except where every
gradient the clip saw is gone (opt.zero_grad() and a new backward, as after a skipped
step): then nothing clipped survives under DDP either, and the new gradients start over.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from typing import Sequence

import torch

from tiermem.dist.zero import ZeroLayout
from tiermem.errors import TierMemError

CHANGED = ("p.grad changed between clip_grad_norm_ (or clip_grad_value_) and {what} under "
           "distributed.grads: reduce_scatter: tiermem clipped the averaged gradient in "
           "its shares and left p.grad as each rank computed it, so a change of p.grad "
           "after the clip cannot be applied on top of it as DDP would apply it. Clip right "
           "before opt.step(), start over with opt.zero_grad() and a new backward, or wrap "
           "the model in DDP and use distributed.grads: allreduced")


class Marks:
    """Which gradient object each parameter held at a clip, and its version: tells whether
    p.grad changed since. Weak references: a gradient dropped by zero_grad() is not kept
    alive (and its id cannot come back as another gradient's)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.marks = [None if p.grad is None else (weakref.ref(p.grad), p.grad._version)
                      for p in params]

    def compare(self) -> str:
        """'same' (no gradient changed), 'new' (none the clip saw is still there: every
        one replaced or set to None) or 'edited'."""
        same = gone = True
        for p, mark in zip(self.params, self.marks):
            g = p.grad
            if mark is None:
                same = same and g is None
                continue
            ref, version = mark
            if g is not None and ref() is g:
                same = same and g._version == version
                gone = False  # a gradient the clip saw is still there, changed or not
            else:
                same = False
        return "same" if same else "new" if gone else "edited"


class AveragedClip:
    """The clip of one block (one rank's DistributedOffload in reduce_scatter mode) and the
    shares it reduced early for the coming step."""

    def __init__(self, layout: ZeroLayout) -> None:
        self.layout = layout
        self.reindex()
        # (present, marks, comm figures) of the shares reduced at a clip, until a step
        # takes them
        self.early: tuple[set[int], Marks, dict] | None = None

    def reindex(self) -> None:
        """At set-up, and after add_param_group: the new group's parameters clip too."""
        lay = self.layout
        self.index = {id(p): i for i, p in enumerate(lay.params)}
        # parameter index -> this rank's view of its piece (whose .grad the reduce fills)
        self.views = {pc.index: v for pcs, views in zip(lay.pieces, lay.views)
                      for pc, v in zip(pcs, views)}

    def held(self, p: torch.Tensor) -> bool:
        return id(p) in self.index

    def state(self) -> str:
        """What the coming operation finds: '' (no clip since the last step), or ' after a
        clip' with whether p.grad changed since. Part of the operation's agreement, so
        every rank takes the same branch."""
        if self.early is None:
            return ""
        return f" after a gradient clip (p.grad since: {self.early[1].compare()})"

    def refuse_edited(self, what: str) -> None:
        """Raise where p.grad was edited since a clip; forget a clip whose gradients are all
        gone (they start over from p.grad)."""
        if self.early is None:
            return
        seen = self.early[1].compare()
        if seen == "edited":
            raise TierMemError(CHANGED.format(what=what))
        if seen == "new":
            self.early = None
            self.layout.release_grads()

    def take(self, comm: dict) -> set[int] | None:
        """The early shares for the step (their present set), or None: the step reduces."""
        early, self.early = self.early, None
        if early is None:
            return None
        present, _, stats = early
        for k, v in stats.items():
            comm[k] += v
        return present

    def subset(self, params: list[torch.Tensor], what: str) -> tuple[list[int], str]:
        """The optimizer's parameters among `params` (indices, in the order given), and a
        digest of them every rank must agree on."""
        outside = [p for p in params if id(p) not in self.index and p.grad is not None]
        if outside:
            raise TierMemError(
                f"{what} over parameters of the tiermem-offloaded optimizer and "
                f"{len(outside)} others with gradients in p.grad (the first of shape "
                f"{tuple(outside[0].shape)}): under distributed.grads: reduce_scatter "
                "tiermem clips the optimizer's averaged gradients, which it reduces; one "
                "norm over those and local gradients is not supported. Clip the "
                "optimizer's parameters only, or wrap the model in DDP and use "
                "distributed.grads: allreduced")
        order: list[int] = []
        for p in params:
            i = self.index.get(id(p))
            if i is not None and i not in order:
                order.append(i)
        digest = hashlib.sha1(repr(order).encode()).hexdigest()[:8]
        return order, f"over {len(order)} of the optimizer's parameters (set {digest})"

    def reduce(self, comm: dict) -> set[int]:
        """The averaged gradients in this rank's shares (once per step), their present set."""
        if self.early is None:
            present = self.layout.present()
            self.layout.grads_in(present, comm)
            self.early = (present, Marks(self.layout.params), dict(comm))
        return self.early[0]

    def _mine(self, order: list[int], present: set[int]) -> list[tuple[int, torch.Tensor]]:
        """(parameter index, this rank's piece of its averaged gradient) for the parameters
        of `order` that have one, in `order`."""
        views = self.views
        return [(i, views[i].grad) for i in order if i in present and i in views
                and views[i].grad is not None]

    def clip_norm(self, order: list[int], present: set[int], max_norm: float,
                  norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """torch's clip_grad_norm_ of the averaged gradients of `order`'s parameters: the
        total norm (returned), and this rank's shares scaled by torch's coefficient."""
        mine = self._mine(order, present)
        total = self._norm(order, present, mine, norm_type, error_if_nonfinite)
        grads = [g for _, g in mine]
        if grads:
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            for dt in dict.fromkeys(g.dtype for g in grads):
                torch._foreach_mul_([g for g in grads if g.dtype == dt], coef)
        return total

    def _norm(self, order: list[int], present: set[int], mine: list[tuple[int, torch.Tensor]],
              norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """torch's total norm of the averaged gradients of `order`'s parameters (`mine`:
        this rank's pieces of them)."""
        lay, coll = self.layout, self.layout.coll
        given = [i for i in order if i in present]
        if not given:
            return torch.tensor(0.0)  # what torch returns for no gradient
        # torch stacks the norms grouped by dtype (in order of first appearance), each
        # group in the order given; a parameter cut into pieces has one slot per piece
        dtypes = list(dict.fromkeys(lay.params[i].dtype for i in given))
        slots: dict[tuple[int, int], int] = {}
        for dt in dtypes:
            for i in given:
                if lay.params[i].dtype == dt:
                    for r, _ in lay.owners(i):
                        slots[(i, r)] = len(slots)
        vec = torch.zeros(len(slots), dtype=torch.float64)
        if mine:
            norms = torch._foreach_norm([g for _, g in mine], norm_type)
            for (i, _), n in zip(mine, norms):
                vec[slots[(i, coll.rank)]] = n.double()  # exact: every float fits a double
        # each slot is one rank's, zeros elsewhere: the sum puts every norm in place exactly
        coll.wait(coll.all_reduce(vec), "summing the gradient norms of the clip")
        dt = functools.reduce(torch.promote_types, dtypes)
        total = torch.linalg.vector_norm(vec.to(dt), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(  # torch's own error, on every rank alike
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return total

    def clamp(self, order: list[int], present: set[int], value: float) -> None:
        """clip_grad_value_ on this rank's shares of `order`'s parameters."""
        grads = [g for _, g in self._mine(order, present)]
        if grads:
            torch._foreach_clamp_min_(grads, -float(value))
            torch._foreach_clamp_max_(grads, float(value))

