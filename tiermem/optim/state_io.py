"""Optimizer state in torch's format, to and from the partition records.

torch keeps state per parameter (`opt.state[p]`, `state_dict()`); tiermem keeps
it per partition record. These move it between the two, one record at a time,
so no more than one record is ever staged beyond the torch-format tensors.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.kernels.lowbit import kahan_term, segment_values, store_segment
from tiermem.partition import SCALE_KINDS, SCALE_OF, Partition, flat, flat_like
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


def refuse_unkept_keys(rule: Any, opt: torch.optim.Optimizer, entries: dict[int, Any],
                       group_of: Callable[[int], dict], name_of: Callable[[int], str],
                       where: str) -> None:
    """Refuse per-parameter state (torch's format, by parameter index) with keys the
    rule does not keep (UpdateRule.unkept_keys): torch would keep them, unused, and hand
    them back in its state_dict; dropped, they would be gone from every checkpoint after,
    silently. Called before anything changes, so a refused load leaves the optimizer as
    it was. group_of(i): the param group parameter i's state goes with; name_of(i): its
    name for the message; where: "loaded has" / "holds"."""
    for i, st in sorted(entries.items()):
        if not isinstance(st, dict) or not st:
            continue
        extra = rule.unkept_keys(group_of(i), st)
        if not extra:
            continue
        cls = type(opt).__name__
        hint = (" (max_exp_avg_sq: a checkpoint of amsgrad=True, loaded with amsgrad=False)"
                if "max_exp_avg_sq" in extra and isinstance(opt, torch.optim.Adam) else "")
        how = ("from every entry of the state_dict's 'state' before loading it"
               if where != "holds" else
               f"first (for st in opt.state.values(): st.pop({extra[0]!r}, None))")
        raise TierMemError(
            f"the optimizer {'state' if where == 'holds' else 'state_dict'} {where} state "
            f"{extra} for parameter {i} ({name_of(i)}) that {cls} with its group's settings "
            f"does not use{hint}: a plain {cls} keeps such keys unused and hands them back "
            "in its state_dict(); tiermem keeps only the state it steps, and refuses rather "
            f"than lose them. Remove them {how}, or set the setting that uses them")


def param_entries(state_dict: dict[str, Any], held: str
                  ) -> tuple[dict[int, Any], dict[Any, Any]]:
    """A state_dict's per-parameter entries by the optimizer's parameter numbers, and its
    entries under keys that are no parameter (MADGRAD's count in state['k']).

    A parameter's entry is the one under the key the saved groups list in its place, the
    n-th of them the optimizer's n-th parameter, as torch's own load maps them: torch's
    state_dict() numbers them, torch.distributed.checkpoint's set_optimizer_state_dict
    names them (looked up as numbers, nothing was found and training started over from
    step 1, silently). A number written as a string is still its parameter's.

    Refused: an empty entry for every parameter under parameter names, what
    set_optimizer_state_dict(..., flatten_optimizer_state_dict=True) makes of a tiered
    optimizer, whose state's names it reads from opt.state[p] ({} inside the block;
    `held`: where the state is instead). Loaded, every parameter's state would start over."""
    position = {k: n for n, k in enumerate(
        k for g in state_dict["param_groups"] for k in g["params"])}
    entries: dict[int, Any] = {}
    others: dict[Any, Any] = {}
    for k, st in state_dict["state"].items():
        if k in position:
            entries[position[k]] = st
        elif isinstance(k, str) and k.isdigit():
            entries[position.get(int(k), int(k))] = st
        else:
            others[k] = st
    if entries and not any(entries.values()) and any(
            isinstance(k, str) and not k.isdigit() for k in position):
        raise TierMemError(
            "optimizer.load_state_dict(): the state_dict holds an empty state for every "
            "parameter, under parameter names: torch.distributed.checkpoint's "
            "set_optimizer_state_dict with flatten_optimizer_state_dict=True takes the "
            "names of each parameter's state from opt.state[p], which is {} inside the "
            f"tiermem.offload block (the state is in {held}), so it passed none of the "
            "checkpoint's state. Call it before entering the block (the block takes the "
            "optimizer's state in), or save and load with flatten_optimizer_state_dict=False")
    return entries, others


def drop_param_state(opt: torch.optim.Optimizer) -> None:
    """Empty `opt.state` of its per-parameter entries (the tiers hold them), keeping those
    under keys that are no parameter (MADGRAD's count in state['k']): the generic rule
    carries those from step to step in `opt.state` itself."""
    for k in [k for k in opt.state if isinstance(k, torch.Tensor)]:
        del opt.state[k]


def torch_state_dict(opt: torch.optim.Optimizer, state: dict[torch.Tensor, dict[str, Any]]
                     ) -> dict[str, Any]:
    """torch's own state_dict() of `opt` as if `state` were its per-parameter state (the
    tiers hold the real one: opt.state itself keeps only entries under keys that are no
    parameter, which the state_dict keeps as they are)."""
    saved = opt.state
    try:
        opt.state = defaultdict(dict, {**{k: v for k, v in saved.items()
                                          if not isinstance(k, torch.Tensor)}, **state})
        return type(opt).state_dict(opt)
    finally:
        opt.state = saved


def _in_memory_order(t: torch.Tensor, param: torch.Tensor,
                     cache: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Loaded state tensor `t` of `param` as the 1-D run a record's segments address: in
    the parameter's memory order when `t` is one value per element, whatever `t`'s own
    layout (a channels_last weight's state saved contiguous, or the reverse); another
    shape of as many elements counts in logical order, as reshape would read it. A
    tensor of another size (a whole-parameter rule's factored statistics) is its own,
    row-major. Kept per tensor: a parameter cut into many segments copies it once."""
    if t.numel() != param.numel():
        return t.reshape(-1)
    kept = cache.get(id(t))
    if kept is None or kept[0] is not t:  # (the tensor is kept too: its id is not reused)
        shaped = t if t.shape == param.shape else t.reshape(param.shape)
        kept = cache[id(t)] = (t, flat_like(shaped, param))
    return kept[1]


def scatter(tiers: TierManager, parts: Sequence[Partition], keys: dict[str, str],
            state: dict[torch.Tensor, dict[str, Any]]) -> None:
    """Write per-parameter `state` (torch's layout; `keys`: record kind -> state key) into
    every record. A kind the state lacks is zero, a master the model's weights; copy_
    casts, so bf16 moments are rounded to nearest even here, and int8 moments are
    quantised (to nearest) with their scales. A Kahan term is what the fp32 master
    (keys["master"]) adds to the model's bf16 weight, rounded to nearest; a record's copy
    of the bf16 weights (kind "weight") is the model's weights."""
    flats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for part in parts:
        with tiers.record(part, write=True) as (views, _):
            slices = {k: part.slices(k) for k in views}
            for i, s in enumerate(part.segments):
                st = state.get(s.param, {})
                for k in views:
                    if k in SCALE_KINDS:
                        continue  # written with its moment
                    dst = views[k][slices[k][i]]
                    if k == "weight":  # the record's copy of the model's bf16 weights
                        dst.copy_(flat(s.param.detach())[s.start: s.start + s.length])
                        continue
                    if k == "kahan":
                        src = st.get(keys["master"])
                        at = slice(s.start, s.start + s.length)
                        dst.zero_() if src is None else dst.copy_(kahan_term(
                            _in_memory_order(src, s.param, flats)[at].float(),
                            flat(s.param.detach())[at]))
                        continue
                    src = st.get(keys[k])
                    if src is None:
                        src = s.param.detach() if k == "master" else None
                    if SCALE_OF.get(k) in views:  # int8 codes
                        if src is None:
                            dst.zero_()
                            views[SCALE_OF[k]][slices[SCALE_OF[k]][i]].zero_()
                        else:
                            store_segment(views, slices, k, i,
                                          _in_memory_order(src, s.param, flats)[
                                              s.start: s.start + s.length].cpu())
                    elif src is None:
                        dst.zero_()
                    else:
                        dst.copy_(_in_memory_order(src, s.param, flats)[
                            s.start: s.start + s.size(k)])


def gather(tiers: TierManager, parts: Sequence[Partition], keys: dict[str, str],
           out: dict[torch.Tensor, dict[str, Any]]) -> None:
    """Copy every written record into the per-parameter tensors `out` holds (those it
    lacks are skipped; `keys`: record kind -> state key). Copies widen exactly; int8
    moments are dequantised (exactly: code value * scale); a Kahan term is added to the
    master (keys["master"], the model's weight as exported) in fp32, as the update
    computes the weight."""
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
                    if k in SCALE_KINDS or k == "weight":
                        continue  # scales: read with their moment; weight: the model's own
                    if k == "kahan":
                        if keys["master"] in st:
                            w = flat(st[keys["master"]])[s.start: s.start + s.length]
                            w.copy_(w.float() + src[slices[k][i]].float())
                        continue
                    key = keys[k]
                    if key not in st:
                        continue
                    value = segment_values(views, slices, k, i)  # int8 codes: dequantised
                    flat(st[key])[s.start: s.start + s.size(k)].copy_(value)
