"""Cut the optimizer's parameters into partitions and lay out each partition's record.

A partition is a run of (param, start, length) segments from one param group,
in parameter order, holding at most `partition_size` bytes of state. Its record
is the state tensors of its elements back to back (fp32 master weight when the
model is low-precision, exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad), each
starting on a 4 KiB boundary so a record moves with O_DIRECT as one transfer.
The moments are fp32, bf16 with `optimizer.state_dtype: bf16`, or one byte per
element with `int8` (blockwise codes: each segment's moments come in blocks of
QUANT_BLOCK elements, the first at the segment's element 0, with one fp32 scale per
block and moment in the kinds `exp_avg_scale`, `exp_avg_sq_scale`); the master is
always fp32, and a bf16 model with `optimizer.master_weights: kahan` keeps a bf16
compensation term (kind `kahan`) instead. With kahan or none a crash-consistent run
also keeps a copy of the model's bf16 weights (kind `weight`): the weights then live
in the committed record, not only in the model.

A parameter is cut only at element offsets that are multiples of CUT_ALIGN:
torch's vectorised Adam kernels then see the same vector/tail split on a
segment as on the whole tensor, which keeps updates bitwise equal to an
un-partitioned optimizer.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


RECORD_ALIGN = 4096
CUT_ALIGN = 1024  # elements; a multiple of every SIMD width torch uses
STATE_BYTES = 4  # bytes of an fp32 state element (the master; moments unless bf16)
# optimizer.state_dtype -> the moments' storage dtype (int8: unsigned bytes holding codes)
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
QUANT_BLOCK = 256  # elements per int8 block: divides CUT_ALIGN, so no cut splits a block
SCALE_KINDS = {"exp_avg_scale": "exp_avg", "exp_avg_sq_scale": "exp_avg_sq"}  # -> moment
SCALE_OF = {moment: scale for scale, moment in SCALE_KINDS.items()}  # int8 moment -> its scales
# kinds of master_weights kahan/none: the compensation term, and the model's weights as a
# crash-consistent record keeps them; in the model's dtype (bf16 by default, or fp16)
LOW_WEIGHT_KINDS = ("weight", "kahan")


def align_up(n: int, to: int = RECORD_ALIGN) -> int:
    return (n + to - 1) // to * to


def is_dense(t: torch.Tensor) -> bool:
    """`t`'s elements fill one run of its storage, each once (contiguous, channels_last,
    any permutation of dims): an elementwise update may then walk them in memory order."""
    if t.is_contiguous():
        return True
    step = 1
    # size-1 dims may carry any stride; they do not move through memory
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim())
                               if t.shape[d] != 1):
        if stride != step:
            return False
        step *= size
    return True


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of dense `t` in memory order, the order segments address a parameter in.
    Not reshape(-1): on a channels_last tensor that is a copy in logical order, which an
    update would step and then drop."""
    if t.is_contiguous():
        return t.view(-1)
    if not is_dense(t):
        raise ValueError(f"a tensor of shape {tuple(t.shape)} and strides {tuple(t.stride())} "
                         "is not dense: it has no memory order to address")
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` (one shape) lie in memory the same way: their memory orders match."""
    return all(a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] != 1)


def flat_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` (a gradient, a loaded state tensor: the shape of the dense `like`) as a 1-D
    tensor in `like`'s memory order: a view where `t` lies as `like` does, else a copy laid
    out as `like` (a contiguous gradient of a channels_last weight)."""
    if t.is_contiguous() and like.is_contiguous():  # every step of most models: no loops
        return t.view(-1)
    if is_dense(t) and same_layout(t, like):
        return flat(t)
    return flat(torch.empty_like(like, dtype=t.dtype, device=t.device).copy_(t))


def laid_out(shape: Sequence[int], stride: Sequence[int] | None, fill: float = 0.0
             ) -> torch.Tensor:
    """An fp32 tensor of `shape` filled with `fill`, with `stride` (a manifest's entry of a
    non-contiguous parameter; None: contiguous): recovered state lies as torch's would."""
    t = (torch.empty(tuple(shape)) if stride is None
         else torch.empty_strided(tuple(shape), tuple(stride)))
    return t.fill_(fill)


@dataclass
class Segment:
    """Elements [start, start+length) of one parameter in memory order (flat(param): its
    storage's order, which is the logical one unless it is channels_last or permuted)."""

    param: torch.Tensor
    index: int  # the param's position in the optimizer's flattened param order
    start: int
    length: int
    # kind -> shape of that state tensor, for kinds that are not one value per element
    # (a whole-parameter rule's factored statistics); the rest have `length` elements
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # state key -> the container (list, tuple, dict) the generic path keeps as several
    # kinds, as WholeLayout.nested gives it (a manifest keeps it as template_json says)
    nested: dict[str, Any] = field(default_factory=dict)

    def size(self, kind: str) -> int:
        """Elements of `kind` this segment keeps in the record."""
        shape = self.shapes.get(kind)
        if shape is None:
            return blocks(self.length) if kind in SCALE_KINDS else self.length
        return math.prod(shape)


@dataclass
class Partition:
    """One unit of placement and transfer."""

    id: int
    group: int
    segments: list[Segment]
    kinds: tuple[str, ...]  # state tensors in the record, in order
    moment_dtype: torch.dtype = torch.float32  # of every kind but "master"
    tier: str = "nvme"
    forced: str | None = None  # tier named by a placement rule, if any
    numel: int = 0
    offsets: dict[str, int] = field(default_factory=dict)  # kind -> byte offset
    record_bytes: int = 0
    # kind -> dtype where a rule keeps it in another dtype than kind_dtype says (a
    # whole-parameter rule keeps the dtype the optimizer itself creates)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # kind -> elements in the record

    def layout(self) -> None:
        self.numel = sum(s.length for s in self.segments)
        self.sizes = {k: sum(s.size(k) for s in self.segments) for k in self.kinds}
        self.offsets, self.record_bytes = record_layout(self.numel, self.kinds,
                                                        self.moment_dtype, self.sizes,
                                                        self.dtypes)
        if not self.kinds:
            # No state (plain SGD): one page, because the tiers keep no empty records.
            self.record_bytes = RECORD_ALIGN

    def dtype(self, kind: str) -> torch.dtype:
        return self.dtypes.get(kind) or kind_dtype(kind, self.moment_dtype)

    def views(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of each state kind, in its dtype, inside a uint8 record buffer."""
        out = {}
        for k, o in self.offsets.items():
            dt = self.dtype(k)
            out[k] = record[o: o + self.sizes.get(k, self.numel) * dt.itemsize].view(dt)
        return out

    def slices(self, kind: str) -> list[slice]:
        """Each segment's elements in `kind`'s view, in segment order."""
        out, off = [], 0
        for s in self.segments:
            n = s.size(kind)
            out.append(slice(off, off + n))
            off += n
        return out


def record_of(part: Partition, views: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole uint8 record (padding included) that `part.views(record)` look into."""
    kind = part.kinds[0]
    v = views[kind]
    start = v.storage_offset() * v.element_size() - part.offsets[kind]
    return torch.empty(0, dtype=torch.uint8, device=v.device).set_(
        v.untyped_storage(), start, (part.record_bytes,))


def kind_dtype(kind: str, moment_dtype: torch.dtype) -> torch.dtype:
    if kind == "master" or kind in SCALE_KINDS:
        return torch.float32
    # kahan and weight belong to master_weights kahan/none: bf16 unless the partition's
    # dtypes say fp16 (low_weight_dtypes)
    return torch.bfloat16 if kind in LOW_WEIGHT_KINDS else moment_dtype


def low_weight_dtypes(kinds: Sequence[str], param_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Partition.dtypes for a parameter's kinds: an fp16 model's weights and Kahan term are
    fp16 (kind_dtype's default is bf16)."""
    if param_dtype != torch.float16:
        return {}
    return {k: torch.float16 for k in kinds if k in LOW_WEIGHT_KINDS}


def blocks(n: int) -> int:
    """int8 blocks (scale entries) of an n-element segment."""
    return -(-n // QUANT_BLOCK)


def _units(n: int, kinds: Sequence[str]) -> int:
    """Elements a segment of n counts for against a partition's capacity: whole blocks
    when the record holds scales, so a partition's scale count never exceeds what its
    capacity was sized for, however many short segments it holds."""
    if any(k in SCALE_KINDS for k in kinds):
        return blocks(n) * QUANT_BLOCK
    return n


def record_layout(numel: int, kinds: Sequence[str], moment_dtype: torch.dtype,
                  sizes: dict[str, int] | None = None,
                  dtypes: dict[str, torch.dtype] | None = None
                  ) -> tuple[dict[str, int], int]:
    """(byte offset of each kind, record bytes) for `numel` elements (`sizes`: kinds with
    another element count; `dtypes`: kinds in another dtype than kind_dtype says)."""
    sizes, dtypes = sizes or {}, dtypes or {}
    offsets, off = {}, 0
    for kind in kinds:
        offsets[kind] = off
        dt = dtypes.get(kind) or kind_dtype(kind, moment_dtype)
        n = sizes.get(kind, blocks(numel) if kind in SCALE_KINDS else numel)
        off = align_up(off + n * dt.itemsize)
    return offsets, off


def partition_capacity(kinds: Sequence[str], moment_dtype: torch.dtype,
                       partition_size: int) -> int:
    """Elements a partition of this layout holds: a multiple of CUT_ALIGN (at least one)
    whose record, padding included, fits `partition_size` less one page.

    The page is left for the swap record's integrity footer, so buffer_count x
    partition_size bounds the pinned pool exactly. bf16 kinds of an odd multiple of
    CUT_ALIGN elements end mid-page, so the padding is counted, not assumed away."""
    room = partition_size - RECORD_ALIGN
    # A rule with no state per element (plain SGD) still cuts partitions as if it had one
    # byte: they then hold no record bytes but keep the step loop's usual granularity.
    per_elem = max(1.0, sum(kind_dtype(k, moment_dtype).itemsize
                            / (QUANT_BLOCK if k in SCALE_KINDS else 1) for k in kinds))
    cap = int(room // per_elem) // CUT_ALIGN * CUT_ALIGN
    while cap > CUT_ALIGN and record_layout(cap, kinds, moment_dtype)[1] > room:
        cap -= CUT_ALIGN
    return max(CUT_ALIGN, cap)


def state_kinds(param: torch.Tensor, amsgrad: bool, keep_master: bool = False,
                state_dtype: str = "fp32", master_weights: str = "fp32") -> tuple[str, ...]:
    """Record contents for `param`: an fp32 master copy unless the update can run in place
    on the parameter itself (fp32, in host memory) and `keep_master` is off (a
    crash-consistent run keeps the weights in the record so they are committed with it).
    A low-precision parameter with `master_weights` kahan keeps a bf16 compensation term
    instead, with none nothing: its own weights are updated; with `keep_master` it then
    keeps a bf16 copy of those weights ("weight", written by every update), so a commit
    still holds them. int8 moments (`state_dtype`) come each followed by its block
    scales."""
    # meta: a model built on the meta device that the parameter tier makes on the CPU
    in_place = (param.dtype == torch.float32 and param.device.type in ("cpu", "meta")
                and not keep_master)
    if in_place:
        kinds: tuple[str, ...] = ()
    elif param.dtype != torch.float32 and master_weights != "fp32":
        kinds = ("weight",) if keep_master else ()
        kinds += ("kahan",) if master_weights == "kahan" else ()
    else:
        kinds = ("master",)
    if state_dtype == "int8":
        return kinds + ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")
    kinds += ("exp_avg", "exp_avg_sq")
    return kinds + (("max_exp_avg_sq",) if amsgrad else ())


# A parameter's scalar (in the manifest: its "scalars") listing the record kinds whose bytes
# lie in another memory order than the row-major one: [[kind, order], ...], the dims
# outermost first (the generic path keeps an optimizer's column-major state as it is laid)
ORDER_KEY = "tiermem_dim_order"


def laid(flat: torch.Tensor, shape: Sequence[int], order: Sequence[int] | None
         ) -> torch.Tensor:
    """The 1-D `flat` as a tensor of `shape` whose dims lie in memory in `order`."""
    if order is None:
        return flat.view(tuple(shape))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return flat.view([shape[d] for d in order]).permute(inverse)


def template_json(template: Any) -> Any:
    """A container template of the generic path (optim/rules/nested.py: ("leaf", kind),
    ("list" | "tuple", children), ("dict", ((key, child), ...)), ("subclass", (cls, ...)))
    as a manifest keeps it: {"leaf": kind}, {"list": [...]}, {"tuple": [...]},
    {"dict": [[key, child], ...]}, or {"subclass": "module.Class"} (a tensor subclass is
    made again by its class, which only a resume in the same program has)."""
    kind, body = template
    if kind == "leaf":
        return {"leaf": body}
    if kind == "subclass":
        cls = body[0]
        return {"subclass": f"{cls.__module__}.{cls.__qualname__}"}
    if kind == "dict":
        return {"dict": [[key, template_json(child)] for key, child in body]}
    return {kind: [template_json(child) for child in body]}


@dataclass
class WholeLayout:
    """What a whole-parameter rule keeps for one parameter: its kinds in record order, the
    shape of each (absent: one value per element), and each kind's dtype."""

    kinds: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    #: the generic path's state kept as several kinds: state key -> how to rebuild it
    nested: dict[str, Any] = field(default_factory=dict)


def _whole_partitions(param_groups: Sequence[dict], names: dict[int, str],
                      partition_size: int, rules: Sequence, first_id: int, first_index: int,
                      moment_dtype: torch.dtype, whole: Sequence[Sequence[WholeLayout]],
                      by_layout: bool, skip: Callable[[torch.Tensor], bool] | None
                      ) -> list[Partition]:
    room = partition_size - RECORD_ALIGN  # a page for the swap record's footer, as above
    parts: list[Partition] = []
    index = first_index
    for g, group in enumerate(param_groups):
        # The partition being filled for each record layout (by_layout), or for the last
        # parameter's only: parameters whose state differs (bitsandbytes' 8-bit state for
        # matrices, 32-bit for biases) alternate in most models, and packing each layout's
        # apart keeps a step to a few partitions, each one shadow step of the generic path.
        open_for: dict[tuple, Partition] = {}
        for j, p in enumerate(group["params"]):
            if skip is not None and skip(p):
                index += 1
                continue
            lay = whole[g][j]
            forced = rule_tier(names.get(id(p), ""), rules)
            seg = Segment(p, index, 0, p.numel(), dict(lay.shapes), dict(lay.nested))
            index += 1
            key = (lay.kinds, tuple(sorted((k, str(d)) for k, d in lay.dtypes.items())), forced)
            current = open_for.get(key)
            if current is not None:
                current.segments.append(seg)
                current.layout()
                if current.record_bytes <= room:
                    continue
                current.segments.pop()  # it does not fit beside the others: start anew
                current.layout()
            current = Partition(first_id + len(parts), g, [seg], lay.kinds, moment_dtype,
                                forced=forced, dtypes=dict(lay.dtypes))
            current.layout()
            parts.append(current)
            if not by_layout:
                open_for.clear()
            open_for[key] = current
    return parts


def rule_tier(name: str, rules: Sequence) -> str | None:
    """Tier of the first placement rule matching `name` ("" when unnamed: only '*' matches)."""
    for rule in rules:
        if fnmatch.fnmatchcase(name, rule.match):
            return rule.tier
    return None


def build_partitions(param_groups: Sequence[dict], names: dict[int, str],
                     partition_size: int, rules: Sequence = (), first_id: int = 0,
                     first_index: int = 0, keep_master: bool = False,
                     state_dtype: str = "fp32", master_weights: str = "fp32",
                     kinds: Sequence[Sequence[tuple[str, ...]]] | None = None,
                     whole: Sequence[Sequence[WholeLayout]] | None = None,
                     by_layout: bool = False,
                     skip: Callable[[torch.Tensor], bool] | None = None) -> list[Partition]:
    """Partitions of every parameter in `param_groups`, in group and parameter order.

    `names` maps id(param) to its name for placement rules; `state_dtype` is
    optimizer.state_dtype ("fp32", "bf16" or "int8": the moments' format); `keep_master` puts an
    fp32 master weight in every record (crash-consistent runs); `kinds`, per group per
    parameter, what its record holds (an update rule's layout; Adam's by default). A
    partition never
    spans two groups, two forced tiers or two record layouts.

    `whole`, per group per parameter, the layout of a rule whose math spans a parameter
    (UpdateRule.elementwise False): parameters are then never cut, and one larger than
    `partition_size` is a partition of its own. With `by_layout`, a parameter joins the
    partition being filled for its own layout rather than one of its neighbour's: fewer
    partitions where layouts alternate (bitsandbytes' 8-bit matrices and 32-bit biases),
    each holding parameters from further apart (a partition updated during backward
    waits for the last of its gradients: pipeline.overlap_backward keeps the order).

    `skip`: parameters that get no partition (frozen ones); they keep their index.
    """
    moment_dtype = MOMENT_DTYPES[state_dtype]
    if whole is not None:
        return _whole_partitions(param_groups, names, partition_size, rules, first_id,
                                 first_index, moment_dtype, whole, by_layout, skip)
    parts: list[Partition] = []
    index = first_index
    for g, group in enumerate(param_groups):
        current: Partition | None = None
        cap = 0
        for j, p in enumerate(group["params"]):
            if skip is not None and skip(p):
                index += 1
                continue
            kinds_p = (kinds[g][j] if kinds is not None
                       else state_kinds(p, bool(group.get("amsgrad", False)), keep_master,
                                        state_dtype, master_weights))
            forced = rule_tier(names.get(id(p), ""), rules)
            dtypes_p = low_weight_dtypes(kinds_p, p.dtype)
            start, n = 0, p.numel()
            while start < n:
                if (current is None or current.kinds != kinds_p or current.forced != forced
                        or current.dtypes != dtypes_p):
                    current = Partition(first_id + len(parts), g, [], kinds_p, moment_dtype,
                                        forced=forced, dtypes=dict(dtypes_p))
                    parts.append(current)
                    cap = partition_capacity(kinds_p, moment_dtype, partition_size)
                room = cap - sum(_units(s.length, kinds_p) for s in current.segments)
                take = min(n - start, room)
                if take < n - start:  # cutting inside the param: keep the cut aligned
                    take = (start + take) // CUT_ALIGN * CUT_ALIGN - start
                if take <= 0:
                    current = None
                    continue
                current.segments.append(Segment(p, index, start, take))
                start += take
                if start < n:
                    current = None  # full: the rest goes to a new partition
            index += 1
    for part in parts:
        part.layout()
    return parts
