"""ZeRO-style sharding of replicated parameters: what each rank updates and what moves.

Every rank holds the whole model; shard.py gives each rank a share of every param
group. One step:
1. gradients: reduce-scatter, window by window (`distributed.bucket_size` per rank,
   two windows in flight), sums every rank's gradient and leaves this rank's share
   in a flat buffer, which is then divided by the world size (the mean, as DDP
   takes it). With `grads: allreduced` the gradients are already averaged (DDP)
   and the share is read in place from `param.grad`: no communication;
2. the share is updated by an ordinary OffloadedOptimizer whose parameters are
   1-D views of the pieces (so the update writes the model's weights in place);
3. weights: all-gather, window by window, every rank's updated pieces into every
   rank's parameters; each window is launched as soon as this rank's partitions
   covering it are updated, while the update goes on (gather.py).
Collectives need equal sizes on every rank, so every window is padded to the widest
share; the padding is never read.

Rules whose math spans a whole parameter (Adafactor, Muon) get shares cut between
parameters (`whole`): a rank's pieces are whole parameters, which the shadow optimizer
steps in their own shapes, and their state (in the rule's own shapes: Adafactor's row and
column statistics) moves whole, from its one owner (gather_whole).
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from tiermem.dist.collectives import Collectives
from tiermem.errors import TierMemError
from tiermem.dist.gather import WeightGather
from tiermem.partition import Partition
from tiermem.dist.shard import GroupShares, Piece, share_cuts, spans


class ZeroLayout:
    """This rank's pieces of replicated parameters, and the collectives of a step."""

    fsdp = False

    def __init__(self, opt: torch.optim.Optimizer, coll: Collectives, grads: str,
                 bucket_bytes: int, whole: bool = False) -> None:
        self.coll = coll
        self.grads_mode = grads
        self.whole = whole
        self.bucket_bytes = bucket_bytes
        self.params: list[torch.Tensor] = []
        self.group_sizes: list[int] = []  # parameters per param group
        self.shares: list[GroupShares] = []
        self.dtypes: list[torch.dtype] = []
        self.pieces: list[list[Piece]] = []
        # The views the shadow optimizer updates: slices of the model's own storage (whole
        # parameters in their own shapes, for a rule whose math needs the shape).
        self.views: list[list[torch.Tensor]] = []
        self.share_elements = 0
        # parameter index -> its piece's place among the shadow optimizer's parameters
        self.shadow_index: dict[int, int] = {}
        # This rank's averaged gradient share per group, padded to the widest share (the
        # reduce-scatter writes whole windows); allocated at the first reduce-scatter.
        self._share_grad: list[torch.Tensor | None] = []
        self.windows: list[tuple[int, int, int]] = []  # (group, a, b) share offsets
        self._staging: dict[tuple[torch.dtype, int, str], torch.Tensor] = {}
        for group in opt.param_groups:
            self.add_group(group)

    def add_group(self, group: dict) -> None:
        """Cut one more param group (the optimizer's next) into the ranks' shares. A group's
        cut depends on its own parameters only (share_cuts), so the groups before keep
        theirs: every rank adding the same group gets the split all the others do."""
        g, params = len(self.shares), list(group["params"])
        kinds = {p.dtype for p in params}
        if len(kinds) > 1:
            raise TierMemError(
                f"param_groups[{g}] mixes dtypes ({sorted(map(str, kinds))}); under a "
                "process group tiermem communicates a group's gradients in one dtype: put "
                "parameters of different dtypes in different param groups")
        dtype = next(iter(kinds), torch.float32)
        numels = [p.numel() for p in params]
        share = GroupShares(g, len(self.params), numels,
                            share_cuts(numels, self.coll.world, self.whole))
        me = self.coll.rank
        self.params += params
        self.group_sizes.append(len(params))
        self.shares.append(share)
        self.dtypes.append(dtype)
        pieces = share.pieces(me)
        self.shadow_index.update({pc.index: len(self.shadow_index) + k
                                  for k, pc in enumerate(pieces)})
        self.pieces.append(pieces)
        self.views.append([self.params[pc.index].detach() if self.whole else
                           self.params[pc.index].detach().view(-1)[pc.start: pc.start +
                                                                   pc.length]
                           for pc in pieces])
        self.share_elements += share.size(me)
        self._share_grad.append(None)
        width = max(1, self.bucket_bytes // torch.empty((), dtype=dtype).element_size())
        self.windows += [(g, a, min(a + width, share.widest))
                         for a in range(0, share.widest, width)]

    def pop_group(self) -> None:
        """Undo the last add_group (a group the shadow optimizer refused)."""
        share = self.shares.pop()
        for pc in self.pieces.pop():
            del self.shadow_index[pc.index]
        del self.params[share.first_index:]
        self.group_sizes.pop()
        self.dtypes.pop()
        self.views.pop()
        self.share_elements -= share.size(self.coll.rank)
        self._share_grad.pop()
        self.windows = [w for w in self.windows if w[0] != share.group]

    # -- helpers ---------------------------------------------------------------------

    def owners(self, index: int) -> list[tuple[int, Piece]]:
        """(rank, piece) of every piece of parameter `index`, in rank order."""
        g = next(s for s in self.shares
                 if s.first_index <= index < s.first_index + len(s.numels))
        return [(r, pc) for r in range(self.coll.world) for pc in g.pieces(r)
                if pc.index == index]

    def _buffer(self, dtype: torch.dtype, slot: int, kind: str, n: int) -> torch.Tensor:
        """Staging for window collectives, kept between steps (a few slots: some in flight
        while another is packed or unpacked; the callers say when a slot is free)."""
        key = (dtype, slot, kind)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self._staging[key] = buf
        return buf[:n]

    def _flat(self, index: int) -> torch.Tensor:
        return self.params[index].detach().view(-1)

    # -- gradients in ------------------------------------------------------------------

    def present(self) -> set[int]:
        """Parameters with a gradient on any rank (the others treated as zero); with
        allreduced grads, on this rank (DDP gives every rank the same set)."""
        local = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32)
        if self.grads_mode == "reduce_scatter" and len(local):
            self.coll.wait(self.coll.all_reduce(local, torch.distributed.ReduceOp.MAX),
                           "agreeing on which parameters have gradients")
        return {i for i, v in enumerate(local.tolist()) if v}

    def grads_signature(self) -> str:
        """Which parameters have a gradient on this rank, as text two ranks can compare."""
        flags = bytes(p.grad is not None for p in self.params)
        return (f" with gradients on {sum(flags)} of {len(flags)} parameters (set "
                f"{hashlib.sha1(flags).hexdigest()[:8]})")

    def grads_in(self, present: set[int], stats: dict) -> None:
        """Give every view its averaged gradient (None when no rank has one)."""
        if self.grads_mode == "allreduced" or self.coll.world == 1:  # nothing to average
            for pcs, views in zip(self.pieces, self.views):
                for pc, v in zip(pcs, views):
                    g = self.params[pc.index].grad
                    v.grad = (None if g is None else
                              g.reshape(-1)[pc.start: pc.start + pc.length].view(v.shape))
            return
        world, me = self.coll.world, self.coll.rank
        inflight: deque = deque()
        for j, (g, a, b) in enumerate(self.windows):
            n = b - a
            if len(inflight) == 2:  # the window that used this staging slot must be done
                self._wait_timed(inflight.popleft(), "the gradient reduce-scatter", stats)
            send = self._buffer(self.dtypes[g], j % 2, "send", world * n)
            shares = self.shares[g]
            for r in range(world):
                slot = send[r * n: (r + 1) * n]
                # Past the end of a shorter share the slot is padding: summed but never read.
                for index, start, length, o in spans(shares.pieces(r), a, b):
                    grad = self.params[index].grad
                    if grad is None:
                        slot[o: o + length].zero_()
                    else:
                        slot[o: o + length].copy_(grad.reshape(-1)[start: start + length])
            if self._share_grad[g] is None:
                self._share_grad[g] = torch.empty(shares.widest, dtype=self.dtypes[g])
            inflight.append(self.coll.reduce_scatter(self._share_grad[g][a:b], send))
            stats["comm_bytes"] += send.numel() * send.element_size()
        while inflight:
            self._wait_timed(inflight.popleft(), "the gradient reduce-scatter", stats)
        for g, (pcs, views) in enumerate(zip(self.pieces, self.views)):
            if not pcs:
                continue
            share = self._share_grad[g][: self.shares[g].size(me)]
            share.div_(world)  # the sum -> the mean over ranks, as DDP averages
            for pc, v in zip(pcs, views):
                v.grad = (share[pc.offset: pc.offset + pc.length].view(v.shape)
                          if pc.index in present else None)

    def release_grads(self) -> None:
        for views in self.views:
            for v in views:
                v.grad = None

    # -- weights out -------------------------------------------------------------------

    def covers(self, parts: Sequence[Partition]) -> dict[int, list[int]]:
        """partition id -> the weight windows it has elements in. A partition's segments are
        slices of the shadow's parameters (this rank's pieces, in the shadow's order)."""
        shadow = [(g, pc) for g, pcs in enumerate(self.pieces) for pc in pcs]
        out: dict[int, list[int]] = {}
        for part in parts:
            hit = set()
            for seg in part.segments:
                g, pc = shadow[seg.index]
                lo = pc.offset + seg.start
                hi = lo + seg.length
                hit.update(w for w, (wg, a, b) in enumerate(self.windows)
                           if wg == g and a < hi and lo < b)
            out[part.id] = sorted(hit)
        return out

    def start_weights(self, covers: dict[int, list[int]], active: Sequence[Partition],
                      backwards: bool, stats: dict,
                      synced: Callable[[int, int, int], None] | None = None) -> WeightGather:
        """The weight all-gather of a step whose `active` partitions are about to be updated:
        call its updated(part) after each, then finish(). `synced`: WeightGather's."""
        return WeightGather(self, covers, active, backwards, stats, synced)

    def weights_out(self, stats: dict,
                    synced: Callable[[int, int, int], None] | None = None) -> None:
        """Every rank's current pieces into every rank's parameters, all at once."""
        if self.coll.world == 1:
            return  # the only share was updated in place
        self.start_weights({}, [], False, stats, synced).finish()

    def _wait_timed(self, work: Any, what: str, stats: dict) -> None:
        t0 = time.monotonic()
        self.coll.wait(work, what)
        stats["comm_wait_seconds"] += time.monotonic() - t0

    # -- state between the shares and torch's per-parameter layout ------------------------

    def piece_of(self, t: torch.Tensor, pc: Piece) -> torch.Tensor:
        """The elements of piece `pc` in a whole-parameter tensor `t` (all of it, in its own
        shape, when pieces are whole parameters)."""
        return t if self.whole else t.reshape(-1)[pc.start: pc.start + pc.length]

    def gather_whole(self, shadow: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Whole-parameter state when pieces are whole parameters (collective: every rank
        calls it with the state of the parameters it owns, `shadow`: param index -> torch's
        entry). Each parameter has one owner, which holds its whole entry in the rule's own
        shapes; every rank gets every entry. One parameter's entry in flight at a time."""
        # only the owner offers a parameter's entry (none: never stepped, as torch keeps none)
        return self.coll.from_lowest(shadow, len(self.params), "gathering the optimizer state")

    def gather_state(self, shadow: dict[int, dict[str, Any]], kinds_of: Sequence[Sequence[str]],
                     scalars_of: Sequence[Sequence[str]], *, model_dtype: bool,
                     has_step: bool = True) -> dict[int, dict[str, Any]]:
        """Whole-parameter state from every rank's pieces (collective: every rank calls it
        with its own pieces' state, `shadow`: param index -> {step, scalars, kind: flat
        tensor}).

        kinds_of[i]: the state tensors parameter i has on its owners (one value per
        element); scalars_of[i]: its other per-parameter values (ASGD's eta); model_dtype:
        moments in the parameter's dtype (else fp32), as OffloadedOptimizer.export_state;
        has_step: torch keeps the count in the state. A parameter whose owners export no
        entry (never stepped, and holding no state: OffloadedOptimizer.has_state) has none.
        Every rank ends up with the whole state; one all-gather per parameter and kind, so
        at most one parameter's state is in flight."""
        steps = self.coll.agreed_steps(len(self.params), shadow, "gathering the optimizer state")
        scalars = self.coll.agreed_scalars(scalars_of, shadow, "gathering the optimizer state")
        out: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(self.params):
            if steps[i] < 0:
                continue  # no entry on any rank: torch keeps no state for it either
            owners = self.owners(i)
            width = max(pc.length for _, pc in owners)
            st: dict[str, Any] = {"step": torch.tensor(float(steps[i]))} if has_step else {}
            st.update(scalars[i])
            for kind in kinds_of[i]:
                mine = shadow.get(i, {}).get(kind)
                dtype = p.dtype if model_dtype and kind != "master_param" else torch.float32
                send = torch.zeros(width, dtype=dtype)
                if mine is not None:
                    send[: mine.numel()].copy_(mine.reshape(-1))
                recv = torch.empty(width * self.coll.world, dtype=dtype)
                self.coll.wait(self.coll.all_gather(recv, send), "gathering the optimizer state")
                whole = torch.empty(p.numel(), dtype=dtype)
                for r, pc in owners:
                    whole[pc.start: pc.start + pc.length].copy_(recv[r * width: r * width +
                                                                     pc.length])
                st[kind] = whole.view(p.shape)
            if st:  # SGD without momentum keeps nothing
                out[i] = st
        return out
