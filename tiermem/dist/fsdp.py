"""FSDP2 parameters (DTensors from `torch.distributed.fsdp.fully_shard`): tier the local shard.

fully_shard already gives each rank a dim-0 shard of every parameter, reduce-scatters
the gradients into the shards during backward and all-gathers the weights before
the next forward. So the piece a rank tiers is simply its local shard (flattened: rows
[r0, r1) of a parameter are elements [r0 * row, r1 * row)), updated in place, and a step
moves nothing between ranks. State goes back to the optimizer as DTensors sharded like
their parameters, which is what torch's optimizer keeps under FSDP2.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tiermem.dist.collectives import Collectives
from tiermem.errors import TierMemError
from tiermem.dist.shard import Piece


def is_dtensor(t: Any) -> bool:
    return isinstance(t, DTensor)


class FsdpLayout:
    """This rank's local shards of DTensor parameters."""

    fsdp = True
    grads_mode = "fsdp"

    def __init__(self, opt: torch.optim.Optimizer, coll: Collectives) -> None:
        self.coll = coll
        self.params: list[torch.Tensor] = []
        self.pieces: list[list[Piece]] = []
        self.views: list[list[torch.Tensor]] = []
        self.share_elements = 0
        self.group_sizes: list[int] = []  # parameters per param group
        for group in opt.param_groups:
            self.add_group(group)

    def add_group(self, group: dict) -> None:
        """One more param group (the optimizer's next): its parameters' local shards."""
        g, params = len(self.pieces), list(group["params"])
        starts = [self._start(p, g) for p in params]  # refused before anything changes
        pcs, views = [], []
        for p, start in zip(params, starts):
            local = p._local_tensor  # the shard's own storage: updated in place
            if local.numel():
                pcs.append(Piece(len(self.params), start, local.numel(), 0))
                views.append(local.detach().view(-1))
            self.params.append(p)
        self.pieces.append(pcs)
        self.views.append(views)
        self.group_sizes.append(len(params))
        self.share_elements += sum(pc.length for pc in pcs)

    @staticmethod
    def _start(p: Any, g: int) -> int:
        if not is_dtensor(p):
            raise TierMemError(f"param_groups[{g}] mixes DTensor and plain parameters; "
                               "tiermem shards either all FSDP2 parameters or none")
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise TierMemError(
                f"param_groups[{g}]: a DTensor parameter placed {tuple(p.placements)} on a "
                f"{p.device_mesh.ndim}-D mesh; tiermem supports fully_shard's dim-0 shards on "
                "a 1-D mesh (HSDP and tensor parallelism are not supported yet)")
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        return offset[0] * row if p.dim() else 0

    def pop_group(self) -> None:
        """Undo the last add_group (a group the shadow optimizer refused)."""
        pcs = self.pieces.pop()
        self.views.pop()
        self.share_elements -= sum(pc.length for pc in pcs)
        del self.params[len(self.params) - self.group_sizes.pop():]

    # -- a step: FSDP moved the gradients and moves the weights ----------------------------

    def present(self) -> set[int]:
        return {i for i, p in enumerate(self.params) if p.grad is not None}

    def grads_in(self, present: set[int], stats: dict) -> None:
        self._follow_shards()
        for pcs, views in zip(self.pieces, self.views):
            for pc, v in zip(pcs, views):
                g = self.params[pc.index].grad
                v.grad = None if g is None else g._local_tensor.reshape(-1)

    def _follow_shards(self) -> None:
        """Point each view at the storage its shard lives in now. Before torch 2.11,
        fully_shard's lazy init (the model's first forward, after tiermem took its views)
        re-pads an uneven shard into new storage and swaps the parameter's local tensor; the
        update then went to the old storage while the all-gather read the new one. set_()
        keeps each view's tensor object, which the shadow optimizer, its state and the
        partitions hold."""
        for pcs, views in zip(self.pieces, self.views):
            for pc, v in zip(pcs, views):
                local = self.params[pc.index]._local_tensor
                if local.data_ptr() == v.data_ptr():
                    continue
                if local.numel() != v.numel() or not local.is_contiguous():
                    raise TierMemError(
                        f"the FSDP2 shard of parameter {pc.index} changed from {v.numel()} to "
                        f"{local.numel()} elements (or lost its layout) after tiermem.offload "
                        "started; re-shard the model before entering tiermem.offload")
                with torch.no_grad():
                    v.set_(local.untyped_storage(), local.storage_offset(), (local.numel(),))

    def release_grads(self) -> None:
        for views in self.views:
            for v in views:
                v.grad = None

    def weights_out(self, stats: dict, synced: Any = None) -> None:
        """Nothing to do: fully_shard all-gathers the updated shards before the next forward."""

    # -- state between the shards and torch's layout ---------------------------------------

    def piece_of(self, t: torch.Tensor, pc: Piece) -> torch.Tensor:
        if is_dtensor(t):
            return t.to_local().reshape(-1)
        return t.reshape(-1)[pc.start: pc.start + pc.length]

    def gather_state(self, shadow: dict[int, dict[str, Any]], kinds_of: Sequence[Sequence[str]],
                     scalars_of: Sequence[Sequence[str]], *, model_dtype: bool,
                     has_step: bool = True) -> dict[int, dict[str, Any]]:
        """State as DTensors sharded like their parameters; only the step counts and the
        per-parameter scalars are agreed on (a rank whose shard of a parameter is empty has
        no state of its own for it). Arguments as ZeroLayout.gather_state's."""
        steps = self.coll.agreed_steps(len(self.params), shadow, "agreeing on step counts")
        scalars = self.coll.agreed_scalars(scalars_of, shadow,
                                           "agreeing on per-parameter scalars")
        out: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(self.params):
            if steps[i] < 0:
                continue  # no entry on any rank
            local_shape = p._local_tensor.shape
            st: dict[str, Any] = {"step": torch.tensor(float(steps[i]))} if has_step else {}
            st.update(scalars[i])
            for kind in kinds_of[i]:
                dtype = p.dtype if model_dtype and kind != "master_param" else torch.float32
                mine = shadow.get(i, {}).get(kind)
                local = (mine.reshape(local_shape).to(dtype) if mine is not None
                         else torch.zeros(local_shape, dtype=dtype))
                st[kind] = DTensor.from_local(local, p.device_mesh, p.placements,
                                              run_check=False, shape=p.shape, stride=p.stride())
            if st:  # SGD without momentum keeps nothing
                out[i] = st
        return out
