"""`tiermem recover DIR`: a run directory's committed state as a torch checkpoint file.

Reads the manifest and the records it names straight from the swap files
(no model, optimizer or config needed), checks every record's footer, and
gathers the state into what `torch.save` writes:

    {"format": "tiermem-recover-1", "step": N, "durability": ...,
     "optimizer": <torch's state_dict of the optimizer (Adam/AdamW, or one of torch's
                   elementwise optimizers: SGD ... Rprop): fp32 state, "master_param"
                   for low-precision parameters, param_groups>,
     "model": {name: fp32 weight}}   # when the records hold every weight

"model" is there when every parameter's fp32 weight is in the records: always
with `swap.durability: crash_consistent`, for low-precision parameters only
otherwise (scratch-mode fp32 models update their weights in place, so the
weights live in the model's own checkpoint). Parameters are named as the model
named them when `model=` was given to `tiermem.offload`, else `param.<index>`.
The checkpoint is built in host memory: it needs as much RAM as the state.
int8 records (optimizer.state_dtype int8) come out as their exact fp32 values, as
state_dict() gives them. With optimizer.master_weights kahan or none a crash-consistent
record keeps the model's bf16 weights (kind "weight"): "model" holds those (in fp32,
exactly: what the model held at that step, loadable into a plain bf16 model), and the
optimizer's "master_param" what state_dict() gives, the weight plus its Kahan term
added in fp32 (the value the next step's update starts from; without kahan, the weight).
A scratch run's Kahan term is left out: its bf16 weights are the model's own checkpoint.
A parameter that is not contiguous (a channels_last conv weight; the manifest keeps its
strides) comes out, weights and state, with its strides, as torch's own state would: its
records hold it in memory order.

Runs of any other optimizer (the whole-parameter rules: Adafactor, Muon, and the generic
path's third-party optimizers) come out the same way, from the layout the manifest keeps
of each record (each kind's dtype and shape, the memory order of a column-major state
tensor, the lists and dicts the optimizer keeps its tensors in): the optimizer's own
per-parameter state as its state_dict() holds it, its entries under keys that are no
parameter (MADGRAD's state['k']), and its groups as the committed step left them. What it
keeps as attributes on itself (no state_dict() holds them) comes under
"optimizer_attributes"; one the manifest could keep only as a digest is named under
"optimizer_attributes_unkept". A value the optimizer's first step sets and no later step
changes (bitsandbytes' `initialized`, EmoNavi's state['ema'] without a closure's loss) is
not kept: the loaded optimizer's first step makes it again, as a resumed one's does.
State a tensor subclass holds (torchao's low-bit state), and a group or state value kept
only as a digest, are refused: only a resume in the optimizer's own program can make
them again.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.swap.integrity import check
from tiermem.swap.manifest import (RESIDENT_FILE, STATE_FILE, Manifest, Unkept,
                                    read_manifest, refuse_stale_paths, same_dir,
                                    scalar_from_json, value_from_json)
from tiermem.kernels.lowbit import segment_values
from tiermem.partition import (ORDER_KEY, SCALE_KINDS, Partition, Segment, flat, laid,
                               laid_out, low_weight_dtypes)

FORMAT = "tiermem-recover-1"
# Rules whose records hold one value per element of each state kind, under torch's own
# key names (optim/rules: adam, torch_family): the checkpoint follows from the manifest.
# tests/test_optimizer_recover.py keeps these in step with the rules.
ELEMENTWISE_RULES = {"AdamRule", "SGDRule", "AdagradRule", "RMSpropRule", "AdamaxRule",
                     "NAdamRule", "RAdamRule", "AdadeltaRule", "ASGDRule", "RpropRule"}
NO_STEP_RULES = {"SGDRule"}  # torch keeps no "step" count in their state
# torch builds these rules' state when the optimizer is made: kind -> the value of the
# optimizer's defaults it starts at (torch's Adagrad fills every accumulator from the
# constructor's initial_accumulator_value, whatever a group sets; manifest.defaults)
EAGER_RULES = {"AdagradRule": {"sum": "initial_accumulator_value"}}
# kinds that hold weights, not torch state: an fp32 master, the bf16 weights a record keeps
# without one (master_weights kahan/none, crash-consistent) and their Kahan term
WEIGHT_KINDS = ("master", "weight", "kahan")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TierMemError(f"manifest names an unknown parameter dtype {name!r}")
    return dtype


def _partition(entry: dict, params: list[dict]) -> Partition:
    shapes = entry.get("shapes") or [{} for _ in entry["segments"]]
    segs = [Segment(None, index, start, length, {k: tuple(v) for k, v in shaped.items()})
            for (index, start, length), shaped in zip(entry["segments"], shapes)]
    kinds = tuple(entry["kinds"])
    # an fp16 model's weights and Kahan term are fp16 in the record (one dtype a partition)
    dtypes = (low_weight_dtypes(kinds, _dtype(params[segs[0].index]["dtype"]))
              if segs and segs[0].index < len(params) else {})
    # a whole-parameter rule's kinds, in the dtypes the optimizer made them in
    dtypes.update({k: _dtype(v) for k, v in (entry.get("dtypes") or {}).items()})
    part = Partition(entry["id"], entry["group"], segs, kinds,
                     moment_dtype=_dtype(entry["moment_dtype"]), tier=entry["tier"],
                     dtypes=dtypes)
    part.layout()
    if part.record_bytes != entry["record_bytes"]:
        raise TierMemError(f"manifest partition {part.id}: record of {entry['record_bytes']} "
                           f"bytes, its layout gives {part.record_bytes}")
    return part


class _Records:
    """Reads one partition's committed record, checked against its footer."""

    def __init__(self, run_dir: str, m: Manifest) -> None:
        self.run_dir = run_dir
        self.m = m
        self.fds: dict[str, int] = {}
        self.resident = {e["id"]: e for e in m.resident}

    def _fd(self, path: str) -> int:
        if path not in self.fds:
            try:
                self.fds[path] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise TierMemError(f"cannot recover: {path}: {exc.strerror}") from None
        return self.fds[path]

    def read(self, part: Partition) -> torch.Tensor:
        pid = str(part.id)
        if part.id in self.resident:  # scratch mode, kept at exit: host/GPU-tier records
            entry = self.resident[part.id]
            path, offset, nbytes = os.path.join(self.run_dir, RESIDENT_FILE), \
                entry["offset"], entry["nbytes"]
            footer = False
        else:
            file, offset, nbytes = self.m.records[pid]
            path = self.m.files[file]
            offset += int(self.m.copies.get(pid, 0)) * nbytes
            footer = self.m.checksums
        data = os.pread(self._fd(path), nbytes, offset)
        if len(data) != nbytes:
            raise TierMemError(f"cannot recover: {path} ends before the record of partition "
                               f"{part.id} ({nbytes} bytes at offset {offset}): truncated?")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if footer:
            check(buf, part.record_bytes, part.id, int(self.m.generations[pid]), path=path,
                  offset=offset)
        return buf

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def gather(run_dir: str, *others: str, swap_paths: Sequence[str] | None = None
           ) -> dict[str, Any]:
    """The checkpoint dict of the state committed in `run_dir` (see the module doc); of a
    run under torch.distributed, of every rank's directory together (`others`: the other
    ranks' directories, found beside `run_dir` when not given). swap_paths: where the
    run's swap paths are now, in its swap.paths order (see swap_files)."""
    m = read_manifest(run_dir, None)
    if m.share:
        return _gather_ranks(run_dir, m, others, swap_paths)
    if others:
        raise TierMemError(f"cannot recover: {run_dir} holds one process's run, not a rank's "
                           "share: give its directory alone")
    return _gather_one(run_dir, m, swap_paths)


def swap_files(run_dir: str, m: Manifest, swap_paths: Sequence[str] | None) -> list[str]:
    """The swap files to read the records of `run_dir`'s manifest from. files[0] is the
    one beside the manifest, wherever the directory is now; the others (more swap paths)
    are where they were written, while the directory is too. A run directory moved or
    copied since (another mount, off a failing node) has had its other paths' files moved
    with it, or what is left at their old places is no longer its state (an older copy,
    another run of the name): those are not read (with checksums off nothing would tell
    them apart) unless `swap_paths` says where the run's swap paths are now, in order,
    the first being the one `run_dir` is under."""
    name = os.path.basename(os.path.normpath(run_dir))
    if swap_paths:
        dirs = [os.path.join(os.path.abspath(p), name) for p in swap_paths]
        if len(dirs) != len(m.files):
            raise TierMemError(
                f"cannot recover {run_dir}: its run wrote {len(m.files)} swap file(s) (one "
                f"per swap path) and {len(dirs)} swap path(s) were given; give them all, in "
                "the run's swap.paths order")
        if not same_dir(dirs[0], run_dir):
            raise TierMemError(
                f"cannot recover {run_dir}: the first swap path given must be the one it is "
                f"under ({os.path.dirname(os.path.normpath(run_dir))}), not {swap_paths[0]}")
        refuse_stale_paths(dirs, m, "recover")
        return [m.files[0], *(os.path.join(d, STATE_FILE) for d in dirs[1:])]
    written = getattr(m, "written_files", m.files)
    if len(m.files) > 1 and not same_dir(os.path.dirname(written[0]), run_dir):
        raise TierMemError(
            f"cannot recover {run_dir}: it was written at {os.path.dirname(written[0])} "
            f"(moved or copied since), and its run kept swap files under other swap paths "
            f"too, written at {', '.join(written[1:])}: tiermem does not read them there "
            "(what is there now may be an older copy, or another run's). Give where the "
            "run's swap paths are now, in its swap.paths order: tiermem recover "
            f"{run_dir} --swap-paths {os.path.dirname(os.path.normpath(run_dir))} "
            f"{' '.join('<path>' for _ in written[1:])}")
    return list(m.files)


def _gather_one(run_dir: str, m: Manifest, swap_paths: Sequence[str] | None = None
                ) -> dict[str, Any]:
    m.files = swap_files(run_dir, m, swap_paths)
    if not m.params:
        raise TierMemError(f"cannot recover: the manifest in {run_dir} lists no parameters")
    if m.rule not in ELEMENTWISE_RULES:
        return _gather_whole(run_dir, m)
    has_step, eager = m.rule not in NO_STEP_RULES, m.rule in EAGER_RULES
    names = [p["name"] or f"param.{i}" for i, p in enumerate(m.params)]
    state: dict[int, dict[str, Any]] = {}
    weights: dict[int, torch.Tensor] = {}
    parts = [_partition(e, m.params) for e in m.partitions]
    kinds_of = {s.index: part.kinds for part in parts for s in part.segments}
    stateless, fresh = set(m.stateless), set(m.fresh)
    # the never-stepped parameters whose state is read from their records
    if eager and m.version >= 4:
        # A never-stepped parameter a version-4 manifest does not list as stateless holds
        # its state in its record (made in __init__ and imported at entry, loaded from a
        # state_dict or a checkpoint, made by a skipped fused step), which is what a resume
        # and the plain optimizer start from: a loaded accumulator need not be the
        # defaults' fill (a state_dict of an Adagrad made with another
        # initial_accumulator_value). Only a record never written (fresh) has none.
        unwritten = {s.index for part in parts if part.id in fresh for s in part.segments}
        unstepped = {i for i, step in enumerate(m.steps)
                     if step == 0 and i not in stateless and i not in unwritten}
    else:
        unstepped = set(m.unstepped_state)
    for i, step in enumerate(m.steps):
        if step == 0 and (i in stateless if eager else i not in unstepped):
            continue  # never stepped: torch keeps no state for it either
        shape, stride = m.params[i]["shape"], m.params[i].get("stride")
        st: dict[str, Any] = {"step": torch.tensor(float(step))} if has_step else {}
        st.update({k: scalar_from_json(v) for k, v in (m.params[i].get("scalars") or {}).items()})
        for k in kinds_of.get(i, ()):
            if k not in WEIGHT_KINDS and k not in SCALE_KINDS:
                # never stepped (Adagrad builds its state when made): torch's starting value;
                # an entry of step 0 all the same (unstepped): its record's, read below
                fill = _first_fill(run_dir, m, k, i) if step == 0 and i not in unstepped \
                    else 0.0
                st[k] = laid_out(shape, stride, fill)
        if m.params[i]["dtype"] != "float32" and (
                {"master", "weight"} & set(kinds_of.get(i, ()))):
            st["master_param"] = laid_out(shape, stride)
        if st:  # SGD without momentum keeps nothing
            state[i] = st
    for i, p in enumerate(m.params):
        if {"master", "weight"} & set(kinds_of.get(i, ())):
            weights[i] = laid_out(p["shape"], p.get("stride"))
    records = _Records(run_dir, m)
    try:
        for part in parts:
            if part.id in fresh:
                continue
            views = part.views(records.read(part))
            slices = {k: part.slices(k) for k in views}
            for n, s in enumerate(part.segments):
                fresh_state = m.steps[s.index] == 0 and s.index not in unstepped
                if fresh_state and s.index not in weights:
                    continue  # never stepped: the starting state set above
                # in record order: a "weight" kind comes before its "kahan" term
                for k in views:
                    if k in SCALE_KINDS:
                        continue
                    # int8 codes: the fp32 moments torch keeps
                    value = segment_values(views, slices, k, n)
                    if k in ("master", "weight") and s.index in weights:
                        flat(weights[s.index])[s.start: s.start + s.length].copy_(value)
                    if fresh_state:
                        continue
                    st = state.get(s.index, {})
                    if k == "kahan":
                        if "master_param" in st:  # weight + term, in fp32, as the update
                            w = flat(st["master_param"])[s.start: s.start + s.length]
                            w.copy_(w + value.float())
                        continue
                    key = "master_param" if k in ("master", "weight") else k
                    if key in st:
                        flat(st[key])[s.start: s.start + s.length].copy_(value)
    finally:
        records.close()
    for i, st in state.items():
        if "master_param" in st and m.steps[i] == 0 and i in weights:
            st["master_param"] = weights[i].clone()  # never stepped: the weights as they are
    groups = _groups(m)
    out: dict[str, Any] = {"format": FORMAT, "step": m.step, "durability": m.durability,
                           "optimizer": {"state": state, "param_groups": groups}}
    _model_weights(out, weights, parts, names)
    return out


def _first_fill(run_dir: str, m: Manifest, kind: str, i: int) -> float:
    """The value torch starts state `kind` of never-stepped parameter i at: its optimizer's
    defaults' (manifest.defaults), which a version-3 manifest does not keep."""
    key = EAGER_RULES.get(m.rule, {}).get(kind)
    if key is None:
        return 0.0
    if m.version < 4:
        raise TierMemError(
            f"cannot recover {run_dir}: parameter {i} ({m.params[i]['name'] or 'unnamed'}) "
            f"never stepped, and torch starts its {kind!r} at the optimizer's default "
            f"{key}, which this manifest (version {m.version}, an earlier tiermem's) does "
            "not keep (a group's own value is not it); resume the run with "
            "tiermem.offload(..., resume=True) in its own program and save "
            "optimizer.state_dict()")
    value = m.defaults.get(key)
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
        raise TierMemError(f"cannot recover {run_dir}: the manifest's defaults.{key} is "
                           f"{value!r}, not the number {m.rule}'s never-stepped state starts "
                           "at")
    return float(value)


def _model_weights(out: dict[str, Any], weights: dict[int, torch.Tensor],
                   parts: list[Partition], names: list[str]) -> None:
    """out["model"]: the weights the records keep, when they keep every laid-out
    parameter's. A parameter frozen when the block opened has no record (it never changed:
    the model has it as it was) and is not in it."""
    laid = {s.index for part in parts for s in part.segments}
    if weights and set(weights) == laid:
        out["model"] = {names[i]: weights[i] for i in sorted(weights)}


def _groups(m: Manifest) -> list[dict]:
    """The manifest's param groups as torch's state_dict holds them: JSON kept every
    tuple (Adam's betas, Rprop's etas and step_sizes, Adafactor's eps) as a list, and
    torch's optimizers hold no list hyperparameter, so each list is a tuple again."""
    return [{k: tuple(v) if isinstance(v, list) and k != "params" else v
             for k, v in g.items()} for g in m.groups]


def _refuse_unkept(run_dir: str, what: str, value: Any) -> Any:
    if isinstance(value, Unkept):
        raise TierMemError(
            f"cannot recover {run_dir}: the optimizer's {what} was {value.text} at the "
            "committed step, which the manifest could keep only as a digest; resume the run "
            "with tiermem.offload(..., resume=True) in the optimizer's own program and save "
            "optimizer.state_dict()")
    return value


def _rebuild(t: dict, tensors: dict[str, torch.Tensor], run_dir: str, what: str) -> Any:
    """The list, tuple or dict a template (manifest.template_json) describes, around the
    record's tensors (each taken out of `tensors`)."""
    (kind, body), = t.items()
    if kind == "leaf":
        return tensors.pop(body)
    if kind == "subclass":
        raise TierMemError(
            f"cannot recover {run_dir}: the optimizer keeps {what} as a {body}, a tensor "
            "subclass that only its own program can make again; resume the run with "
            "tiermem.offload(..., resume=True) there and save optimizer.state_dict()")
    if kind == "dict":
        return {key: _rebuild(child, tensors, run_dir, what) for key, child in body}
    items = [_rebuild(child, tensors, run_dir, what) for child in body]
    return items if kind == "list" else tuple(items)


def _orders(kept: Any, part: Partition, seg: Segment, shape: tuple[int, ...], run_dir: str,
            i: int) -> dict[str, tuple[int, ...]]:
    """A parameter's ORDER_KEY scalar, checked: each entry a kind of its record and a
    permutation of that kind's dims."""
    out = {}
    for entry in kept if isinstance(kept, list) else [kept]:
        ok = isinstance(entry, list) and len(entry) == 2 and entry[0] in part.kinds
        if ok:
            k, order = entry
            dims = len(seg.shapes.get(k, shape))
            ok = (isinstance(order, list) and all(type(d) is int for d in order)
                  and sorted(order) == list(range(dims)))
        if not ok:
            raise TierMemError(
                f"cannot recover {run_dir}: the manifest's params[{i}].scalars.{ORDER_KEY} "
                f"holds {entry!r}, not a kind of its record with an order of its dims")
        out[k] = tuple(order)
    return out


def _gather_whole(run_dir: str, m: Manifest) -> dict[str, Any]:
    """gather() for a whole-parameter rule's run: each parameter's state is the record's
    kinds in the shapes, dtypes, memory order and containers the manifest gives, beside
    its scalars; its fp32 master (crash-consistent runs) is its weight."""
    names = [p["name"] or f"param.{i}" for i, p in enumerate(m.params)]
    parts = [_partition(e, m.params) for e in m.partitions]
    state: dict[Any, dict[str, Any]] = {}
    weights: dict[int, torch.Tensor] = {}
    fresh = set(m.fresh)
    records = _Records(run_dir, m)
    try:
        for part, entry in zip(parts, m.partitions):
            if part.id in fresh:
                continue  # never written: its parameters never stepped
            views = part.views(records.read(part))
            slices = {k: part.slices(k) for k in views}
            nested = entry.get("nested") or [{} for _ in part.segments]
            for n, s in enumerate(part.segments):
                i, shape = s.index, tuple(m.params[s.index]["shape"])
                if "master" in views:
                    weights[i] = views["master"][slices["master"][n]].clone().view(shape)
                if m.steps[i] == 0:
                    continue  # never stepped: torch keeps no state for it either
                st = {k: scalar_from_json(v)
                      for k, v in (m.params[i].get("scalars") or {}).items()}
                orders = _orders(st.pop(ORDER_KEY, []), part, s, shape, run_dir, i)
                tensors = {k: laid(views[k][slices[k][n]].clone(), s.shapes.get(k, shape),
                                   orders.get(k))
                           for k in part.kinds if k != "master"}
                for key, t in nested[n].items():
                    st[key] = _rebuild(t, tensors, run_dir,
                                       f"state {key!r} of {names[i]}")
                st.update(tensors)
                if "master" in views and m.params[i]["dtype"] != "float32":
                    st["master_param"] = weights[i].clone()
                state[i] = st
    finally:
        records.close()
    values = m.values or {}
    for key, v in values.get("state", {}).items():  # entries under keys that are no parameter
        state[key] = _refuse_unkept(run_dir, f"state[{key!r}]", value_from_json(v))
    groups = _groups(m)
    for g, kept in values.get("groups", {}).items():
        for k, v in kept.items():  # exact, where the groups above hold JSON's form
            groups[int(g)][k] = _refuse_unkept(run_dir, f"param_groups[{g}][{k!r}]",
                                               value_from_json(v))
    own = {k: value_from_json(v) for k, v in values.get("own", {}).items()}
    out: dict[str, Any] = {"format": FORMAT, "step": m.step, "durability": m.durability,
                           "optimizer": {"state": state, "param_groups": groups},
                           "optimizer_attributes": {k: v for k, v in own.items()
                                                    if not isinstance(v, Unkept)}}
    unkept = sorted(k for k, v in own.items() if isinstance(v, Unkept))
    if unkept:
        out["optimizer_attributes_unkept"] = unkept
    _model_weights(out, weights, parts, names)
    return out


_RANK_DIR = re.compile(r"(.*)-rank(\d+)\Z")


def run_name(run_dir: str) -> str:
    """The run's directory name; of a rank's directory (<name>-rank<r>), the whole run's."""
    base = os.path.basename(os.path.normpath(run_dir))
    hit = _RANK_DIR.match(base)
    return hit.group(1) if hit else base


def _rank_manifests(run_dir: str, m: Manifest, others: tuple[str, ...]
                    ) -> list[tuple[str, Manifest]]:
    """Every rank's (directory, manifest) of a run under torch.distributed, in group rank
    order, at one committed step (ranks one crash-consistent step apart go back to the
    lower one, as a resume does)."""
    share = m.share
    if others:
        dirs = [run_dir, *others]
    else:
        hit = _RANK_DIR.match(os.path.basename(os.path.normpath(run_dir)))
        if hit is None:
            raise TierMemError(f"cannot recover: {run_dir} holds rank {share['rank']}'s share "
                               "of a distributed run, and its name does not say where the "
                               "others are: give every rank's directory")
        parent = os.path.dirname(os.path.normpath(run_dir))
        dirs = [os.path.join(parent, f"{hit.group(1)}-rank{g}") for g in share["ranks"]]
        missing = [g for g, d in zip(share["ranks"], dirs) if not os.path.isdir(d)]
        if missing:
            raise TierMemError(
                f"cannot recover: {run_dir} holds one rank's share of a run over "
                f"{share['world']} ranks, and the directories of ranks {missing} are not "
                f"beside it in {parent} (swap paths per rank?): give every rank's directory")
    kept: dict[int, tuple[str, Manifest]] = {}
    for d in dirs:
        md = m if d == run_dir else read_manifest(d, None)
        sh = md.share
        same = bool(sh) and all(sh.get(k) == share[k] for k in
                                ("world", "ranks", "params", "group_params"))
        if not same or md.rule != m.rule:
            raise TierMemError(f"cannot recover: {d} is not a share of the same distributed "
                               f"run as {run_dir}")
        if sh["rank"] in kept:
            raise TierMemError(f"cannot recover: {kept[sh['rank']][0]} and {d} both hold "
                               f"rank {sh['rank']}'s share")
        kept[sh["rank"]] = (d, md)
    missing = sorted(set(range(share["world"])) - set(kept))
    if missing:
        raise TierMemError(f"cannot recover: the run has {share['world']} ranks and no "
                           f"directory was given for ranks {missing}")
    out = [kept[r] for r in range(share["world"])]
    low = min(md.step for _, md in out)
    if any(md.step != low for _, md in out):
        if max(md.step for _, md in out) - low != 1 or m.durability != "crash_consistent":
            raise TierMemError(f"cannot recover: the ranks kept different steps "
                               f"{[md.step for _, md in out]}")
        out = [(d, md if md.step == low else read_manifest(d, None, previous=True))
               for d, md in out]
        if any(md.step != low for _, md in out):
            raise TierMemError(f"cannot recover: the ranks kept different steps, and the "
                               f"commits before them are not at step {low}")
    return out


def _gather_ranks(run_dir: str, m: Manifest, others: tuple[str, ...],
                  swap_paths: Sequence[str] | None = None) -> dict[str, Any]:
    """gather() of a run under torch.distributed: each rank's pieces (elementwise state,
    one value per element) put back into the user's parameters; or, where a rank held a
    whole parameter in its own shape (a rule that steps whole parameters), its entry."""
    share = m.share
    users = share["params"]
    numels = [math.prod(p["shape"]) for p in users]
    state: dict[int, dict[str, Any]] = {}
    weights: dict[int, torch.Tensor] = {}
    with_state = [0] * len(users)
    with_weights = [0] * len(users)
    as_is: set[int] = set()  # parameters whose entry came whole from one rank
    groups: list[dict] = []
    step = 0
    for d, md in _rank_manifests(run_dir, m, others):
        ckpt = _gather_one(d, md, swap_paths)
        step, groups = md.step, ckpt["optimizer"]["param_groups"]
        names = [p["name"] or f"param.{i}" for i, p in enumerate(md.params)]
        for j, (ui, start) in enumerate(md.share["pieces"]):
            n = math.prod(md.params[j]["shape"])
            piece = ckpt.get("model", {}).get(names[j])
            if piece is not None:
                w = weights.setdefault(ui, torch.zeros(numels[ui], dtype=torch.float32))
                w[start: start + n].copy_(piece.reshape(-1))
                with_weights[ui] += n
            st = ckpt["optimizer"]["state"].get(j)
            if st is None:
                continue
            if md.params[j]["shape"] == users[ui]["shape"]:
                # the whole parameter in its own shape (a rule that steps whole parameters
                # under a process group): its entry as it is, in the rule's own shapes
                # (Adafactor's row and column statistics)
                state[ui] = dict(st)
                as_is.add(ui)
                with_state[ui] += n
                continue
            whole = state.setdefault(ui, {})
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # one value per element
                    whole.setdefault(k, torch.zeros(numels[ui], dtype=v.dtype))[
                        start: start + n].copy_(v.reshape(-1))
                elif k not in whole:
                    whole[k] = v
                elif not (torch.equal(whole[k], v) if isinstance(v, torch.Tensor)
                          else whole[k] == v):
                    raise TierMemError(f"cannot recover: the ranks' pieces of parameter {ui} "
                                       f"disagree on its {k!r} ({whole[k]} and {v})")
            with_state[ui] += n
    short = [i for i in state if with_state[i] != numels[i]]
    if short:
        raise TierMemError(f"cannot recover: the ranks' shares of parameters {short[:8]} do "
                           "not cover them (some ranks' state of them is missing)")
    for i, st in state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and i not in as_is:
                st[k] = v.view(users[i]["shape"])
    groups = [{**g, "params": list(ids)} for g, ids in zip(groups, share["group_params"])]
    out: dict[str, Any] = {"format": FORMAT, "step": step, "durability": m.durability,
                           "optimizer": {"state": state, "param_groups": groups}}
    if all(with_weights[i] == numels[i] for i in range(len(users))):
        out["model"] = {p["name"] or f"param.{i}": weights[i].view(p["shape"])
                        for i, p in enumerate(users)}
    return out


def recover(run_dir: str, out_path: str, *others: str,
            swap_paths: Sequence[str] | None = None) -> dict[str, Any]:
    """Write the checkpoint of `run_dir` (and `others`, `swap_paths`: see gather) to
    `out_path` (atomically); returns a summary."""
    ckpt = gather(run_dir, *others, swap_paths=swap_paths)
    tmp = out_path + ".tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, out_path)
    state = ckpt["optimizer"]["state"]
    return {"step": ckpt["step"], "durability": ckpt["durability"],
            "parameters": sum(len(g["params"]) for g in ckpt["optimizer"]["param_groups"]),
            "with_state": sum(isinstance(k, int) for k in state), "has_model": "model" in ckpt,
            "bytes": _nbytes(state) + _nbytes(ckpt.get("model", {})), "path": out_path,
            "attributes": sorted(ckpt.get("optimizer_attributes", {})),
            "unkept": ckpt.get("optimizer_attributes_unkept", [])}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0
