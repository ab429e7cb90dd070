"""Optimizer state in torch's format, to and from the partition records.

torch keeps state per parameter (`opt.state[p]`, `state_dict()`); tiermem keeps
it per partition record. These move it between the two, one record at a time,
so no more than one record is ever staged beyond the torch-format tensors.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch

from tiermem.partition import Partition
from tiermem.tiers.manager import TierManager


def jsonable(value: Any) -> Any:
    """A param-group value as JSON keeps it (a tensor lr as its number)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def torch_state_dict(opt: torch.optim.Optimizer, state: dict[torch.Tensor, dict[str, Any]]
                     ) -> dict[str, Any]:
    """torch's own state_dict() of `opt` as if `state` were its per-parameter state (the
    tiers hold the real one: opt.state itself stays empty)."""
    saved = opt.state
    try:
        opt.state = defaultdict(dict, state)
        return type(opt).state_dict(opt)
    finally:
        opt.state = saved


def scatter(tiers: TierManager, parts: Sequence[Partition], keys: dict[str, str],
            state: dict[torch.Tensor, dict[str, Any]]) -> None:
    """Write per-parameter `state` (torch's layout; `keys`: record kind -> state key) into
    every record. A kind the state lacks is zero, a master the model's weights; copy_
    casts, so bf16 moments are rounded to nearest even here."""
    for part in parts:
        with tiers.record(part, write=True) as (views, _):
            slices = {k: part.slices(k) for k in views}
            for i, s in enumerate(part.segments):
                st = state.get(s.param, {})
                for k in views:
                    src = st.get(keys[k])
                    if src is None:
                        src = s.param.detach() if k == "master" else None
                    dst = views[k][slices[k][i]]
                    if src is None:
                        dst.zero_()
                    else:
                        dst.copy_(src.reshape(-1)[s.start: s.start + s.size(k)])


def gather(tiers: TierManager, parts: Sequence[Partition], keys: dict[str, str],
           out: dict[torch.Tensor, dict[str, Any]]) -> None:
    """Copy every written record into the per-parameter tensors `out` holds (those it
    lacks are skipped; `keys`: record kind -> state key). Copies widen exactly."""
    for part in parts:
        with tiers.record(part, write=False) as (views, fresh):
            if fresh:
                continue
            slices = {k: part.slices(k) for k in views}
            for i, s in enumerate(part.segments):
                st = out.get(s.param)
                if st is None:
                    continue
                for k, src in views.items():
                    key = keys[k]
                    if key in st:
                        st[key].view(-1)[s.start: s.start + s.size(k)].copy_(
                            src[slices[k][i]])
