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

Rules that step whole parameters (torch's Adafactor and Muon, the generic path for
third-party optimizers) keep state in the optimizer's own shapes and dtypes (Adafactor's
row and column statistics, containers of tensors, numbers), which no resharded load could
cut; but such a rule never cuts a parameter: the one process, the rank whose ZeRO share
holds it, or its FSDP2 owner holds each parameter's whole state. So their checkpoint
(format tiermem-dcp-whole-1) holds each record kind of parameter i whole, as
`tiermem.whole.<i>/<kind>`, in the record's dtype (its elements in the memory order the
optimizer left, which `tiermem.whole.<i>#scalars` names), written by its owner and read
whole by whichever rank owns it at load, so it too loads into any world size. Beside it:
`tiermem.whole.<i>#scalars` (torch.save, read weights_only), the parameter's host
scalars (numbers and 0-d tensors of its state: Adafactor's step, a count);
`tiermem.whole.<i>#crc32`, the CRC32 of each kind's bytes; `tiermem.values`, every group's values (hyperparameters, and counts a
step keeps there: schedule-free's k, weight_sum) and what the step keeps on the optimizer
itself (the rule's step_values(), as a resume restores them); `tiermem.steps`; and
`tiermem.meta` (JSON: the rule, the optimizer's class, each parameter's shape). A load
refuses another format, rule, optimizer class or model, and state the loading run lays
out otherwise (another kind, shape or dtype), before any record changes; it reads the
checkpoint twice, checking every piece it reads (that it is there, its CRC32) first and
writing only then, so a damaged or truncated checkpoint leaves the run's state as it was.
The state dtype does not move: these rules keep the dtypes the optimizer makes.

Never the whole state in RAM: save resolves DCP's write items lazily, in partition
order (a single writer thread keeps that order), reading one partition record at a
time into a copy and handing DCP one segment of one kind at a time; load fills one
partition's staging record at a time and writes it to its tier as soon as its last
piece arrived. DCP's file writer keeps a reference to every tensor it wrote until
the file is closed; the storage of each handed-out tensor is released (resized to
zero bytes) once DCP has serialised it, so those references hold no memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import warnings
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import (_create_read_items,
                                                          create_read_items_for_chunk_list)

from tiermem.dist.collectives import scalar_table
from tiermem.errors import TierMemError
from tiermem.kernels.lowbit import kahan_term, segment_values, store_segment
from tiermem.optim.rules import UnsupportedOptimizer, group_values
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
    fsdp: bool = False  # FSDP2 parameters (whole-parameter rules: an owner's buffers)

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
        _check_layout(tm.offloaded)
        tm.agree(op)  # every rank is here, not in a step (the planners' collectives follow)
        flat = [pc for pcs in tm.layout.pieces for pc in pcs]
        return _Source(tm.offloaded, tm.opt, tm.layout.params,
                       lambda s: (flat[s.index].index, flat[s.index].start + s.start),
                       tm.coll.group, tm.coll, tm.layout.fsdp)
    off = tm.offloaded
    _check_layout(off)
    if off.overlap is not None:
        # Its worker may still be reading the next step ahead, or be half-way through a step.
        off.overlap.require_idle("a tiermem.dist.dcp checkpoint")
    return _Source(off, off.opt, off.params, lambda s: (s.index, s.start))


def _check_layout(off: Any) -> None:
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
                got["master"].copy_(_model_weights(part))
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
    if not src.off.rule.elementwise:
        return _save_whole(src, path)
    planner = _SavePlanner(src)
    _dcp_save(src, path, planner)
    return {"records_read": planner.records_read, "peak_live_bytes": planner.peak_live_bytes}


def _dcp_save(src: _Source, path: str, planner: Any) -> None:
    # One writer thread: items are resolved in plan order, one at a time.
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():
        # One process: DCP warns that it assumes so, which no_dist=True already says.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({}, storage_writer=writer, planner=planner, process_group=src.group,
                 no_dist=src.coll is None)


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
        if VALUES in md:
            raise TierMemError(
                "this DCP checkpoint holds a whole-parameter optimizer's state (torch's "
                "Adafactor or Muon, or a third-party optimizer's), and "
                f"{_optimizer_name(self.src)} runs elementwise: load it into the optimizer "
                "class that saved it")
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
    if not src.off.rule.elementwise:
        return _load_whole(tm, src, path)
    planner = _LoadPlanner(src)
    _dcp_load(src, path, planner)
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
        mine = [(s.index, src.locate(s)[0]) for part in src.off.parts for s in part.segments]
        # (an earlier tiermem listed every never-stepped parameter of a rule without eager
        # state: none holds any, as it kept none then)
        src.off.set_stateless([j for j, i in mine if i in gone],
                              held=[j for j, i in mine if i not in gone and steps[i] == 0])
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


# -- whole-parameter rules -----------------------------------------------------------------
#
# torch's Adafactor and Muon and the generic path (tiermem/optim/rules/generic.py) step a
# whole parameter at a time, so one rank (or the one process) holds each parameter's whole
# state: each record kind of parameter i is one whole DCP tensor, `tiermem.whole.<i>/<kind>`,
# in the record's own shape (flat: the rule's tensor in the memory order the manifest's
# ORDER_KEY scalar names) and dtype, written by its owner and read whole by whichever rank
# owns the parameter at load. Beside it, `tiermem.whole.<i>#scalars` (torch.save bytes): the
# parameter's host scalars (its step count and numbers in its state, the generic path's
# memory orders) and its kinds' names; `tiermem.whole.<i>#crc32`: each kind's CRC32;
# `tiermem.values`: every group's values and what the step keeps on the optimizer itself
# (ShadowRule.step_values), replicated.

WHOLE_FORMAT = "tiermem-dcp-whole-1"
VALUES = "tiermem.values"
_CRC: Any = object()  # the planners' marker of a CRC32 item, where a kind's name would be


def _whole_fqn(index: int, kind: str) -> str:
    return f"tiermem.whole.{index}/{kind}"


# Beside parameter i's kinds (after a "#", which ends the number where a kind's "/" would:
# no state key can take their names)
def _scalars_fqn(index: int) -> str:
    return f"tiermem.whole.{index}#scalars"


def _crc_fqn(index: int) -> str:
    return f"tiermem.whole.{index}#crc32"


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def _bytes_of(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _unpickled(value: io.BytesIO, what: str, path: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except Exception as exc:
        raise TierMemError(f"checkpoint {path}: {what} cannot be read ({type(exc).__name__}: "
                           f"{exc}): the checkpoint is damaged, or the optimizer keeps a "
                           "value torch.load(weights_only=True) does not read") from exc


def _optimizer_name(src: _Source) -> str:
    return f"{type(src.opt).__module__}.{type(src.opt).__qualname__}"


def _whole_segments(src: _Source) -> list[tuple[Any, int, Any, int]]:
    """(partition, segment number, segment, parameter index) of every record segment,
    each a whole parameter (a whole-parameter rule never cuts one)."""
    out = []
    for part in src.off.parts:
        for n, s in enumerate(part.segments):
            i, start = src.locate(s)
            if start != 0 or s.length != src.params[i].numel():
                raise TierMemError(f"parameter {i} is cut into pieces, which a whole-"
                                   "parameter rule never is")  # (a layout tiermem never makes)
            out.append((part, n, s, i))
    return out


def _whole_meta(src: _Source) -> dict:
    return {"format": WHOLE_FORMAT, "rule": type(src.off.rule).__name__,
            "optimizer": _optimizer_name(src), "groups": len(src.opt.param_groups),
            "params": [{"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                       for p in src.params]}


def _values(src: _Source) -> dict:
    """What the step keeps outside the per-parameter state: every group's simple values
    (hyperparameters and counts: schedule-free's k, weight_sum) and what the rule's
    step_values() names (values on the optimizer itself, and group values it may lack
    yet: `absent`), as a resume keeps them."""
    return {"groups": [group_values(g) for g in src.opt.param_groups],
            "step": src.off.rule.step_values()}


class _WholeSavePlanner(DefaultSavePlanner):
    """Write items for this rank's whole parameters, resolved lazily from the tiers, one
    partition record copy at a time."""

    def __init__(self, src: _Source) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.src = src
        self._where: dict[str, tuple[Any, int, int, str | None]] = {}
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None
        self._last: torch.Tensor | None = None
        self.records_read = 0
        self.peak_live_bytes = 0

    def create_local_plan(self) -> SavePlan:
        self._steps = self.src.steps()
        n = len(self.src.params)
        items = [WriteItem(index=MetadataIndex(META), type=WriteItemType.BYTE_IO),
                 WriteItem(index=MetadataIndex(VALUES), type=WriteItemType.BYTE_IO),
                 WriteItem(index=MetadataIndex(STEPS, torch.Size([0])),
                           type=WriteItemType.TENSOR,
                           tensor_data=_chunk(STEPS, 0, n, n).tensor_data)]
        # DCP's writer writes the BYTE_IO items first, then the tensors in plan order: each
        # parameter's CRC32s (of its record's kinds) come after its kinds, so that one
        # record copy gives both
        for part, k, s, i in _whole_segments(self.src):  # partition order
            fqn = _scalars_fqn(i)
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            self._where[fqn] = (part, k, i, None)
            for kind in part.kinds:
                fqn = _whole_fqn(i, kind)
                item = _chunk(fqn, 0, s.size(kind), s.size(kind))
                item.tensor_data.properties.dtype = part.dtype(kind)
                items.append(item)
                self._where[fqn] = (part, k, i, kind)
            fqn = _crc_fqn(i)
            item = _chunk(fqn, 0, len(part.kinds), len(part.kinds))
            item.tensor_data.properties.dtype = torch.int64
            items.append(item)
            self._where[fqn] = (part, k, i, _CRC)
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._last is not None:  # as _SavePlanner: DCP has serialised it
            self._last.untyped_storage().resize_(0)
            self._last = None
        fqn = write_item.index.fqn
        if fqn == META:
            return io.BytesIO(json.dumps(_whole_meta(self.src)).encode())
        if fqn == VALUES:
            return _bytes_of(_values(self.src))
        if fqn == STEPS:
            return self._steps.clone()
        part, k, i, kind = self._where[fqn]
        if kind is None:  # no record read: the host values, and the names of the CRC32s
            return _bytes_of({"scalars": self.src.off.latest_scalars(part.segments[k].index),
                              "kinds": list(part.kinds)})
        views = self._record(part)
        slices = {kd: part.slices(kd)[k] for kd in part.kinds}
        if kind is _CRC:
            return torch.tensor([_crc(views[kd][sl]) for kd, sl in slices.items()],
                                dtype=torch.int64)
        out = views[kind][slices[kind]].clone()
        self._last = out
        self.peak_live_bytes = max(self.peak_live_bytes, out.nbytes + sum(
            v.nbytes for v in views.values()))
        return out

    def _record(self, part: Any) -> dict[str, torch.Tensor]:
        """A copy of `part`'s record (one at a time): its kinds in their own dtypes; a
        record never written (no parameter of it stepped) holds zeros and, as a master,
        the model's weights (what its first step starts from)."""
        if self._cache is not None and self._cache[0] == part.id:
            return self._cache[1]
        self._cache = None
        with self.src.off.tiers.record(part, write=False) as (views, fresh):
            got = {k: v.clone() for k, v in views.items()}
            if fresh:
                for k, v in got.items():
                    v.zero_()
                if "master" in got:
                    got["master"].copy_(_model_weights(part))
        self._cache = (part.id, got)
        self.records_read += 1
        return got


class _WholeHeader(DefaultLoadPlanner):
    """A checkpoint's META and VALUES only: read and checked before any record changes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.got: dict[str, io.BytesIO] = {}

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        if META not in md:
            raise TierMemError("this DCP checkpoint was not written by tiermem.dist.dcp.save "
                               f"(it has no {META!r})")
        keys = [k for k in (META, VALUES) if k in md]
        self.plan = LoadPlan([r for k in keys for r in _create_read_items(k, md[k], None)])
        return self.plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.got[read_item.dest_index.fqn] = io.BytesIO(value.read())


def _check_whole_meta(src: _Source, meta: dict, path: str) -> None:
    """Refuse a checkpoint of another format, rule, optimizer or model."""
    if meta.get("format") == FORMAT:
        raise TierMemError(
            f"checkpoint {path} holds an elementwise optimizer's state ({FORMAT}), and "
            f"{_optimizer_name(src)} ({type(src.off.rule).__name__}) keeps whole-parameter "
            "state: load it into the optimizer class that saved it")
    if meta.get("format") != WHOLE_FORMAT:
        raise TierMemError(f"checkpoint format {meta.get('format')!r}, this tiermem reads "
                           f"{FORMAT!r} and {WHOLE_FORMAT!r}")
    ours = (type(src.off.rule).__name__, _optimizer_name(src))
    theirs = (meta.get("rule"), meta.get("optimizer"))
    if ours != theirs:
        raise TierMemError(
            f"checkpoint {path} holds the state of {theirs[1]} (tiermem's {theirs[0]}), and "
            f"this optimizer is {ours[1]} ({ours[0]}): its state is another optimizer's; "
            "load it into the optimizer class that saved it")
    shapes = [list(p.shape) for p in src.params]
    saved = [p["shape"] for p in meta["params"]]
    if shapes != saved:
        first = next((i for i, (a, b) in enumerate(zip(shapes, saved)) if a != b),
                     min(len(shapes), len(saved)))
        raise TierMemError(
            f"the checkpoint has {len(saved)} parameters and this optimizer {len(shapes)}; "
            f"they first differ at parameter {first} (shape "
            f"{saved[first] if first < len(saved) else None} saved, "
            f"{shapes[first] if first < len(shapes) else None} here)")
    if meta["groups"] != len(src.opt.param_groups):
        raise TierMemError(f"the checkpoint has {meta['groups']} param groups and this "
                           f"optimizer {len(src.opt.param_groups)}")


class _WholeLoadPlanner(DefaultLoadPlanner):
    """Read items for this rank's whole parameters; each partition checked (its CRC32s) and
    written to its tier once all its tensors and its parameters' scalars arrived."""

    def __init__(self, src: _Source, path: str, *, write: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.src, self.path = src, path
        self.write = write  # False: read and check only (load's first pass)
        self._dest: dict[str, tuple[Any, int, str | None]] = {}
        self._staging: dict[int, _Staging] = {}
        self._waiting: dict[int, int] = {}  # part id -> tensors and scalars still to come
        self._counts: dict[int, int] = {}
        self._read: dict[int, dict[str, str | None]] = {}  # part id -> kind -> read or None
        self.scalars: dict[int, dict] = {}  # segment index -> the saved scalars bytes
        self.crcs: dict[int, torch.Tensor] = {}  # segment index -> its kinds' CRC32s
        self._by_param: dict[int, list[str]] | None = None
        self.peak_staged = 0
        self.written = 0

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        n = len(self.src.params)
        self._steps_buf = torch.zeros(n)
        self.steps = None
        items: list[ReadItem] = [*_create_read_items(STEPS, md[STEPS], self._steps_buf)]
        for part, k, s, i in _whole_segments(self.src):
            read = self._read.setdefault(part.id, {})
            for fqn in (_scalars_fqn(i), _crc_fqn(i)):
                if fqn not in md:
                    raise TierMemError(f"checkpoint {self.path} has no {fqn!r} (of parameter "
                                       f"{i}): it is incomplete")
            self._dest[_scalars_fqn(i)] = (part, k, None)
            items += _create_read_items(_scalars_fqn(i), md[_scalars_fqn(i)], None)
            fqn = _crc_fqn(i)
            self._dest[fqn] = (part, k, _CRC)
            self.crcs[s.index] = torch.zeros(tuple(md[fqn].size), dtype=torch.int64)
            items += _create_read_items(fqn, md[fqn], self.crcs[s.index])
            self._counts[part.id] = self._counts.get(part.id, 0) + 2
            saved = set(self._kinds_saved(i, md))
            extra = saved - set(part.kinds) - {"master"}
            for kind in part.kinds:
                fqn = _whole_fqn(i, kind)
                if fqn not in md:
                    if kind != "master":
                        raise TierMemError(
                            f"checkpoint {self.path} has no state {kind!r} of parameter {i}, "
                            f"which this optimizer keeps (it keeps {sorted(saved)}): saved "
                            "with other settings of the optimizer?")
                    if self.src.fsdp:
                        # an owner's buffer holds the weights its last step left, not an
                        # edit made since (the next step's gather takes that)
                        raise TierMemError(
                            f"checkpoint {self.path} has no fp32 master of parameter {i}, "
                            "which this run keeps (crash_consistent, or low-precision "
                            "weights): over fully_shard parameters tiermem cannot take it "
                            "from the model's weights at a load; load it with the "
                            "durability and weights dtype it was saved with")
                    read[kind] = None  # the model's weights, as the first step takes them
                    continue
                t = md[fqn]
                if not isinstance(t, TensorStorageMetadata):
                    raise TierMemError(f"checkpoint {self.path}: {fqn!r} is not a tensor")
                if tuple(t.size) != (s.size(kind),) or t.properties.dtype != part.dtype(kind):
                    raise TierMemError(
                        f"checkpoint {self.path}: parameter {i}'s state {kind!r} is "
                        f"{t.properties.dtype} of {math.prod(t.size)} elements, where this "
                        f"optimizer keeps {part.dtype(kind)} of {s.size(kind)}: saved with "
                        "other settings of the optimizer (or another state dtype, which "
                        "this optimizer's state cannot move to)?")
                read[kind] = kind
                self._dest[fqn] = (part, k, kind)
                got = create_read_items_for_chunk_list(
                    fqn, t, [ChunkStorageMetadata(torch.Size([0]), torch.Size([s.size(kind)]))])
                self._counts[part.id] += len(got)
                items += got
            if extra:
                raise TierMemError(
                    f"checkpoint {self.path} has state {sorted(extra)} of parameter {i}, "
                    f"which this optimizer does not keep with its settings: loaded, it "
                    "would be dropped")
        self.plan = LoadPlan(items)
        return self.plan

    def _kinds_saved(self, i: int, md: dict) -> list[str]:
        """The kinds the checkpoint holds of parameter i."""
        if self._by_param is None:
            self._by_param = {}
            for key in md:
                head, slash, kind = key.removeprefix("tiermem.whole.").partition("/")
                if key.startswith("tiermem.whole.") and slash and head.isdigit():
                    self._by_param.setdefault(int(head), []).append(kind)
        return self._by_param.get(i, [])

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        part, k, _ = self._dest[fqn]
        self.scalars[part.segments[k].index] = _unpickled(value, f"{fqn!r}", self.path)
        self._stage(part)
        self._arrived(part)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        if fqn == STEPS:
            return self._steps_buf
        part, k, kind = self._dest[fqn]
        st = self._stage(part)
        if kind is _CRC:
            return self.crcs[part.segments[k].index]
        sl = part.slices(kind)[k]
        a = sl.start + read_item.dest_offsets[0]
        return st.views[kind][a: a + read_item.lengths[0]]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        if fqn == STEPS:
            self.steps = self._steps_buf
            return
        self._arrived(self._dest[fqn][0])

    def _stage(self, part: Any) -> _Staging:
        st = self._staging.get(part.id)
        if st is None:
            views = {k: torch.zeros(part.sizes[k], dtype=part.dtype(k))
                     for k, r in self._read[part.id].items() if r is not None}
            st = self._staging[part.id] = _Staging(views, self._counts[part.id])
            self.peak_staged = max(self.peak_staged, len(self._staging))
        return st

    def _arrived(self, part: Any) -> None:
        st = self._staging[part.id]
        st.pending -= 1
        if st.pending == 0:
            self._write(part)

    def _write(self, part: Any) -> None:
        st = self._staging.pop(part.id)
        read = self._read[part.id]
        for k, s in enumerate(part.segments):
            crcs = dict(zip(self.scalars[s.index]["kinds"], self.crcs[s.index].tolist()))
            for kind, r in read.items():
                if r is None:
                    continue
                got = _crc(st.views[kind][part.slices(kind)[k]])
                if crcs.get(kind) != got:
                    raise TierMemError(
                        f"checkpoint {self.path}: the state {kind!r} of parameter "
                        f"{self.src.locate(s)[0]} does not match its CRC32 (saved "
                        f"{crcs.get(kind)}, read {got}): the checkpoint is damaged")
        if not self.write:
            return
        if "master" in read and read["master"] is None:
            st.views["master"] = _model_weights(part)
        with self.src.off.tiers.record(part, write=True) as (views, _):
            for k, v in st.views.items():
                views[k].copy_(v)
        self.written += 1


def _refuse_weight_tier(src: _Source, op: str) -> None:
    if src.off.weights is not None:
        # the parameters are empty between uses there: their shapes, and the weights a
        # master is made from, are the tier's, which this path does not read
        raise TierMemError(
            f"tiermem.dist.dcp.{op}() of {_optimizer_name(src)}'s whole-parameter state "
            "with parameters.offload is not supported: save optimizer.state_dict() "
            "instead, or checkpoint with parameters.offload none")


def _save_whole(src: _Source, path: str) -> dict[str, int]:
    _refuse_weight_tier(src, "save")
    planner = _WholeSavePlanner(src)
    _dcp_save(src, path, planner)
    return {"records_read": planner.records_read, "peak_live_bytes": planner.peak_live_bytes}


def _dcp_load(src: _Source, path: str, planner: Any) -> None:
    with warnings.catch_warnings(), _refusals():
        # One process: DCP warns that it assumes so, which no_dist=True already says.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=planner,
                 process_group=src.group, no_dist=src.coll is None)


@contextlib.contextmanager
def _refusals() -> Any:
    """A planner's refusal as itself: DCP wraps what its planners raise (on any rank) in a
    CheckpointException, whose message is every rank's traceback."""
    try:
        yield
    except CheckpointException as exc:
        ours = [f[0] for f in exc.failures.values() if isinstance(f[0], TierMemError)]
        if ours:
            raise ours[0] from exc
        raise


def _load_whole(tm: Any, src: _Source, path: str) -> dict[str, int]:
    _refuse_weight_tier(src, "load")
    header = _WholeHeader()
    try:
        _dcp_load(src, path, header)
        meta = json.loads(header.got[META].read().decode())
    except TierMemError:
        raise
    except (Exception, CheckpointException) as exc:  # (DCP's is a BaseException)
        raise TierMemError(f"checkpoint {path} cannot be read ({type(exc).__name__}: "
                           f"{exc}): is it a tiermem.dist.dcp checkpoint, complete?") from exc
    _check_whole_meta(src, meta, path)
    if VALUES not in header.got:
        raise TierMemError(f"checkpoint {path} has no {VALUES!r}: it is incomplete")
    values = _unpickled(header.got[VALUES], repr(VALUES), path)
    # Read twice: a damaged or truncated checkpoint found half-way would leave some records
    # holding its state and the rest the run's. The first pass checks every piece this rank
    # reads (its CRC32, that it is there) and writes nothing.
    for write in (False, True):
        planner = _WholeLoadPlanner(src, path, write=write)
        try:
            _dcp_load(src, path, planner)
            if planner._staging:
                raise TierMemError(f"checkpoint {path} lacks pieces of partitions "
                                   f"{sorted(planner._staging)}")
        except BaseException as exc:
            if planner.written:  # the checkpoint changed between the passes
                src.off.broken = (
                    f"tiermem.dist.dcp.load({path!r}) failed after writing {planner.written} "
                    f"of this rank's partitions ({exc}), having read all of them once: this "
                    "state is neither the checkpoint's nor the run's")
            if isinstance(exc, TierMemError) or not isinstance(
                    exc, (Exception, CheckpointException)):
                raise  # (an interrupt stays one)
            raise TierMemError(f"checkpoint {path} cannot be read ({type(exc).__name__}: "
                               f"{exc}): is it complete?") from exc
    steps = planner.steps
    for part in src.off.parts:
        for s in part.segments:
            saved = planner.scalars[s.index]["scalars"]
            src.off.set_counts(s.index, float(steps[src.locate(s)[0]]), saved)
    src.off.set_stateless(())
    # the groups' values (hyperparameters, as torch's load_state_dict takes them, and what
    # the step counts there), then what the step keeps on the optimizer itself
    for group, saved in zip(src.opt.param_groups, values["groups"]):
        group.update(saved)
    loaded = getattr(tm, "values_loaded", None)
    if loaded is not None:  # under a process group: onto each rank's optimizer, and back
        loaded(lambda: src.off.rule.restore_step_values(values["step"]))
        # (a whole-parameter rule keeps no entry of step 0: the parameters never stepped
        # hold no state, and counts_loaded takes those it is not given as holding some)
        tm.counts_loaded(steps, [i for i, n in enumerate(steps.tolist()) if n == 0])
    else:
        src.off.rule.restore_step_values(values["step"])
    if src.off.crash:
        src.off.commit()
    return {"peak_staged": planner.peak_staged}
