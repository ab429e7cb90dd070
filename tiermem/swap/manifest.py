"""The manifest: which records on disk make up one consistent optimizer state.

Two writers. Scratch mode writes it once, at exit, when the optimizer state does
not fit back into host memory: the run directory keeps the swap files plus
`resident.swap` (records of host/GPU-tier partitions). Crash-consistent mode
writes it after every step (a commit): every record, resident ones included,
lives in one of two copies in the swap files, and the manifest names the copy
and generation of each. Either way it is written last and atomically (write,
fsync, rename, fsync the directory), so a directory's manifest always describes
a complete state, and carries enough (parameter shapes, names, param groups,
where every record is) for `tiermem recover` to rebuild a checkpoint without
the model.

The manifest is checked like the records: it carries a CRC32C of its own
canonical JSON (`crc32c`), and every field is checked against a schema (types,
ranges, cross-references between partitions, records, parameters and groups)
before anything it names is read. Swap files it names must be `state.swap` in
the run directory or in a sibling run directory of the same name (other swap
paths): a crafted manifest cannot make tiermem read, or resume into, a file
elsewhere. Any failure raises ManifestError naming the file and the field.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from tiermem.errors import TierMemError, TierMemIOError
from tiermem.kernels.checksum import crc32c
from tiermem.partition import SCALE_KINDS, Partition, blocks, record_layout, template_json
from tiermem.swap.integrity import FOOTER_BYTES
from tiermem.swap import fsops

MANIFEST = "manifest.json"
# The commit before the last one, kept for runs under torch.distributed: each rank commits
# its share on its own, so a crash between two ranks' commits leaves them one step apart,
# and a rank ahead reopens this one (its records are intact: a rank writes the next step's
# records only after that step's first collective, which needs every rank to have
# committed).
PREVIOUS = "manifest.previous.json"
RESIDENT_FILE = "resident.swap"
# 3: the manifest's own CRC32C and a checked schema; 4: the optimizer's defaults and the
# parameters it keeps no state for (`defaults`, `stateless`), which recover needs to give
# Adagrad's never-stepped parameters the state torch gives them. Version 3 is still read
# (resumed as before; recover refuses what only version 4 says, see swap/recover.py).
# `unstepped_state` and `late` came later, optional in version 4 (absent: none).
VERSION = 4
READS = (3, 4)
V4_FIELDS = ("defaults", "stateless", "unstepped_state", "late")
OPTIONAL = ("values", "share", "unstepped_state", "late")  # absent: empty
CRC_KEY = "crc32c"
STATE_FILE = "state.swap"  # each run directory's swap file (the store creates it)


class ManifestError(TierMemError):
    """A manifest that is damaged, crafted or from another version: names file and field."""


@dataclass(frozen=True)
class Unkept:
    """A value a manifest could not keep exactly (an object, a dict keyed by numbers, a
    large tensor): what it looked like, and a digest of it (None in manifests of earlier
    versions) that tells whether the resumed optimizer holds the same."""

    text: str
    digest: str | None


def scalar_from_json(value):
    """A per-parameter scalar as torch's state holds it, from the manifest's form (a
    number, or a 0-d tensor's value with its dtype)."""
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def value_from_json(value):
    """A value a step changed outside the per-parameter state (values.groups, .own,
    .state), from the manifest's form: exact, or an Unkept where JSON could not keep it."""
    if isinstance(value, dict):
        if "unkept" in value:
            return Unkept(value["unkept"], value.get("digest"))
        if "tuple" in value:
            return tuple(value["tuple"])
        if "dict" in value:
            return dict(value["dict"])
        return scalar_from_json(value)
    return value


@dataclass
class Manifest:
    partitions: list[dict]  # id, group, tier, numel, record_bytes, kinds, segments
    steps: list[float]  # per parameter, in the optimizer's flattened order
    fresh: list[int]  # partitions never written (their records hold nothing yet)
    resident: list[dict] = field(default_factory=list)  # id, offset, nbytes in RESIDENT_FILE
    generations: dict = field(default_factory=dict)  # partition id -> generation of its record
    durability: str = "scratch"
    step: int = 0  # optimizer steps taken when this state was committed
    copies: dict = field(default_factory=dict)  # partition id -> copy (0/1) holding it
    records: dict = field(default_factory=dict)  # partition id -> [file, offset, nbytes]
    files: list[str] = field(default_factory=list)  # the swap files records refer to
    checksums: bool = True
    # name, shape, dtype per parameter, and its strides ("stride") where it is not
    # contiguous (channels_last): the records hold it in memory order
    params: list[dict] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)  # hyperparameters, params as indices
    rule: str = "AdamRule"  # the update rule whose state the records hold (optim/rules)
    version: int = VERSION
    # what the optimizer's step changes outside its per-parameter state, for a resume to
    # set back: {"groups": {group index: {key: value}}, "own": {attribute: value},
    # "absent": [the names of those not made yet]}
    # (absent from manifests of earlier tiermem versions: a resume then refuses such an
    # optimizer)
    values: dict = field(default_factory=dict)
    # a rank's share under torch.distributed: {"world", "rank" (in the group), "ranks"
    # (the group's global ranks, which name the ranks' run directories), "pieces": [[the
    # user's parameter index, first element] per parameter above], "params": [name, shape,
    # dtype per user parameter], "group_params": [the user's parameter indices per group]},
    # so that `tiermem recover` puts the ranks' pieces back together (absent in one process)
    share: dict = field(default_factory=dict)
    # the optimizer's defaults (state_io.jsonable): torch's Adagrad fills every accumulator
    # from its defaults' initial_accumulator_value, not from the group's (version 4)
    defaults: dict = field(default_factory=dict)
    # parameters never stepped that the optimizer keeps no state for although its rule
    # makes state eagerly (an Adagrad group added after construction, an entry a loaded
    # state_dict left out): torch's state_dict has no entry for them (version 4)
    stateless: list[int] = field(default_factory=list)
    # parameters never stepped that hold state all the same although their rule makes it
    # at the first step (Adam's, made by a fused step GradScaler skipped: step 0, zero
    # moments): torch's state_dict has an entry for them (version 4, optional)
    unstepped_state: list[int] = field(default_factory=list)
    # parameters frozen when the block opened, laid out inside it as they took their first
    # step (or were given state): per lay-out in order, {"at": the partition count before
    # it, "params": their indices}; a resume lays them out so again (version 4, optional)
    late: list[dict] = field(default_factory=list)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(parts: Sequence[Partition]) -> list[dict]:
    """Each partition's record layout as a manifest keeps it. Besides the segments and
    kinds, a whole-parameter rule's partition says what its kinds are (`dtypes`: those
    not in kind_dtype's dtype; `shapes`: per segment, the kinds that are not one value per
    element; `nested`: per segment, the containers the generic path keeps as several
    kinds), so that `tiermem recover` can rebuild the optimizer's state from the
    manifest alone."""
    out = []
    for p in parts:
        entry = {"id": p.id, "group": p.group, "tier": p.tier, "numel": p.numel,
                 "record_bytes": p.record_bytes, "kinds": list(p.kinds),
                 "moment_dtype": _dtype_name(p.moment_dtype),
                 "segments": [[s.index, s.start, s.length] for s in p.segments]}
        if p.dtypes:
            entry["dtypes"] = {k: _dtype_name(d) for k, d in p.dtypes.items()}
        if any(s.shapes for s in p.segments):
            entry["shapes"] = [{k: list(v) for k, v in s.shapes.items()} for s in p.segments]
        if any(s.nested for s in p.segments):
            entry["nested"] = [{k: template_json(t) for k, t in s.nested.items()}
                               for s in p.segments]
        out.append(entry)
    return out


def write_manifest(run_dir: str, manifest: Manifest, name: str = MANIFEST) -> str:
    """Replace `run_dir`'s manifest (or the file `name`) atomically: the old one stays valid
    until the rename, and the rename is on disk before this returns."""
    path = os.path.join(run_dir, name)
    tmp = path + ".tmp"
    body = asdict(manifest)
    if manifest.version < 4:
        # a version-3 manifest read back and written again (resume_previous): it stays
        # what it was, and a reader does not take its empty defaults for the optimizer's
        for k in V4_FIELDS:
            body.pop(k, None)
    data = encode(body)
    fs = fsops.ops()
    try:
        # The bytes are durable before the rename publishes them: a rename that reaches
        # the disk first would otherwise name an empty or torn file.
        fs.write_file(tmp, data, site="manifest.fsync")
        fs.replace(tmp, path)
        fs.fsync_dir(run_dir, site="manifest.dirsync")  # the rename itself is durable
    except OSError as exc:
        _discard(tmp)
        gone = "" if os.path.isdir(run_dir) else " (the swap directory was removed)"
        raise TierMemIOError(f"writing the manifest {path} failed: {exc.strerror} "
                             f"({errno.errorcode.get(exc.errno, exc.errno)}){gone}",
                             op="manifest", path=path, errno=exc.errno) from None
    return path


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(body: dict) -> bytes:
    """The bytes of a manifest file: canonical JSON with the CRC32C of the rest in it."""
    body = json.loads(_canonical(body))  # int dict keys become strings, as read back
    body.pop(CRC_KEY, None)
    return _canonical({**body, CRC_KEY: crc32c(_canonical(body))})


def _discard(path: str) -> None:
    try:
        fsops.ops().unlink(path)
    except OSError:
        pass  # never written, or its directory is gone: nothing to clean


def read_manifest(run_dir: str, parts: Sequence[Partition] | None,
                  durability: str | None = None, *, previous: bool = False,
                  share: dict | None = None) -> Manifest:
    """The manifest in `run_dir` (the one before it with `previous`), checked (checksum and
    schema, see the module doc) and checked against the layout this optimizer and config
    give (`parts`, `durability`, and under torch.distributed this rank's `share`; parts None
    reads it as it is, for `tiermem recover`)."""
    path = os.path.join(run_dir, PREVIOUS if previous else MANIFEST)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise TierMemError(f"cannot resume: {path} does not exist (no state was kept on disk "
                           "there, or the run that kept it did not finish writing it)") from None
    except OSError as exc:
        raise ManifestError(f"cannot resume: reading {path} failed: {exc.strerror}") from None
    m = parse(raw, path, run_dir)
    if parts is None:
        return m
    if share is not None:
        _same_share(m, share, run_dir)
    if durability is not None and m.durability != durability:
        # The two modes lay the swap files out differently (one copy or two per record).
        raise TierMemError(
            f"cannot resume from {run_dir}: the kept state was written with "
            f"swap.durability: {m.durability}, this config says {durability}; resume with "
            f"{m.durability}")
    expected = layout_of(parts)
    if len(expected) == len(m.partitions):
        # A manifest of an earlier tiermem lacks the whole-parameter layout's dtypes,
        # shapes and nested containers: compared on what it keeps (its record_bytes
        # still sizes every record).
        expected = [{k: v for k, v in e.items() if k in _PART_KEYS or k in kept_entry}
                    for e, kept_entry in zip(expected, m.partitions)]
    kept = {p["moment_dtype"] for p in m.partitions}
    want = {p["moment_dtype"] for p in expected}
    if kept and want and kept != want:
        raise TierMemError(
            f"cannot resume from {run_dir}: the kept moments are stored as "
            f"{_STATE_NAMES.get(min(kept), min(kept))}, this config says "
            f"optimizer.state_dtype {_STATE_NAMES.get(min(want), min(want))}; resume with "
            f"state_dtype {_STATE_NAMES.get(min(kept), min(kept))}, or load a state_dict() "
            "to convert")
    if m.partitions != expected:
        diff = next((i for i, (a, b) in enumerate(zip(m.partitions, expected)) if a != b),
                    min(len(m.partitions), len(expected)))
        raise TierMemError(
            f"cannot resume from {run_dir}: the kept state has {len(m.partitions)} partitions "
            f"and this optimizer/config lays out {len(expected)}; they first differ at "
            f"partition {diff}{_difference(m.partitions, expected, diff)}. Resume with the "
            "same model, optimizer param groups and "
            "config (partition_size, tier capacities, placement, optimizer.state_dtype, "
            f"swap.durability: the kept state was written with {m.durability!r})."
            f"{_unlaid(m.partitions, expected)}")
    return m


def _unlaid(kept: list[dict], expected: list[dict]) -> str:
    """The likeliest cause when the kept state covers parameters this layout leaves out:
    they are frozen now (a parameter frozen mid-run keeps its state, but one with
    requires_grad=False and no state when a block opens takes no record)."""
    def covered(parts: list[dict]) -> set[int]:
        return {seg[0] for part in parts for seg in part["segments"]}

    left_out = sorted(covered(kept) - covered(expected))
    if not left_out:
        return ""
    return (f" Parameters {left_out[:5]}{' and more' if len(left_out) > 5 else ''} (by "
            "place in the param groups) have kept state but take no record now: frozen "
            "(requires_grad=False) when this block opened, with no state yet. Set "
            "requires_grad=True on them for the resume, and freeze them again inside the "
            "block.")


def _difference(kept: list[dict], expected: list[dict], i: int) -> str:
    """What differs in partition i's layout (its tier, size, segments...), for the user."""
    if i >= len(kept) or i >= len(expected):
        return ""

    def short(v: Any) -> str:
        text = repr(v)
        return text if len(text) <= 60 else text[:57] + "..."

    a, b = kept[i], expected[i]
    fields = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return " (" + "; ".join(f"{k}: kept {short(a.get(k))}, now {short(b.get(k))}"
                            for k in fields[:3]) + ")"


def _same_share(m: Manifest, share: dict, run_dir: str) -> None:
    """A rank's share is the world size's cut of the model: kept by a run of another world
    size (or by another rank) it holds other elements, which a partition layout that
    happens to match would load into the wrong places; a mismatched one would be blamed on
    the config."""
    kept = m.share or {}
    if not kept and share:
        return  # an earlier tiermem's manifest, which kept no share: the layout check alone
    keys = ("world", "rank", "pieces", "group_params")
    if all(kept.get(k) == share.get(k) for k in keys):
        return
    def who(s: dict) -> str:
        return (f"rank {s['rank']} of {s['world']}" if s else "one process (no process group)")
    def groups(s: dict) -> str:
        return (f"{len(s.get('params', []))} parameters in {len(s.get('group_params', []))} "
                "param groups")
    if kept and share and (kept.get("world"), kept.get("rank")) == \
            (share.get("world"), share.get("rank")):
        # Same rank of the same world size: the optimizer's groups differ (a group added
        # inside the kept block, left out now; a rank owning none of it still differs in
        # group_params, so every rank refuses alike)
        raise TierMemError(
            f"cannot resume from {run_dir}: it holds the share of {who(kept)} over "
            f"{groups(kept)}, and this optimizer has {groups(share)}; resume with the "
            "optimizer's param groups as the kept run had them (groups it added with "
            "add_param_group inside the block included)")
    raise TierMemError(
        f"cannot resume from {run_dir}: it holds the share of {who(kept)}, and this is "
        f"{who(share)}; a resume continues on the same world size, each rank from its own "
        "directory. To continue on another world size, write a torch checkpoint with "
        "`tiermem recover` (or save with tiermem.dist.dcp) and load it there")


def _json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, str)) or _is_num(v)


def _json_nest(v: Any, depth: int = 0) -> bool:
    """JSON scalars, or lists of them nested (no deeper than json.loads itself goes)."""
    if isinstance(v, list):
        return depth < 32 and all(_json_nest(x, depth + 1) for x in v)
    return _json_scalar(v)


def parse(raw: bytes, path: str, run_dir: str) -> Manifest:
    """A Manifest from the bytes of file `path` in `run_dir`, or ManifestError."""
    def bad(what: str) -> ManifestError:
        return ManifestError(f"cannot use {path}: {what}; it is damaged or was not written by "
                             "this tiermem, and nothing it names was read")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise bad(f"a JSON {type(data).__name__}, not an object")
    version = data.get("version")
    if _is_int(version) and version not in READS:  # anything else is damage, checked below
        raise ManifestError(f"cannot resume: {path} has version {version!r}, this tiermem "
                            f"reads versions {READS[0]} to {READS[-1]}")
    crc = data.pop(CRC_KEY, None)
    if not _is_int(crc):
        raise bad(f"no valid {CRC_KEY!r} field (found {crc!r})")
    found = crc32c(_canonical(data))
    if found != crc:
        raise bad(f"checksum expected {crc:#010x}, found {found:#010x} (CRC32C of its "
                  "canonical JSON: the file changed after it was written)")
    written = data.get("files")
    try:
        _validate(data, run_dir)
    except _Invalid as exc:
        raise bad(str(exc)) from None
    m = Manifest(**data)
    # where the swap files were when the manifest was written (files[0] now reads as the
    # one beside it): a run directory moved since has its other paths' files elsewhere
    # too, or they are no longer this run's (swap/recover.py: swap_files)
    m.written_files = list(written)
    return m


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class _Invalid(Exception):
    pass


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def kind_name_ok(name: str) -> bool:
    """Whether a manifest can name a record kind `name` (read back, it is checked so)."""
    return _KIND_PATH.match(name) is not None


def _host_value(v, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, str)) or _is_num(v):
        return True
    return isinstance(v, list) and depth < 8 and all(_host_value(x, depth + 1) for x in v)


def _tensor_value(v, depth: int = 0) -> bool:
    if _is_num(v) or isinstance(v, bool):
        return True
    return isinstance(v, list) and depth < 8 and all(_tensor_value(x, depth + 1) for x in v)


def _kept_value(v) -> bool:
    """A value a step changes outside the state, as optim/offloaded.py keeps it: JSON
    values and lists of them, a tensor's value (nested lists of them beyond 0-d) and
    dtype, a tuple, a dict keyed by strings, or why not kept."""
    if _host_value(v):
        return True
    if not isinstance(v, dict):
        return False
    if set(v) == {"tensor", "dtype"}:
        return _tensor_value(v["tensor"]) and v["dtype"] in _SCALAR_DTYPES
    if set(v) == {"tuple"}:
        return isinstance(v["tuple"], list) and _host_value(v["tuple"])
    if set(v) == {"dict"}:
        return isinstance(v["dict"], dict) and all(_host_value(x) for x in v["dict"].values())
    return (set(v) in ({"unkept"}, {"unkept", "digest"}) and isinstance(v["unkept"], str)
            and isinstance(v.get("digest", ""), str))


def _need(ok: bool, where: str, what: str, value) -> None:
    if not ok:
        text = repr(value)
        text = text if len(text) <= 80 else text[:80] + "..."
        raise _Invalid(f"{where} must be {what}, found {text}")


def _uint(v, where: str) -> int:
    _need(_is_int(v) and v >= 0, where, "an integer >= 0", v)
    return v


def _list(v, where: str, n: int | None = None) -> list:
    _need(isinstance(v, list) and (n is None or len(v) == n), where,
          "a list" if n is None else f"a list of {n}", v)
    return v


def _dict(v, where: str, keys: set[str] | None = None) -> dict:
    _need(isinstance(v, dict), where, "an object", v)
    if keys is not None and set(v) != keys:
        missing, extra = sorted(keys - set(v)), sorted(set(v) - keys)
        raise _Invalid(f"{where} has the wrong fields (missing {missing}, unexpected {extra})")
    return v


_DURABILITY = ("scratch", "crash_consistent")
_TIERS = ("gpu", "host", "nvme")
_KINDS = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_scale",
          "exp_avg_sq_scale", "kahan", "weight")
# uint8: optimizer.state_dtype int8 (blockwise codes, their scales in the *_scale kinds)
_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16, "uint8": torch.uint8}
_STATE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "uint8": "int8"}  # optimizer.state_dtype
_DTYPES = ("float32", "float16", "bfloat16", "float64")
_PART_KEYS = {"id", "group", "tier", "numel", "record_bytes", "kinds", "segments",
              "moment_dtype"}
_PARAM_KEYS = {"name", "shape", "dtype"}
_WHOLE_KEYS = {"dtypes", "shapes", "nested"}  # a whole-parameter rule's (layout_of)
# the dtypes an optimizer's own state may have in a record
_STATE_DTYPES = _DTYPES + ("int8", "uint8", "int16", "int32", "int64", "bool")
_TEMPLATE_KINDS = {"leaf", "list", "tuple", "dict", "subclass"}
_SCALAR_DTYPES = _DTYPES + ("int64", "int32", "bool")
_KIND_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
# an optimizer's own state name (FlashAdamW's "exp_avg::quantized"), or the path of a
# tensor inside a list or dict under one ("GG[0]", "momentum_buffer[0.9]": the generic
# path keeps each in the record): printable, up to 256 characters
_KIND_PATH = re.compile(r"[^\x00-\x1f\x7f]{1,256}\Z")
_BOOL_GROUP_KEYS = ("amsgrad", "maximize", "capturable", "differentiable",
                    "decoupled_weight_decay")
_OPTIONAL_BOOL_GROUP_KEYS = ("foreach", "fused")
_NUM_GROUP_KEYS = ("lr", "eps", "weight_decay", "initial_lr")
# What every group of every supported optimizer has, and what an Adam/AdamW group has
# whatever the torch version (recover hands them on).
_REQUIRED_GROUP_KEYS = ("params", "lr")
_ADAM_GROUP_KEYS = ("betas", "eps", "weight_decay", "amsgrad", "maximize")


def _template(t, where: str, kinds: list, depth: int = 0) -> None:
    """A container template as template_json writes it, its leaves kinds of the record."""
    _need(isinstance(t, dict) and len(t) == 1 and set(t) <= _TEMPLATE_KINDS and depth < 8,
          where, f"one of {sorted(_TEMPLATE_KINDS)} (nested at most 8 deep)", t)
    (kind, body), = t.items()
    if kind == "leaf":
        _need(body in kinds, f"{where}.leaf", "a kind of the partition", body)
    elif kind == "subclass":
        _need(isinstance(body, str), f"{where}.subclass", "a class name", body)
    elif kind == "dict":
        for j, pair in enumerate(_list(body, f"{where}.dict")):
            key, child = _list(pair, f"{where}.dict[{j}]", 2)
            _need(key is None or isinstance(key, (bool, str)) or _is_num(key),
                  f"{where}.dict[{j}][0]", "a string, number, boolean or null", key)
            _template(child, f"{where}.dict[{j}][1]", kinds, depth + 1)
    else:
        for j, child in enumerate(_list(body, f"{where}.{kind}")):
            _template(child, f"{where}.{kind}[{j}]", kinds, depth + 1)


def _stride(stride: Any, shape: list, w: str) -> None:
    """A non-contiguous parameter's strides (recover lays its state out with them): one
    per dim, of a dense layout (each element once, no gaps), as the records hold it."""
    got = _list(stride, f"{w}.stride", len(shape))
    for j, x in enumerate(got):
        _uint(x, f"{w}.stride[{j}]")
    step = 1
    for x, dim in sorted((x, dim) for x, dim in zip(got, shape) if dim != 1):
        _need(x == step, f"{w}.stride", f"the strides of a dense tensor of shape {shape}",
              got)
        step *= dim


def _share(share: dict, n: int) -> list[int]:
    """A rank's share (Manifest.share), checked; returns each user parameter's elements."""
    _dict(share, "share", {"world", "rank", "ranks", "pieces", "params", "group_params"})
    world = _uint(share["world"], "share.world")
    _need(world >= 1 and _uint(share["rank"], "share.rank") < world, "share.rank",
          f"a rank below share.world ({world})", share["rank"])
    ranks = _list(share["ranks"], "share.ranks", world)
    _need(all(_is_int(r) and r >= 0 for r in ranks) and len(set(ranks)) == world,
          "share.ranks", "the group's distinct global ranks", ranks)
    users = _list(share["params"], "share.params")
    numels = []
    for i, p in enumerate(users):
        w = f"share.params[{i}]"
        _dict(p, w, _PARAM_KEYS)
        _need(isinstance(p["name"], str), f"{w}.name", "a string", p["name"])
        _need(p["dtype"] in _DTYPES, f"{w}.dtype", f"one of {_DTYPES}", p["dtype"])
        numels.append(math.prod(_uint(x, f"{w}.shape[{j}]")
                                for j, x in enumerate(_list(p["shape"], f"{w}.shape"))))
    for j, piece in enumerate(_list(share["pieces"], "share.pieces", n)):
        index, start = _list(piece, f"share.pieces[{j}]", 2)
        _need(_is_int(index) and 0 <= index < len(users), f"share.pieces[{j}][0]",
              f"a user parameter index below {len(users)}", index)
        _uint(start, f"share.pieces[{j}][1]")
    listed = [i for g, ids in enumerate(_list(share["group_params"], "share.group_params"))
              for i in _list(ids, f"share.group_params[{g}]")]
    _need(sorted(listed) == list(range(len(users))), "share.group_params",
          f"the user parameters 0..{len(users) - 1}, each once", listed[:8])
    return numels


def _whole_layout(part: dict, w: str, kinds: list) -> None:
    """A whole-parameter rule's dtypes, shapes and containers (layout_of)."""
    for kind, name in _dict(part.get("dtypes", {}), f"{w}.dtypes").items():
        _need(kind in kinds, f"{w}.dtypes", "kinds of the partition", kind)
        _need(name in _STATE_DTYPES, f"{w}.dtypes.{kind}", f"one of {_STATE_DTYPES}", name)
    n = len(part["segments"])
    for j, shapes in enumerate(_list(part.get("shapes", [{}] * n), f"{w}.shapes", n)):
        for kind, shape in _dict(shapes, f"{w}.shapes[{j}]").items():
            _need(kind in kinds, f"{w}.shapes[{j}]", "kinds of the partition", kind)
            for i, dim in enumerate(_list(shape, f"{w}.shapes[{j}].{kind}")):
                _uint(dim, f"{w}.shapes[{j}].{kind}[{i}]")
    for j, nested in enumerate(_list(part.get("nested", [{}] * n), f"{w}.nested", n)):
        for key, t in _dict(nested, f"{w}.nested[{j}]").items():
            _template(t, f"{w}.nested[{j}].{key}", kinds)


def _validate(d: dict, run_dir: str) -> None:
    """Raise _Invalid naming the first field that a tiermem manifest cannot hold."""
    fields = {f for f in Manifest.__dataclass_fields__}
    _need(d.get("version") in READS and _is_int(d.get("version")), "version",
          f"one of {READS}", d.get("version"))
    old = set(V4_FIELDS) if d["version"] < 4 else set()
    _dict(d, "the manifest", fields - old - {k for k in OPTIONAL if k not in d})
    _need(d["durability"] in _DURABILITY, "durability", f"one of {_DURABILITY}", d["durability"])
    _need(isinstance(d["checksums"], bool), "checksums", "true or false", d["checksums"])
    _uint(d["step"], "step")
    crash = d["durability"] == "crash_consistent"
    values = _dict(d.get("values", {}), "values")
    _need(set(values) <= {"groups", "own", "state", "absent"}, "values",
          "an object of groups, own, state and absent", values)
    _need(all(isinstance(x, str) for x in _list(values.get("absent", []), "values.absent")),
          "values.absent", "a list of names", values.get("absent"))
    for g, kept in _dict(values.get("groups", {}), "values.groups").items():
        _need(g.isdigit(), "values.groups", "group indices", g)
        for k, v in _dict(kept, f"values.groups.{g}").items():
            _need(_kept_value(v), f"values.groups.{g}.{k}", "a kept value", v)
    for part in ("own", "state"):
        for k, v in _dict(values.get(part, {}), f"values.{part}").items():
            _need(_kept_value(v), f"values.{part}.{k}", "a kept value", v)

    params = _list(d["params"], "params")
    share = _dict(d.get("share", {}), "share")  # absent from earlier versions' manifests
    numels = _share(share, len(params)) if share else None
    sizes = []
    for i, p in enumerate(params):
        w = f"params[{i}]"
        _dict(p, w)
        extra, missing = set(p) - _PARAM_KEYS - {"scalars", "stride"}, _PARAM_KEYS - set(p)
        if extra or missing:
            raise _Invalid(f"{w} has the wrong fields (missing {sorted(missing)}, unexpected "
                           f"{sorted(extra)})")
        _need(isinstance(p["name"], str), f"{w}.name", "a string", p["name"])
        for key, v in _dict(p.get("scalars", {}), f"{w}.scalars").items():
            # An optimizer's per-parameter values (ASGD's eta, NAdam's mu_product, SOAP's
            # empty preconditioner list of a 1-D parameter, ...): plain JSON values and
            # lists of them, or a 0-d tensor's value with its dtype.
            ok = _host_value(v) or (
                isinstance(v, dict) and set(v) == {"tensor", "dtype"}
                and (_is_num(v["tensor"]) or isinstance(v["tensor"], bool))
                and v["dtype"] in _SCALAR_DTYPES)
            _need(ok, f"{w}.scalars.{key}", "a number, string or list of them, or "
                  "{tensor: number, dtype: ...}", v)
        _need(p["dtype"] in _DTYPES, f"{w}.dtype", f"one of {_DTYPES}", p["dtype"])
        n = 1
        shape = _list(p["shape"], f"{w}.shape")
        for j, dim in enumerate(shape):
            n *= _uint(dim, f"{w}.shape[{j}]")
        if "stride" in p:
            _stride(p["stride"], shape, w)
        sizes.append(n)
    for j, (index, start) in enumerate(d["share"]["pieces"] if numels is not None else ()):
        _need(start + sizes[j] <= numels[index], f"share.pieces[{j}]",
              f"inside user parameter {index} ({numels[index]} elements)", [index, start])
    steps = _list(d["steps"], "steps", len(params))
    for i, s in enumerate(steps):
        _need(_is_num(s) and s >= 0, f"steps[{i}]", "a number >= 0", s)

    _need(isinstance(d["rule"], str) and _KIND_NAME.match(d["rule"]) is not None, "rule",
          "the name of an update rule", d["rule"])
    adam = d["rule"] == "AdamRule"  # a run recover writes a checkpoint of
    groups = _list(d["groups"], "groups")
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        w = f"groups[{g}]"
        _dict(group, w)
        for k, v in group.items():
            if k == "params":
                for j, i in enumerate(_list(v, f"{w}.params")):
                    _need(_is_int(i) and 0 <= i < len(params) and i not in owner,
                          f"{w}.params[{j}]", f"a parameter index below {len(params)} "
                          "that no other group lists", i)
                    owner[i] = g
            elif k == "betas" and adam:
                _need(isinstance(v, list) and len(v) == 2 and
                      all(_is_num(b) and 0 <= b < 1 for b in v), f"{w}.betas",
                      "two numbers in [0, 1)", v)
            elif k == "betas":  # Adan's three, AggMo's any number
                _need(isinstance(v, list) and len(v) > 0 and all(_is_num(b) for b in v),
                      f"{w}.betas", "a list of numbers", v)
            elif k == "eps" and isinstance(v, list) and not adam:  # Adafactor's eps pair
                _need(all(x is None or (_is_num(x) and x >= 0) for x in v), f"{w}.{k}",
                      "a number >= 0, or a list of them (or null)", v)
            elif k in _NUM_GROUP_KEYS:
                _need(_is_num(v) and v >= 0, f"{w}.{k}", "a number >= 0", v)
            elif k in _BOOL_GROUP_KEYS:
                _need(isinstance(v, bool), f"{w}.{k}", "true or false", v)
            elif k in _OPTIONAL_BOOL_GROUP_KEYS:
                _need(v is None or isinstance(v, bool), f"{w}.{k}", "true, false or null", v)
            elif adam:
                _need(_json_scalar(v), f"{w}.{k}", "a number, string, boolean or null", v)
            else:  # other optimizers' values, as state_io.jsonable writes them: JSON
                # scalars in lists of any depth (torch_optimizer's RAdam keeps a cache of
                # [step, N_sma, step_size] lists in its group, which its step rewrites)
                _need(_json_nest(v), f"{w}.{k}",
                      "a number, string, boolean or null, or lists of them", v)
        missing = [k for k in _REQUIRED_GROUP_KEYS if k not in group]
        _need(not missing, w, f"an object with {', '.join(_REQUIRED_GROUP_KEYS)}",
              f"no {', '.join(missing)}")
        if adam:  # recover hands these on to torch's Adam: none may be missing
            missing = [k for k in _ADAM_GROUP_KEYS if k not in group]
            _need(not missing, w, f"an Adam group, with {', '.join(_ADAM_GROUP_KEYS)}",
                  f"no {', '.join(missing)}")
    _need(len(owner) == len(params), "groups", f"to list each of the {len(params)} parameters",
          sorted(set(range(len(params))) - set(owner))[:8])
    # The defaults are whatever the optimizer's constructor kept (a third-party one's may
    # be any value state_io.jsonable writes): JSON, checked for what it is where it is
    # used (swap/recover.py: the value an eager rule's state starts from).
    for k, v in _dict(d.get("defaults", {}), "defaults").items():
        _need(_json_nest(v), f"defaults.{k}", "a number, string, boolean or null, or lists "
              "of them", v)
    for key in ("stateless", "unstepped_state"):
        listed = _list(d.get(key, []), key)
        for j, i in enumerate(listed):
            _need(_is_int(i) and 0 <= i < len(params) and steps[i] == 0, f"{key}[{j}]",
                  f"the index of a parameter never stepped (below {len(params)})", i)
        _need(len(set(listed)) == len(listed), key, "without repeats", listed)
    # (a parameter holds state or it does not: listed in both, recover and resume would
    # each pick one)
    both = sorted(set(d.get("stateless", [])) & set(d.get("unstepped_state", [])))
    _need(not both, "unstepped_state", "no parameter the stateless list names", both)
    laid: list[int] = []
    at = 0
    for j, lay in enumerate(_list(d.get("late", []), "late")):
        lay = _dict(lay, f"late[{j}]", {"at", "params"})
        _need(_is_int(lay["at"]) and at <= lay["at"] <= len(d["partitions"]),
              f"late[{j}].at", f"a partition count from {at} to {len(d['partitions'])}",
              lay["at"])
        at = lay["at"]
        batch = _list(lay["params"], f"late[{j}].params")
        _need(bool(batch), f"late[{j}].params", "a non-empty list", batch)
        for i in batch:
            _need(_is_int(i) and 0 <= i < len(params), f"late[{j}].params",
                  f"parameter indices (below {len(params)})", batch)
        laid += batch
    _need(len(set(laid)) == len(laid), "late", "each parameter once", d.get("late"))

    parts = _list(d["partitions"], "partitions")
    covered = [0] * len(params)
    for k, part in enumerate(parts):
        w = f"partitions[{k}]"
        _dict(part, w)
        extra, missing = set(part) - _PART_KEYS - _WHOLE_KEYS, _PART_KEYS - set(part)
        if extra or missing:
            raise _Invalid(f"{w} has the wrong fields (missing {sorted(missing)}, unexpected "
                           f"{sorted(extra)})")
        _need(part["id"] == k and _is_int(part["id"]), f"{w}.id", f"{k} (partitions in order)",
              part["id"])
        _need(_is_int(part["group"]) and 0 <= part["group"] < len(groups), f"{w}.group",
              f"a group index below {len(groups)}", part["group"])
        _need(part["tier"] in _TIERS, f"{w}.tier", f"one of {_TIERS}", part["tier"])
        kinds = _list(part["kinds"], f"{w}.kinds")
        # Any update rule's state names (Adam's, the torch family's, an optimizer's own).
        names_ok = all(isinstance(x, str) and _KIND_PATH.match(x) and (not adam or x in _KINDS)
                       for x in kinds)
        _need(len(kinds) > 0 and names_ok and len(set(kinds)) == len(kinds), f"{w}.kinds",
              f"distinct names from {_KINDS}" if adam else "distinct state names", kinds)
        total = nblocks = 0
        for j, seg in enumerate(_list(part["segments"], f"{w}.segments")):
            sw = f"{w}.segments[{j}]"
            index, start, length = _list(seg, sw, 3)
            _need(_is_int(index) and 0 <= index < len(params), f"{sw}[0]",
                  f"a parameter index below {len(params)}", index)
            _need(owner.get(index) == part["group"], f"{sw}[0]",
                  f"a parameter of group {part['group']}", index)
            _uint(start, f"{sw}[1]")
            _uint(length, f"{sw}[2]")
            _need(start + length <= sizes[index], sw,
                  f"inside parameter {index} ({sizes[index]} elements)", seg)
            covered[index] += length
            total += length
            nblocks += blocks(length)
        _whole_layout(part, w, kinds)
        _need(part["numel"] == total and _is_int(part["numel"]), f"{w}.numel",
              f"{total}, the sum of its segments", part["numel"])
        _uint(part["record_bytes"], f"{w}.record_bytes")
        _need(isinstance(part["moment_dtype"], str) and part["moment_dtype"] in _MOMENT_DTYPES,
              f"{w}.moment_dtype",
              f"one of {tuple(_MOMENT_DTYPES)}", part["moment_dtype"])
        if adam:
            # Adam's layout follows from kinds and numel; other rules' records may hold state
            # of other sizes, which resume checks against the live layout instead.
            fits = record_layout(total, kinds, _MOMENT_DTYPES[part["moment_dtype"]],
                                 {k: nblocks for k in kinds if k in SCALE_KINDS})[1]
            _need(part["record_bytes"] == fits and _is_int(part["record_bytes"]),
                  f"{w}.record_bytes", f"{fits}, what its kinds and numel lay out",
                  part["record_bytes"])
    # a parameter frozen when the block opened has no partition, and never stepped
    bad = [i for i, (c, n) in enumerate(zip(covered, sizes))
           if c != n and (c or d["steps"][i])]
    _need(not bad, "partitions", "to cover every element of every parameter once (or, "
          "of a parameter never stepped, none)", f"parameters {bad[:8]} are not")
    ids = {str(p["id"]) for p in parts}

    fresh = _list(d["fresh"], "fresh")
    for j, pid in enumerate(fresh):
        _need(_is_int(pid) and str(pid) in ids, f"fresh[{j}]", "a partition id", pid)
    _need(len(set(fresh)) == len(fresh), "fresh", "without repeats", fresh)

    files = _list(d["files"], "files")
    here = os.path.realpath(run_dir)
    for j, f in enumerate(files):
        _need(isinstance(f, str), f"files[{j}]", "a path", f)
        _check_file(f, j, here)
    if files:
        # The run directory's own file is the one beside this manifest, wherever the
        # directory now is: a run directory moved or copied whole (to another mount, off
        # a failing node) still resumes and recovers, from its own file, never from the
        # path it was written at (where another run may live now).
        d["files"] = [os.path.join(here, STATE_FILE), *files[1:]]

    gens = _dict(d["generations"], "generations")
    copies = _dict(d["copies"], "copies")
    records = _dict(d["records"], "records")
    for pid, g in gens.items():
        _need(pid in ids, f"generations[{pid!r}]", "keyed by a partition id", pid)
        _uint(g, f"generations[{pid!r}]")
    for pid, c in copies.items():
        _need(pid in ids, f"copies[{pid!r}]", "keyed by a partition id", pid)
        _need(c in (0, 1) and _is_int(c), f"copies[{pid!r}]", "0 or 1", c)
    by_id = {str(p["id"]): p for p in parts}
    for pid, r in records.items():
        w = f"records[{pid!r}]"
        _need(pid in ids, w, "keyed by a partition id", pid)
        file, offset, nbytes = _list(r, w, 3)
        _need(_is_int(file) and 0 <= file < len(files), f"{w}[0]",
              f"a file index below {len(files)}", file)
        _uint(offset, f"{w}[1]")
        want = by_id[pid]["record_bytes"] + (FOOTER_BYTES if d["checksums"] else 0)
        _need(nbytes == want and _is_int(nbytes), f"{w}[2]",
              f"{want}, the record's bytes{' and footer' if d['checksums'] else ''}", nbytes)
    if crash:
        # Every record lives on disk: each partition needs its place, copy and generation.
        for what, table in (("records", records), ("generations", gens), ("copies", copies)):
            _need(set(table) == ids, what, "an entry for every partition",
                  sorted(ids ^ set(table), key=int)[:8])

    resident = _list(d["resident"], "resident")
    for j, e in enumerate(resident):
        w = f"resident[{j}]"
        _dict(e, w, {"id", "offset", "nbytes"})
        _need(_is_int(e["id"]) and str(e["id"]) in ids, f"{w}.id", "a partition id", e["id"])
        _uint(e["offset"], f"{w}.offset")
        _uint(e["nbytes"], f"{w}.nbytes")


def same_dir(a: str, b: str) -> bool:
    """Whether paths a and b are one directory (False where either is gone)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_stale_paths(dirs: Sequence[str], m: Manifest, doing: str) -> None:
    """Refuse to read a moved run's other swap paths where it wrote them. `dirs`: the run
    directories about to be read, per swap path, the first the manifest's own. When that
    one is not where the manifest was written (the run was moved or copied), a directory
    of another swap path still at its written place is stale or another run's as likely
    as it is this run's: the copy there may be older (with checksums off nothing tells
    it apart), so every path must be given where the run is now."""
    written = [os.path.dirname(f) for f in getattr(m, "written_files", m.files)]
    if len(written) < 2 or same_dir(written[0], dirs[0]):
        return
    for j in range(1, min(len(dirs), len(written))):
        if same_dir(dirs[j], written[j]):
            raise TierMemError(
                f"cannot {doing} {dirs[0]}: it was written at {written[0]} (moved or copied "
                f"since), and swap path {j} is still where that run wrote it ({written[j]}), "
                "whose files may be an older copy or another run's: tiermem does not read "
                "them there. Move or copy that path's run directory along with the first, "
                "and give where each is now")


def _check_file(f: str, j: int, run_dir: str) -> None:
    """A swap file must be STATE_FILE in a run directory of this one's name: files[0] this
    directory's own, where it was written (the reader takes the one beside the manifest),
    the others under other swap paths (absolute, normalised, no links on the way)."""
    where = f"files[{j}]"
    _need(os.path.isabs(f) and os.path.normpath(f) == f and "\x00" not in f, where,
          "an absolute, normalised path", f)
    parent = os.path.dirname(f)
    _need(os.path.basename(f) == STATE_FILE and
          os.path.basename(parent) == os.path.basename(run_dir), where,
          f"{STATE_FILE} in a run directory named {os.path.basename(run_dir)!r}", f)
