"""Whole-parameter rules (torch's Adafactor and Muon, the generic path) over FSDP2
(fully_shard) parameters.

Adafactor's row and column statistics and Muon's Newton-Schulz orthogonalisation need the
whole parameter, and so does the generic path (rules/generic.py: a third-party optimizer's
own step(), which may take a norm of a whole parameter, as Lamb's trust ratio does);
under FSDP2 each rank holds a dim-0 shard of every one. So, as
distributed Muon does it (Moonlight, torchtitan), every parameter gets one owner rank
(the bytes balanced, largest first). The owner keeps the whole parameter in a buffer of
its own: that buffer is what its shadow optimizer steps and tiers, as whole parameters in
one process (the state in the rule's own shapes). One step:
1. every parameter's weights and gradient shards (FSDP2 reduce-scattered the gradients
   already) are gathered to its owner, one parameter at a time; gathered weights that
   differ from the buffer are a change made between steps (a load, an edit) and are
   taken, as one process takes its weights as they are;
2. the owner's tiered step updates its buffers;
3. each stepped parameter's updated weights are scattered back into every rank's local
   shard, one at a time.
So the memory beyond FSDP2's own is the owned parameters' whole weights (about 1/world
of the model, kept) and, during a step, their gathered gradients, plus one parameter's
padded shards in flight.

A param group added inside the block (optimizer.add_param_group) is laid out as at
set-up, which is a collective (the shard spans, the weights to their owners): every rank
adds it together (DistributedOffload._add_together checks that they add the same group).

State goes out in the form FSDP2's optimizers keep: DTensors sharded like their
parameter (Shard(0)) where the state has the parameter's rows (Muon's momentum buffer,
Adafactor's row statistics and its unfactored variance), replicated where it does not
(Adafactor's column statistics of a matrix, a reduction over dim 0). torch's own
Adafactor does not run on DTensors (its norm of a sharded gradient), so there is no form
of torch's to follow beyond that.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from tiermem.dist.collectives import Collectives
from tiermem.dist.fsdp import FsdpLayout
from tiermem.dist.shard import Piece
from tiermem.errors import TierMemError


class FsdpWholeLayout:
    """Owners of whole DTensor parameters, and the gathers and scatters of a step."""

    fsdp = True
    grads_mode = "fsdp"
    whole = True

    def __init__(self, opt: torch.optim.Optimizer, coll: Collectives) -> None:
        self.coll = coll
        self.params: list[torch.Tensor] = []
        self.pieces: list[list[Piece]] = []
        self.views: list[list[torch.Tensor]] = []  # this rank's whole buffers, by group
        self.group_sizes: list[int] = []
        self.share_elements = 0
        self.owner: list[int] = []
        # per parameter, per rank: (first element, elements) of that rank's local shard
        self.spans: list[list[tuple[int, int]]] = []
        self.buffer: dict[int, torch.Tensor] = {}  # param index -> whole buffer (owner)
        self._load = [0] * coll.world  # bytes owned by each rank
        self._stepped: list[int] = []
        for group in opt.param_groups:
            self.check_group(group)
            self.add_group(group)

    def check_group(self, group: dict) -> None:
        """Refuse a group (the optimizer's next) add_group cannot take, before any collective:
        every rank holds the same group, so all refuse alike."""
        g = len(self.pieces)
        for p in group["params"]:
            FsdpLayout._start(p, g)
        mine = [self.coll.global_rank(r) for r in range(self.coll.world)]
        for p in group["params"]:
            ranks = dist.get_process_group_ranks(p.device_mesh.get_group())
            if sorted(ranks) != sorted(mine):
                raise TierMemError(
                    f"param_groups[{g}]: a parameter sharded over ranks {ranks}, where "
                    f"tiermem's process group holds ranks {mine}: pass the FSDP2 mesh's "
                    "group as process_group=")

    def add_group(self, group: dict) -> None:
        """One more param group (the optimizer's next, check_group's already): its
        parameters' owners, and the owned ones' weights gathered into their buffers. A
        collective (every rank's shard spans, the weights to their owners): every rank adds
        the same group together, at set-up and in DistributedOffload.add_param_group. The
        owners of the groups before stay; the new group's are balanced on the bytes every
        rank already owns, as at set-up, so a run built with the group from the start
        (a resume) gives its parameters the same owners."""
        g, params = len(self.pieces), list(group["params"])
        starts = [FsdpLayout._start(p, g) for p in params]
        lengths = [p._local_tensor.numel() for p in params]
        table = self.coll.table([float(x) for x in starts + lengths],
                                "sharing the FSDP2 shard spans")
        n = len(params)
        first = len(self.params)
        pieces, views, offset = [], [], 0
        # Largest first onto the least-loaded rank (the lowest on a tie): every rank
        # computes the same owners from the same shapes.
        order = sorted(range(n), key=lambda k: (-params[k].numel() * params[k].element_size(),
                                                k))
        owners = [0] * n
        for k in order:
            r = min(range(self.coll.world), key=lambda r: (self._load[r], r))
            owners[k] = r
            self._load[r] += params[k].numel() * params[k].element_size()
        for k, p in enumerate(params):
            i = first + k
            self.params.append(p)
            self.owner.append(owners[k])
            self.spans.append([(int(row[k]), int(row[n + k])) for row in table])
            if owners[k] == self.coll.rank:
                buf = torch.empty(p.shape, **self._on(i))
                self.buffer[i] = buf
                pieces.append(Piece(i, 0, p.numel(), offset))
                views.append(buf)
                offset += p.numel()
        for i in range(first, len(self.params)):
            whole = self._gather(i, self._local(i))
            if whole is not None:
                self.buffer[i].view(-1).copy_(whole)
        self.pieces.append(pieces)
        self.views.append(views)
        self.group_sizes.append(n)
        self.share_elements += offset

    def pop_group(self) -> None:
        """Undo the last add_group (a group this rank's shadow optimizer refused)."""
        n = self.group_sizes.pop()
        first = len(self.params) - n
        for i in range(first, len(self.params)):
            p = self.params[i]
            self._load[self.owner[i]] -= p.numel() * p.element_size()
            self.buffer.pop(i, None)
        del self.params[first:], self.owner[first:], self.spans[first:]
        self.share_elements -= sum(pc.length for pc in self.pieces.pop())
        self.views.pop()

    # -- moving one parameter ---------------------------------------------------------

    def _local(self, i: int) -> torch.Tensor:
        return self.params[i]._local_tensor.detach().reshape(-1)

    def _on(self, i: int) -> dict[str, Any]:
        """Where parameter i's buffers and messages live: its shard's dtype and device."""
        local = self.params[i]._local_tensor
        return {"dtype": local.dtype, "device": local.device}

    def _width(self, i: int) -> int:
        return max(n for _, n in self.spans[i])

    def _gather(self, i: int, local: torch.Tensor | None, stats: dict | None = None
                ) -> torch.Tensor | None:
        """Parameter i's shards (`local`: this rank's, flat; None counts as zeros) put
        together on its owner, flat; None on the other ranks."""
        p, owner, me = self.params[i], self.owner[i], self.coll.rank
        width = self._width(i)
        if width == 0:
            return torch.empty(0, **self._on(i)) if owner == me else None
        send = torch.zeros(width, **self._on(i))
        if local is not None:
            send[: local.numel()].copy_(local)
        outs = ([torch.empty(width, **self._on(i)) for _ in range(self.coll.world)]
                if owner == me else None)
        self.coll.wait(self.coll.gather(send, outs, owner), "gathering a parameter to its owner")
        if stats is not None:
            stats["comm_bytes"] += width * send.element_size() * (
                self.coll.world if owner == me else 1)
        if outs is None:
            return None
        whole = torch.empty(p.numel(), **self._on(i))
        for r, (start, n) in enumerate(self.spans[i]):
            whole[start: start + n].copy_(outs[r][:n])
        return whole

    def _scatter(self, i: int, stats: dict | None = None) -> None:
        """Parameter i's whole buffer from its owner into every rank's local shard."""
        owner, me = self.owner[i], self.coll.rank
        width = self._width(i)
        if width == 0:
            return
        ins = None
        if owner == me:
            flat = self.buffer[i].view(-1)
            ins = []
            for start, n in self.spans[i]:
                t = torch.zeros(width, **self._on(i))
                t[:n].copy_(flat[start: start + n])
                ins.append(t)
        out = torch.empty(width, **self._on(i))
        self.coll.wait(self.coll.scatter(out, ins, owner), "scattering a parameter's weights")
        if stats is not None:
            stats["comm_bytes"] += width * out.element_size() * (
                self.coll.world if owner == me else 1)
        local = self.params[i]._local_tensor
        n = self.spans[i][me][1]
        if local.numel() != n:
            raise TierMemError(
                f"the FSDP2 shard of parameter {i} changed from {n} to {local.numel()} "
                "elements after tiermem.offload started; re-shard the model before entering "
                "tiermem.offload")
        with torch.no_grad():
            local.copy_(out[:n].view(local.shape))

    # -- a step ------------------------------------------------------------------------

    def present(self) -> set[int]:
        """Parameters with a gradient on any rank (FSDP2 gives all or none of a parameter's
        shards one; counted as zeros where missing, as a reduce-scatter would)."""
        local = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32)
        if len(local):
            self.coll.wait(self.coll.all_reduce(local, dist.ReduceOp.MAX),
                           "agreeing on which parameters have gradients")
        return {i for i, v in enumerate(local.tolist()) if v}

    def grads_in(self, present: set[int], stats: dict) -> None:
        self._stepped = sorted(present)
        for i, p in enumerate(self.params):
            local = self._local(i)
            if local.numel() != self.spans[i][self.coll.rank][1]:
                raise TierMemError(
                    f"the FSDP2 shard of parameter {i} changed from "
                    f"{self.spans[i][self.coll.rank][1]} to {local.numel()} elements after "
                    "tiermem.offload started; re-shard the model before entering "
                    "tiermem.offload")
            grad = None
            if i in present:
                g = p.grad
                grad = (g._local_tensor.detach().reshape(-1).to(local.dtype) if g is not None
                        else torch.zeros_like(local))
            whole = self._gather_pair(i, local, grad, stats)
            if whole is None:
                continue
            w, gw = whole
            buf = self.buffer[i]
            # a change between steps (a load into the model, an edit) is the user's weights
            if not torch.equal(buf.view(-1), w):
                buf.view(-1).copy_(w)
            if gw is not None:
                buf.grad = gw.view(buf.shape)

    def _gather_pair(self, i: int, weights: torch.Tensor, grad: torch.Tensor | None,
                     stats: dict) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """_gather of the weights, and of the gradient with them when given (each rank's
        shard of both in one message: one collective per parameter)."""
        if grad is None:
            w = self._gather(i, weights, stats)
            return None if w is None else (w, None)
        p, owner = self.params[i], self.owner[i]
        width, n = self._width(i), weights.numel()
        if width == 0:
            return (torch.empty(0, **self._on(i)),) * 2 if owner == self.coll.rank else None
        send = torch.zeros(2 * width, **self._on(i))
        send[:n].copy_(weights)
        send[width: width + n].copy_(grad)
        outs = ([torch.empty(2 * width, **self._on(i)) for _ in range(self.coll.world)]
                if owner == self.coll.rank else None)
        self.coll.wait(self.coll.gather(send, outs, owner),
                       "gathering a parameter and its gradient to its owner")
        stats["comm_bytes"] += send.numel() * send.element_size() * (
            self.coll.world if outs is not None else 1)
        if outs is None:
            return None
        w, gw = (torch.empty(p.numel(), **self._on(i)) for _ in range(2))
        for r, (start, k) in enumerate(self.spans[i]):
            w[start: start + k].copy_(outs[r][:k])
            gw[start: start + k].copy_(outs[r][width: width + k])
        return w, gw

    def weights_in(self, stats: dict) -> None:
        """Every parameter's shards into its owner's buffer, before an optimizer method
        other than step() that reads the weights (schedule-free's train()/eval()): a change
        made since the last step (a load, an edit) lives in the shards only, and the
        buffers, scattered back after the method, would undo it."""
        self.grads_in(set(), stats)

    def release_grads(self) -> None:
        for buf in self.buffer.values():
            buf.grad = None

    def covers(self, parts: Sequence[Any]) -> dict[int, list[int]]:
        return {}

    def start_weights(self, covers: dict, active: Sequence[Any], backwards: bool,
                      stats: dict, synced: Callable[[int, int, int], None] | None = None
                      ) -> "_Scatter":
        """The stepped parameters' weights back into the shards, once the whole step is
        done (one parameter at a time; the shards are not the buffers the update writes)."""
        return _Scatter(self, self._stepped, stats)

    def weights_out(self, stats: dict, synced: Any = None) -> None:
        """Every parameter's buffer into the shards (a crash-consistent resume restored the
        owners' buffers from their masters)."""
        _Scatter(self, range(len(self.params)), stats).finish()

    # -- state -------------------------------------------------------------------------

    def piece_of(self, t: torch.Tensor, pc: Piece) -> torch.Tensor:
        if isinstance(t, DTensor):  # full_entries ran first on every rank
            raise AssertionError("a DTensor entry reached piece_of")
        return t

    def full_entries(self, entries: dict[int, Any]) -> dict[int, Any]:
        """Loaded entries with their DTensors made whole (a collective over every rank's
        same entries, in one order: parameter, then key)."""
        keys = [(i, k) for i in sorted(entries) if isinstance(entries[i], dict)
                for k in sorted(entries[i]) if isinstance(entries[i][k], DTensor)]
        sig = float(int.from_bytes(hashlib.sha1(repr(keys).encode()).digest()[:6], "big"))
        if len({row[0] for row in self.coll.table([sig], "loading DTensor state")}) > 1:
            raise TierMemError(
                "the optimizer state loaded has DTensor entries for other parameters or keys "
                "on different ranks: under fully_shard every rank loads the same state_dict "
                "(each with its own shards), and the owner of each parameter needs all of "
                "them")
        out = {i: dict(st) if isinstance(st, dict) else st for i, st in entries.items()}
        for i, k in keys:
            out[i][k] = entries[i][k].full_tensor()
        return out

    def gather_whole(self, shadow: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Every parameter's entry from its owner (`shadow`: param index -> torch's entry, the
        owned ones), on every rank as DTensors like FSDP2's (see the module's doc). One
        entry in flight at a time."""
        # only the owner offers a parameter's entry (none: never stepped, as torch keeps none)
        got = self.coll.from_lowest(shadow, len(self.params), "gathering the optimizer state")
        return {i: {k: self._dtensor(i, k, v) for k, v in st.items()} for i, st in got.items()}

    def _dtensor(self, i: int, key: str, v: Any) -> Any:
        p = self.params[i]
        if not isinstance(v, torch.Tensor) or key == "step" or v.dim() == 0:
            return v
        rows_like = (v.dim() == p.dim() and v.shape[0] == p.shape[0]
                     and not (key == "col_var" and p.dim() == 2))
        if not rows_like:
            return DTensor.from_local(v, p.device_mesh, [Replicate()], run_check=False)
        start, n = self.spans[i][self.coll.rank]
        row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        row_v = math.prod(v.shape[1:]) if v.dim() > 1 else 1
        r0 = start // row if row else 0
        rows = n // row if row else p._local_tensor.shape[0]
        local = v.reshape(v.shape[0], row_v)[r0: r0 + rows].reshape(rows, *v.shape[1:]).clone()
        return DTensor.from_local(local, p.device_mesh, [Shard(0)], run_check=False,
                                  shape=v.shape, stride=v.stride())


class _Scatter:
    """What the step loop drives (as WeightGather): nothing per partition; the scatter of
    every stepped parameter at the end."""

    def __init__(self, layout: FsdpWholeLayout, indices: Any, stats: dict) -> None:
        self.layout, self.indices, self.stats = layout, list(indices), stats

    def updated(self, part: Any) -> None:
        pass

    def finish(self) -> None:
        for i in self.indices:
            self.layout._scatter(i, self.stats)
