"""Distributed checkpoints (torch.distributed.checkpoint, DCP) of the tiered state, streamed.

    tiermem.dist.dcp.save(tm, "ckpt/step1000")   # every rank, inside the offload block
    tiermem.dist.dcp.load(tm, "ckpt/step1000")   # any world size: DCP reshards

What the checkpoint holds (DCP keys):
- `tiermem.state.<i>.<kind>`: the fp32 state of parameter i (its position in the
  optimizer's flattened param order), flattened to 1-D: each state tensor the optimizer
  keeps (Adam's exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad; SGD's momentum_buffer,
  Adagrad's sum, ...) and master (the fp32 master weight of a low-precision parameter,
  or of any parameter under crash_consistent). Each rank writes its
  pieces as chunks of that 1-D tensor, one chunk per partition segment; a load asks
  for its own pieces and DCP reads whatever stored chunks overlap them, so a
  checkpoint written by N ranks loads into M ranks, or one process.
  Moments kept in bf16 or int8 (optimizer.state_dtype) are saved as their exact fp32
  values and stored back in the loading run's own state dtype (int8: quantised per
  segment, as load_state_dict does), so a checkpoint also moves state between dtypes.
- `tiermem.steps`: every parameter's step count; `tiermem.scalars`: every parameter's
  per-parameter scalars besides it (ASGD's eta and mu, NAdam's mu_product), one column
  per name META lists, NaN for a parameter without them; `tiermem.meta`: JSON with each
  parameter's shape and dtype and the param groups' hyperparameters.

Runs of elementwise rules only (Adam, AdamW, torch's elementwise family): a whole-
parameter rule's state has the optimizer's own shapes and dtypes, which a resharded load
cannot cut; those are refused, naming the optimizer (save optimizer.state_dict()).

Never the whole state in RAM: save resolves DCP's write items lazily, in partition
order (a single writer thread keeps that order), reading one partition record at a
time into a copy and handing DCP one segment of one kind at a time; load fills one
partition's staging record at a time and writes it to its tier as soon as its last
piece arrived. DCP's file writer keeps a reference to every tensor it wrote until
the file is closed; the storage of each handed-out tensor is released (resized to
zero bytes) once DCP has serialised it, so those references hold no memory.
"""

from __future__ import annotations

import io
import json
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import (_create_read_items,
                                                          create_read_items_for_chunk_list)

from tiermem.dist.collectives import scalar_table
from tiermem.errors import TierMemError
from tiermem.kernels.lowbit import kahan_term, segment_values, store_segment
from tiermem.optim.rules import UnsupportedOptimizer
from tiermem.optim.state_io import jsonable
from tiermem.partition import SCALE_KINDS

FORMAT = "tiermem-dcp-1"
META, STEPS, SCALARS = "tiermem.meta", "tiermem.steps", "tiermem.scalars"


def _fqn(index: int, kind: str) -> str:
    return f"tiermem.state.{index}.{kind}"


@dataclass
class _Source:
    """What a checkpoint needs from an offload handle, one process or one rank of many."""

    off: Any  # the OffloadedOptimizer holding this process's records
    opt: torch.optim.Optimizer  # the user's optimizer
    params: list[torch.Tensor]  # the user's parameters, in optimizer order
    locate: Callable[[Any], tuple[int, int]]  # segment -> (param index, first element)
    group: Any = None  # the process group; None in one process
    coll: Any = None

    def steps(self) -> torch.Tensor:
        """Every parameter's step count (collective under a process group)."""
        out = torch.full((len(self.params),), -1.0)
        for part in self.off.parts:
            for s in part.segments:
                out[self.locate(s)[0]] = float(self.off.steps[s.index])
        if self.coll is not None and len(out):
            self.coll.wait(self.coll.all_reduce(out, torch.distributed.ReduceOp.MAX),
                           "agreeing on step counts for a checkpoint")
        return out.clamp_(min=0)

    def stateless(self) -> list[int]:
        """The parameters that hold no state (collective under a process group): those never
        stepped, and of a rule with eager state (Adagrad), only those its optimizer made
        none for (a group added after construction, an entry a loaded state_dict lacked)."""
        held = torch.zeros(len(self.params))
        for part in self.off.parts:
            for s in part.segments:
                if self.off.steps[s.index] != 0 or not self.off.fills(s.index):
                    held[self.locate(s)[0]] = 1.0
        if self.coll is not None and len(held):
            self.coll.wait(self.coll.all_reduce(held, torch.distributed.ReduceOp.MAX),
                           "agreeing on which parameters hold state for a checkpoint")
        return [i for i, h in enumerate(held.tolist()) if not h]

    def scalar_keys(self) -> list[str]:
        """The per-parameter scalar names of every group, in a fixed order."""
        keys = {k for g in self.opt.param_groups for k in self.off.rule.scalar_keys(g)}
        return sorted(keys)

    def scalars(self) -> torch.Tensor:
        """Every parameter's scalars (scalar_keys' columns; NaN where it has none), as the
        ranks holding them know them (collective under a process group)."""
        held = ((self.locate(s)[0], self.off.latest_scalars(s.index))
                for part in self.off.parts for s in part.segments)
        out = scalar_table(self.coll, self.scalar_keys(), held, len(self.params),
                           "agreeing on per-parameter scalars for a checkpoint")
        return out.masked_fill_(out == -math.inf, math.nan)


def _source(tm: Any, op: str) -> _Source:
    from tiermem.dist.sharded import DistributedOffload

    if isinstance(tm, DistributedOffload):
        _check_rule(tm.offloaded)
        tm.agree(op)  # every rank is here, not in a step (the planners' collectives follow)
        flat = [pc for pcs in tm.layout.pieces for pc in pcs]
        return _Source(tm.offloaded, tm.opt, tm.layout.params,
                       lambda s: (flat[s.index].index, flat[s.index].start + s.start),
                       tm.coll.group, tm.coll)
    off = tm.offloaded
    _check_rule(off)
    if off.overlap is not None:
        # Its worker may still be reading the next step ahead, or be half-way through a step.
        off.overlap.require_idle("a tiermem.dist.dcp checkpoint")
    return _Source(off, off.opt, off.params, lambda s: (s.index, s.start))


def _check_rule(off: Any) -> None:
    if not off.rule.elementwise:
        name = f"{type(off.opt).__module__}.{type(off.opt).__qualname__}"
        raise UnsupportedOptimizer(
            f"tiermem.dist.dcp checkpoints the state of elementwise optimizers (Adam, AdamW, "
            f"torch's elementwise family), and {name} keeps whole-parameter state in its own "
            "shapes and dtypes, which a resharded load cannot cut: save "
            "optimizer.state_dict() instead (or resume a crash-consistent run)")
    for i, p in enumerate(off.params):
        # (a one-process run tiers channels_last weights in memory order; the checkpoint's
        # 1-D tensors, and the weights this module reads by reshape, are row-major)
        if not p.is_contiguous():
            raise UnsupportedOptimizer(
                f"tiermem.dist.dcp checkpoints parameters in row-major order, and parameter "
                f"{i} (shape {tuple(p.shape)}, strides {tuple(p.stride())}) is not "
                "contiguous (channels_last?): save optimizer.state_dict() instead (or "
                "resume a crash-consistent run)")


def _saved_kinds(part: Any) -> list[str]:
    """The kinds a checkpoint holds of `part`: all but int8 scales (their moment is saved
    as its fp32 values)."""
    return [k for k in part.kinds if k not in SCALE_KINDS]


def _meta(src: _Source, stateless: list[int]) -> dict:
    groups = [{k: jsonable(v) for k, v in g.items() if k != "params"}
              for g in src.opt.param_groups]
    return {"format": FORMAT, "groups": groups, "scalar_keys": src.scalar_keys(),
            "stateless": stateless,
            "params": [{"numel": p.numel(), "shape": list(p.shape),
                        "dtype": str(p.dtype).removeprefix("torch.")} for p in src.params]}


def _chunk(fqn: str, start: int, length: int, numel: int) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn, torch.Size([start])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(torch.Size([start]), torch.Size([length])),
                         properties=TensorProperties(dtype=torch.float32),
                         size=torch.Size([numel])))


# -- save ------------------------------------------------------------------------------------


class _SavePlanner(DefaultSavePlanner):
    """Write items for this rank's partition segments, resolved lazily from the tiers."""

    def __init__(self, src: _Source) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.src = src
        self._where: dict[tuple[str, int], tuple[Any, str, int, int]] = {}
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None
        # The storage of every tensor given to DCP (alive while anyone, DCP's writer
        # included, references it), to measure what the checkpoint really holds.
        self._handed: list[weakref.ref] = []
        self._last: torch.Tensor | None = None
        self.peak_live_bytes = 0  # most bytes held at once: the record copy + handed tensors
        self.records_read = 0

    def create_local_plan(self) -> SavePlan:
        self._steps = self.src.steps()
        self._scalars = self.src.scalars()
        self._stateless = self.src.stateless()
        n = len(self.src.params)
        # Replicated on every rank: DCP keeps one copy of each.
        items = [WriteItem(index=MetadataIndex(META), type=WriteItemType.BYTE_IO),
                 WriteItem(index=MetadataIndex(STEPS, torch.Size([0])),
                           type=WriteItemType.TENSOR, tensor_data=_chunk(STEPS, 0, n, n).tensor_data)]
        if self._scalars.shape[1]:
            items.append(WriteItem(
                index=MetadataIndex(SCALARS, torch.Size([0, 0])), type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size([0, 0]), self._scalars.shape),
                    properties=TensorProperties(dtype=torch.float64),
                    size=self._scalars.shape)))
        for part in self.src.off.parts:  # partition order: one record read per partition
            for kind in _saved_kinds(part):
                off = 0
                for s in part.segments:
                    i, start = self.src.locate(s)
                    fqn = _fqn(i, kind)
                    items.append(_chunk(fqn, start, s.length, self.src.params[i].numel()))
                    self._where[(fqn, start)] = (part, kind, off, s.length)
                    off += s.length
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._last is not None:
            # DCP wrote it out (serially) before asking for the next item; its file writer
            # keeps a reference until the file closes, but needs none of the bytes.
            self._last.untyped_storage().resize_(0)
            self._last = None
        fqn = write_item.index.fqn
        if fqn == META:
            return io.BytesIO(json.dumps(_meta(self.src, self._stateless)).encode())
        if fqn == STEPS:
            return self._steps.clone()
        if fqn == SCALARS:
            return self._scalars.clone()
        part, kind, off, length = self._where[(fqn, write_item.index.offset[0])]
        views = self._record(part)
        out = views[kind][off: off + length].clone()
        self._last = out
        self._handed.append(weakref.ref(out.untyped_storage()))
        self._measure(views)
        return out

    def _record(self, part: Any) -> dict[str, torch.Tensor]:
        """A copy of `part`'s record (one at a time)."""
        if self._cache is not None and self._cache[0] == part.id:
            return self._cache[1]
        self._cache = None  # the previous partition's copy goes before the next is read

        with self.src.off.tiers.record(part, write=False) as (views, fresh):
            got = {}
            slices = {k: part.slices(k) for k in views}
            for k in _saved_kinds(part):
                # fp32 whatever the state dtype: bf16 widens exactly, int8 codes become
                # their values (code x scale), per segment as they were quantised
                got[k] = torch.zeros(part.numel, dtype=torch.float32)
                for n, sl in enumerate(slices[k] if not fresh else ()):
                    got[k][sl].copy_(segment_values(views, slices, k, n))
            if fresh and "master" in got:  # never stepped: the weights are the model's
                o = 0
                for s in part.segments:
                    got["master"][o: o + s.length].copy_(
                        s.param.detach().reshape(-1)[s.start: s.start + s.length])
                    o += s.length
            self._cache = (part.id, got)
        self.records_read += 1
        return self._cache[1]

    def _measure(self, views: dict[str, torch.Tensor]) -> None:
        handed = sum(st.nbytes() for r in self._handed if (st := r()) is not None)
        self._handed = [r for r in self._handed if r() is not None]
        live = handed + sum(v.nbytes for v in views.values())
        self.peak_live_bytes = max(self.peak_live_bytes, live)


def save(tm: Any, path: str) -> dict[str, int]:
    """Write the tiered optimizer state of `tm` (inside its offload block) to a DCP checkpoint
    directory; under a process group every rank calls it. Returns figures of this rank
    (records_read, peak_live_bytes: the most checkpoint bytes this rank held at once)."""
    src = _source(tm, "tiermem.dist.dcp.save()")
    src.off.tiers.flush()
    planner = _SavePlanner(src)
    # One writer thread: items are resolved in plan order, one at a time.
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({}, storage_writer=writer, planner=planner, process_group=src.group,
                 no_dist=src.coll is None)
    return {"records_read": planner.records_read, "peak_live_bytes": planner.peak_live_bytes}


# -- load --------------------------------------------------------------------------------


@dataclass
class _Staging:
    """A partition's record being assembled from the checkpoint."""

    views: dict[str, torch.Tensor]
    pending: int = 0


class _LoadPlanner(DefaultLoadPlanner):
    """Read items for this rank's partition segments; each partition written to its tier as
    soon as all of its pieces arrived."""

    def __init__(self, src: _Source) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.src = src
        self._dest: dict[tuple[str, int], tuple[Any, str, int]] = {}
        self._counts: dict[int, int] = {}
        self._staging: dict[int, _Staging] = {}
        self.meta: dict | None = None
        self.steps: torch.Tensor | None = None
        self.scalars: torch.Tensor | None = None  # read into (SCALARS), when saved
        self.peak_staged = 0  # most partitions assembled at once
        # part id -> {kind the record needs: the kind read for it, or None where the model's
        # weights give it}: the checkpoint of another master_weights or durability lacks
        # some of a low-precision parameter's kinds, which its others or the model make
        self._sources: dict[int, dict[str, str | None]] = {}

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        if META not in md:
            raise TierMemError("this DCP checkpoint was not written by tiermem.dist.dcp.save "
                               f"(it has no {META!r})")
        n = len(self.src.params)
        self._steps_buf = torch.zeros(n)
        items: list[ReadItem] = [*_create_read_items(META, md[META], None),
                                 *_create_read_items(STEPS, md[STEPS], self._steps_buf)]
        if SCALARS in md:
            self.scalars = torch.zeros(tuple(md[SCALARS].size), dtype=torch.float64)
            items += _create_read_items(SCALARS, md[SCALARS], self.scalars)
        for part in self.src.off.parts:
            sources = self._sources[part.id] = {}
            for kind in _saved_kinds(part):
                i = self.src.locate(part.segments[0])[0]
                read = _source_kind(kind, lambda k: _fqn(i, k) in md)
                if read is _MISSING:
                    raise TierMemError(f"the checkpoint has no {kind} for parameter {i} "
                                       "(saved with amsgrad off, loaded with it on?)")
                sources[kind] = read
                if read is None:
                    continue  # made from the model's weights when staged
                off = 0
                for s in part.segments:
                    i, start = self.src.locate(s)
                    fqn = _fqn(i, read)
                    self._dest[(fqn, start)] = (part, read, off)
                    off += s.length
                    if fqn not in md:  # another parameter of the partition, saved otherwise
                        raise TierMemError(f"the checkpoint has no {read} for parameter {i}")
                    got = create_read_items_for_chunk_list(
                        fqn, md[fqn], [ChunkStorageMetadata(torch.Size([start]),
                                                            torch.Size([s.length]))])
                    self._counts[part.id] = self._counts.get(part.id, 0) + len(got)
                    items += got
        self._fill_unread()
        self.plan = LoadPlan(items)
        return self.plan

    def _fill_unread(self) -> None:
        """Partitions with nothing to read (a master or weight only the model has): write
        them now."""
        for part in self.src.off.parts:
            if part.id not in self._counts:
                self._stage(part)
                self._write(part)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.meta = json.loads(value.read().decode())
        if self.meta.get("format") != FORMAT:
            raise TierMemError(f"checkpoint format {self.meta.get('format')!r}, this tiermem "
                               f"reads {FORMAT!r}")
        ours = [p.numel() for p in self.src.params]
        theirs = [p["numel"] for p in self.meta["params"]]
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                         min(len(ours), len(theirs)))
            raise TierMemError(f"the checkpoint has {len(theirs)} parameters and this optimizer "
                               f"{len(ours)}; they first differ at parameter {first}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        if fqn == STEPS:
            return self._steps_buf
        if fqn == SCALARS:
            return self.scalars
        start = read_item.dest_index.offset[0]
        part, kind, off = self._dest[(fqn, start)]
        st = self._staging.get(part.id) or self._stage(part)
        a = off + read_item.dest_offsets[0]
        return st.views[kind][a: a + read_item.lengths[0]]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        if fqn == STEPS:
            self.steps = self._steps_buf
            return
        if fqn == SCALARS:
            return
        part = self._dest[(fqn, read_item.dest_index.offset[0])][0]
        st = self._staging[part.id]
        st.pending -= 1
        if st.pending == 0:
            self._write(part)

    def _stage(self, part: Any) -> _Staging:
        sources = self._sources[part.id]
        views = {k: torch.zeros(part.numel, dtype=torch.float32)
                 for k in {r for r in sources.values() if r is not None}}
        for kind, read in sources.items():
            if read is None:
                views[kind] = (torch.zeros(part.numel, dtype=torch.float32) if kind == "kahan"
                               else _model_weights(part))
        st = _Staging(views, self._counts.get(part.id, 0))
        self._staging[part.id] = st
        self.peak_staged = max(self.peak_staged, len(self._staging))
        return st

    def _write(self, part: Any) -> None:
        st = self._staging.pop(part.id)

        values = {kind: _derived(kind, read, st.views, part)
                  for kind, read in self._sources.pop(part.id).items()}
        with self.src.off.tiers.record(part, write=True) as (views, _):
            slices = {k: part.slices(k) for k in views}
            for k, v in values.items():
                # per segment as load_state_dict stores it: bf16 rounded to nearest even,
                # int8 quantised to nearest with its blocks from the segment's first element
                for n, sl in enumerate(slices[k]):
                    store_segment(views, slices, k, n, v[sl])


_MISSING = object()


def _source_kind(kind: str, saved: Callable[[str], bool]) -> Any:
    """What the checkpoint gives a record's `kind` from, as load_state_dict would: the kind
    itself; a Kahan term from the fp32 master (and the master from the weight plus its
    term), as the runs of master_weights fp32 and kahan save them; a master or the
    record's copy of the weights (crash-consistent kahan/none) not saved, the model's
    weights, and a Kahan term beside neither (a master-less run's), 0 (None); else
    _MISSING."""
    if saved(kind):
        return kind
    if kind in ("master", "kahan"):
        other = "kahan" if kind == "master" else "master"
        if saved(other):
            return other
    if kind in ("master", "weight", "kahan"):
        return None
    return _MISSING


def _model_weights(part: Any) -> torch.Tensor:
    """The model's weights of `part`'s segments, one after the other, in fp32 (exact)."""
    return torch.cat([s.param.detach().reshape(-1)[s.start: s.start + s.length].float()
                      for s in part.segments])


def _derived(kind: str, read: str | None, views: dict[str, torch.Tensor], part: Any
             ) -> torch.Tensor:
    """`kind`'s fp32 values for the record, from what was read for it (_source_kind)."""
    if read is None or read == kind:
        return views[kind]
    weights = _model_weights(part)
    if kind == "master":  # the weight plus its Kahan term, as state_dict's master_param
        return weights + views["kahan"]
    low = torch.cat([s.param.detach().reshape(-1)[s.start: s.start + s.length]
                     for s in part.segments])
    return kahan_term(views["master"], low).float()


def load(tm: Any, path: str) -> dict[str, int]:
    """Load a checkpoint written by `save` (with any world size) into `tm`'s tiers, inside
    its offload block; under a process group every rank calls it. Hyperparameters of the
    param groups are restored too, as torch's load_state_dict does. Returns figures of this
    rank (peak_staged: the most partitions assembled in memory at once)."""
    src = _source(tm, "tiermem.dist.dcp.load()")
    src.off.tiers.flush()
    planner = _LoadPlanner(src)
    with warnings.catch_warnings():
        # One process: DCP warns that it assumes so, which no_dist=True already says.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=planner,
                 process_group=src.group, no_dist=src.coll is None)
    if planner._staging:
        raise TierMemError(f"checkpoint {path} lacks pieces of partitions "
                           f"{sorted(planner._staging)}")
    steps = planner.steps
    keys, want = planner.meta.get("scalar_keys", []), src.scalar_keys()
    if want and (planner.scalars is None or keys != want):
        raise TierMemError(
            f"checkpoint {path} has no per-parameter scalars {want} (written by "
            f"an earlier tiermem, or for another optimizer: it keeps {keys}); "
            "loading it would start them over")
    for part in src.off.parts:
        for s in part.segments:
            i = src.locate(s)[0]
            src.off.set_counts(s.index, float(steps[i]), {} if planner.scalars is None else {
                k: torch.tensor(float(v), dtype=torch.float32)
                for k, v in zip(keys, planner.scalars[i].tolist()) if not math.isnan(v)})
    # Which never-stepped parameters hold state (Adagrad's made in __init__) and which
    # have none until their first step fills it: the checkpoint's, as torch's
    # load_state_dict takes it, not the loading optimizer's (whose first step started
    # from the saved zeros, or whose state_dict() left the saved state out). Checkpoints
    # of an earlier tiermem do not say: what the loading run holds stays.
    stateless = planner.meta.get("stateless")
    if stateless is not None:
        gone = set(stateless)
        src.off.set_stateless(s.index for part in src.off.parts for s in part.segments
                              if src.locate(s)[0] in gone)
    loaded = getattr(tm, "counts_loaded", None)
    if loaded is not None:  # under a process group: opt.state's truth on every rank alike
        loaded(steps, stateless)
    for group, saved in zip(src.opt.param_groups, planner.meta["groups"]):
        for k, v in saved.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    if src.off.crash:
        src.off.commit()
    return {"peak_staged": planner.peak_staged}
