"""YAML config -> typed, validated settings.

One dataclass per section, each field with a one-line doc, `Literal` for
choices and `Size` for byte counts that accept "512MiB"-style strings. The
dataclass defaults are the embedded default config (`configs/default.yaml`
spells them out with comments). Every problem is a ConfigError naming the key
path, the value found and what is allowed, raised before anything is pinned or
written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union

import yaml

from tiermem.errors import TierMemError
from tiermem.sizes import format_size, parse_size, yaml_size
from tiermem.sysinfo import physical_memory


class ConfigError(TierMemError, ValueError):
    """A config value is wrong; the message names the key path, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        super().__init__(f"config key '{key}': got {value!r}; {allowed}")
        self.key = key
        self.value = value
        self.allowed = allowed


class _SizeMarker:
    """Annotated marker: a byte count, accepting '512MiB'-style strings."""


Size = Annotated[int, _SizeMarker()]


def doc(text: str, *, lo: float | None = None, hi: float | None = None,
        multiple_of: int | None = None, **kw: Any) -> Any:
    """A dataclass field carrying its one-line doc and bounds."""
    meta = {"doc": text, "lo": lo, "hi": hi, "multiple_of": multiple_of}
    return field(metadata=meta, **kw)


DEFAULT_SWAP_DIR = "~/.cache/tiermem/swap"


@dataclass(frozen=True)
class SwapSettings:
    """Where NVMe-tier state lives."""

    paths: list[str] = doc("Swap directories on local NVMe drives; several are striped over.",
                           default_factory=lambda: [DEFAULT_SWAP_DIR])
    checksums: bool = doc("CRC32C checksum, partition id and generation on every NVMe record, "
                          "checked on every read.", default=True)
    durability: Literal["scratch", "crash_consistent"] = doc(
        "scratch: swap files are working space, lost with a crashed run; crash_consistent: "
        "every step is committed to disk (two slots per record, a manifest, fp32 weights "
        "too), so a resume after kill -9 restores the last committed step.",
        default="scratch")

    def validate(self) -> None:
        if not self.paths:
            raise ConfigError("swap.paths", self.paths, "give at least one directory")


@dataclass(frozen=True)
class IOSettings:
    """How the I/O engine moves bytes."""

    backend: Literal["auto", "io_uring", "threads"] = doc(
        "I/O backend; auto probes io_uring and falls back to threads with a warning.",
        default="auto")
    queue_depth: int = doc("Block requests kept in flight per engine; io_uring: per "
                           "direction (reads, writes).", lo=1, hi=4096, default=32)
    block_size: Size = doc("Bytes per block request; transfers are split into these.",
                           lo=4096, hi=1 << 30, multiple_of=4096, default=1 << 20)
    retries: int = doc("Times a failed NVMe read or write is reissued before it is an error "
                       "(the disk copy, or the buffer, still holds the record).", lo=0, hi=10,
                       default=2)
    o_direct: Literal["auto", True, False] = doc(
        "O_DIRECT on swap files: true requires it, auto falls back to buffered I/O with a "
        "warning on filesystems that refuse it.", default="auto")


@dataclass(frozen=True)
class TierSettings:
    """One memory tier's budget."""

    capacity: Size = doc("Bytes of optimizer state this tier may hold.", default=0)


@dataclass(frozen=True)
class TiersSettings:
    """Budgets per tier; what fits in neither lives on NVMe."""

    gpu: TierSettings = doc("State kept on the compute device (needs CUDA when > 0).",
                            default_factory=TierSettings)
    host: TierSettings = doc("State kept resident in pinned host memory.",
                             default_factory=lambda: TierSettings(2 << 30))


@dataclass(frozen=True)
class PipelineSettings:
    """How NVMe-homed partitions stream through pinned buffers."""

    partition_size: Size = doc("Bytes of state per partition (its record on its tier).",
                               lo=64 << 10, hi=16 << 30, default=64 << 20)
    buffer_count: int = doc("Pinned host buffers that NVMe partitions stream through.",
                            lo=2, hi=4096, default=4)
    prefetch_depth: int = doc("Partitions read ahead of the one being computed.",
                              lo=1, hi=4095, default=2)
    zigzag: bool = doc("Reverse the partition order every step so the partitions still in "
                       "buffers come first and need no read.", default=True)
    write_back: Literal["deferred", "immediate"] = doc(
        "deferred: the records a step visits last stay unwritten in their buffers, where "
        "zig-zag has the next step update them first, and reach the disk when a buffer is "
        "reused, on flush or at a checkpoint (scratch durability; crash_consistent always "
        "writes every step); immediate: every update is written back at once.",
        default="deferred")
    overlap_backward: bool = doc(
        "Start each partition's update during backward, as soon as its gradients are final "
        "(docs/guide/overlap.md); the order then follows the gradients and zigzag has no effect.",
        default=False)

    def validate(self) -> None:
        if self.buffer_count < self.prefetch_depth + 1:
            raise ConfigError(
                "pipeline.buffer_count", self.buffer_count,
                f"must be at least prefetch_depth + 1 = {self.prefetch_depth + 1} (one buffer "
                "computes while prefetch_depth are read; +2 also overlaps the write-back)")


@dataclass(frozen=True)
class PlacementRule:
    """Sends the state of parameters whose name matches to one tier."""

    match: str = doc("fnmatch pattern on parameter names (needs model= in offload()).",
                     default="*")
    tier: Literal["gpu", "host", "nvme"] = doc("Tier for matching parameters' state.",
                                               default="nvme")


@dataclass(frozen=True)
class OptimizerSettings:
    """How the update runs."""

    kernel: Literal["auto", "fused", "match", "native"] = doc(
        "auto: the fastest kernel that holds the parity tests (Adam/AdamW: native updated on "
        "the CPU, fused elsewhere; the torch family: what the plain optimizer runs, or "
        "tiermem's native SGD/Adagrad where it equals that bitwise); fused: torch's fused "
        "kernel on each partition; match: "
        "the same implementation the wrapped optimizer would run (bitwise parity); native: "
        "tiermem's SIMD kernel (native/adam.c, bitwise fused where it knows torch's scalar tail, else within 1e-6).", default="auto")
    state_dtype: Literal["fp32", "bf16", "int8"] = doc(
        "Storage of exp_avg, exp_avg_sq (and max_exp_avg_sq): bf16 keeps 2 bytes per "
        "moment instead of 4, int8 1 byte plus an fp32 scale per 256 (blockwise 8-bit codes; "
        "no amsgrad); both run the update in tiermem's native CPU kernels whatever "
        "optimizer.kernel says (int8 records off the host: its torch equivalent; "
        "docs/guide/numerics.md).", default="fp32")
    state_rounding: Literal["stochastic", "nearest"] = doc(
        "How bf16 or int8 state is rounded when stored: stochastic (unbiased, seeded by step "
        "and parameter, at the element's place in it) or nearest (even); ignored with fp32 "
        "state.", default="stochastic")
    master_weights: Literal["fp32", "kahan", "none"] = doc(
        "What a bf16 or fp16 parameter's record keeps of its weight: fp32 (a master copy), "
        "kahan (a compensation term in the parameter's dtype: the update runs on weight + "
        "term, the rounding error is kept) or none (the weight is updated and rounded back "
        "stochastically); kahan and none run with any state_dtype (amsgrad with fp32 or bf16 "
        "moments; not with kernel match) in tiermem's kernels.lowbit pass whatever "
        "optimizer.kernel says, and with crash_consistent durability the records also keep "
        "the weights (2 B/param); fp32 parameters are their own master whatever it says.",
        default="fp32")
    update_threads: int = doc(
        "Threads of tiermem's native CPU update pass; 0 (auto): torch's thread count, or one "
        "less where that measured faster on steps that wait on NVMe longer than their "
        "updates run (the I/O engine then gets a core of its own; an update with no "
        "transfer beside it still takes every thread; docs/guide/tuning.md).",
        lo=0, hi=1024, default=0)
    step_device: Literal["cpu", "device"] = doc(
        "Where a CUDA model's host/NVMe-homed partitions are updated: cpu (grads copied to "
        "pinned host buffers, updated weights copied back; ZeRO-Offload) or device (records "
        "streamed to the GPU through two device buffers, torch's fused Adam there); "
        "docs/guide/gpu.md.", default="cpu")

    def validate(self) -> None:
        if self.step_device == "device" and (self.kernel == "native"
                                             or self.state_dtype == "bf16"):
            # Both run tiermem's native kernel only, which updates host memory. (int8 state
            # has a torch kernel for device memory: kernels.lowbit's reference.)
            key, value = (("optimizer.kernel", self.kernel) if self.kernel == "native"
                          else ("optimizer.state_dtype", self.state_dtype))
            raise ConfigError(
                key, value, "with optimizer.step_device device use optimizer.kernel auto, fused "
                "or match and optimizer.state_dtype fp32 or int8 (the native kernel and bf16 "
                "state run on the CPU); or set optimizer.step_device: cpu")
        if self.state_dtype != "fp32" and self.kernel == "match":
            # match promises bitwise parity with the wrapped optimizer, which keeps
            # fp32 moments: no bf16 store can keep that promise.
            raise ConfigError(
                "optimizer.kernel", self.kernel,
                f"with optimizer.state_dtype {self.state_dtype} use auto, fused or native (the "
                "update then runs tiermem's native kernel); match promises bitwise parity with "
                "the wrapped optimizer's fp32 state")
        if self.master_weights != "fp32" and self.kernel == "match":
            # kahan/none run kernels.lowbit on the bf16 weights: no torch optimizer updates
            # them that way, so match's bitwise promise cannot hold.
            raise ConfigError(
                "optimizer.kernel", self.kernel,
                f"with optimizer.master_weights {self.master_weights} use auto, fused or "
                "native (bf16 weights without an fp32 master run tiermem's kernels.lowbit); "
                "match promises bitwise parity with the wrapped optimizer's fp32 master")


@dataclass(frozen=True)
class DistributedSettings:
    """How ranks share the optimizer state under torch.distributed (docs/guide/distributed.md)."""

    grads: Literal["reduce_scatter", "allreduced"] = doc(
        "reduce_scatter: tiermem averages the gradients over the ranks, each receiving its "
        "share; allreduced: they are already averaged on every rank (DDP), each rank reads "
        "its share in place. FSDP2 (DTensor) parameters ignore it.", default="reduce_scatter")
    bucket_size: Size = doc("Bytes of one rank's gradients (or updated weights) per "
                            "collective; two buckets are in flight at a time.",
                            lo=4096, hi=16 << 30, default=32 << 20)
    timeout: float = doc("Seconds a rank waits for the others in a collective before it "
                         "raises an error naming the ranks that failed or fell behind.",
                         lo=0.1, hi=86400, default=600.0)


@dataclass(frozen=True)
class ParameterSettings:
    """Where the model's weights and gradients live between uses (docs/guide/parameters.md)."""

    offload: Literal["none", "host", "nvme"] = doc(
        "none: weights and grads stay where the model put them; host: in pinned host "
        "records; nvme: in swap files; either way materialised module by module by hooks, "
        "needs model= in offload().", default="none")
    prefetch: int = doc("Modules whose weights are fetched ahead of the one running, in the "
                        "order learned from the first iteration.", lo=0, hi=1024, default=2)
    window: Size = doc("Bytes of materialised weights (and gradients the step reads) at "
                       "most (device memory for a CUDA model); must hold the largest module "
                       "and one optimizer partition's weights and grads; reads ahead only "
                       "what fits.",
                       lo=4096, hi=1 << 50, default=2 << 30)


@dataclass(frozen=True)
class Settings:
    """A whole tiermem config."""

    swap: SwapSettings = doc("Swap locations.", default_factory=SwapSettings)
    io: IOSettings = doc("I/O engine.", default_factory=IOSettings)
    tiers: TiersSettings = doc("Tier budgets.", default_factory=TiersSettings)
    pipeline: PipelineSettings = doc("NVMe streaming.", default_factory=PipelineSettings)
    placement: list[PlacementRule] = doc("Rules, first match wins; unmatched state fills "
                                         "gpu -> host -> nvme within budgets.",
                                         default_factory=list)
    optimizer: OptimizerSettings = doc("Update kernel, state dtype and step device.",
                                       default_factory=OptimizerSettings)
    distributed: DistributedSettings = doc("Sharding under torch.distributed.",
                                           default_factory=DistributedSettings)
    parameters: ParameterSettings = doc("Weights and gradients in the tiers.",
                                        default_factory=ParameterSettings)

    @property
    def defers_writes(self) -> bool:
        """Whether the NVMe pipeline may leave updated records unwritten in its buffers
        (pipeline.write_back: deferred); a crash-consistent step must reach the disk."""
        return self.pipeline.write_back == "deferred" and self.swap.durability == "scratch"

    def validate(self) -> None:
        # A budget above RLIMIT_MEMLOCK is not an error: what cannot be locked stays pageable,
        # with one warning (tiermem.io.buffers), so the defaults work for any user.
        pinned = self.tiers.host.capacity + self.pipeline.buffer_count * self.pipeline.partition_size
        total = physical_memory()
        if pinned > total * 0.9:
            raise ConfigError(
                "tiers.host.capacity", self.tiers.host.capacity,
                f"host tier + pipeline buffers ({format_size(pinned)}) exceed 90% of this "
                f"machine's memory ({format_size(total)})")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is Annotated:
        return "a size (bytes, or a string like '512MiB')"
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:  # `True == 1` in Python: compare types too
            if value == c and type(value) is type(c):
                return c
        raise ConfigError(key, value, f"allowed: {_describe(tp)}")
    if origin is Annotated:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(key, value, f"expected {_describe(tp)} ({exc})") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, value, f"expected {_describe(tp)}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _convert(arm, value, key)
            except ConfigError:
                pass
        raise ConfigError(key, value, f"expected {_describe(tp)}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not (type(value) is tp):
        raise ConfigError(key, value, f"expected {_describe(tp)}")
    return value


def _check_bounds(f: dataclasses.Field, value: Any, key: str) -> None:
    lo, hi, mult = f.metadata.get("lo"), f.metadata.get("hi"), f.metadata.get("multiple_of")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(key, value, f"allowed range {lo}..{hi}")
    if mult and value % mult:
        raise ConfigError(key, value, f"must be a multiple of {mult}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(prefix or "<root>", data, f"expected {_describe(cls)}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            where = f"{prefix}.{k}" if prefix else str(k)
            raise ConfigError(where, data[k], f"unknown key; allowed here: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key = f"{prefix}.{name}" if prefix else name
        values[name] = _convert(hints[name], data[name], key)
        _check_bounds(f, values[name], key)
    out = cls(**values)
    check = getattr(out, "validate", None)
    if check is not None:
        check()
    return out


def load_config(source: "str | os.PathLike | Mapping[str, Any] | Settings | None" = None
                ) -> Settings:
    """Validated Settings from a YAML path, a dict of the same shape, Settings, or None (defaults)."""
    if isinstance(source, Settings):
        return source
    if source is None:
        return Settings()
    if isinstance(source, Mapping):
        return _build(Settings, source, "")
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError("<root>", source, "expected a YAML path, a mapping or Settings")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigFileError(path, f"cannot read it: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(path, _yaml_problem(exc)) from None
    try:
        return _build(Settings, data, "")
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.value, f"{exc.allowed} (in {path})") from None


class ConfigFileError(ConfigError):
    """The config file cannot be read or parsed; the message names the file and the place."""

    def __init__(self, path: "str | os.PathLike", why: str) -> None:
        TierMemError.__init__(self, f"config file {path}: {why}")
        self.key, self.value, self.allowed = "<file>", str(path), why


def _yaml_problem(exc: Exception) -> str:
    """PyYAML names the stream '<unicode string>'; say line, column and the problem only."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"not valid YAML at {where}{problem}" + (f" ({context})" if context else "")


def as_yaml_data(value: Any, tp: Any = Settings) -> Any:
    """Settings as plain YAML data, sizes spelled '30GiB' (loading it gives the same
    Settings)."""
    if dataclasses.is_dataclass(value):
        hints = typing.get_type_hints(type(value), include_extras=True)
        return {f.name: as_yaml_data(getattr(value, f.name), hints[f.name])
                for f in dataclasses.fields(value)}
    if typing.get_origin(tp) is Annotated:
        text = yaml_size(value)
        return int(text) if text.isdigit() else text
    if isinstance(value, list):
        args = typing.get_args(tp)
        return [as_yaml_data(v, args[0] if args else Any) for v in value]
    return value


def to_yaml(settings: Settings) -> str:
    return yaml.safe_dump(as_yaml_data(settings), sort_keys=False, default_flow_style=False)


SHIPPED = Path(__file__).resolve().parent / "configs"  # package data: installed with tiermem


def shipped_configs() -> dict[str, Path]:
    """The example configs installed with the package (`tiermem init-config NAME` copies one;
    `load_config(shipped_configs()["nvme"])` loads one)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.yaml"))}


def swap_dir(settings: Settings) -> str:
    """The first swap directory, with ~ and $VARS expanded."""
    return os.path.expandvars(os.path.expanduser(settings.swap.paths[0]))


def reference(cls: type = Settings, prefix: str = "",
              defaults: Any = None) -> list[tuple[str, str, str, str]]:
    """(key path, allowed values, default, doc) for every config key, in file order."""
    rows = []
    hints = typing.get_type_hints(cls, include_extras=True)
    defaults = cls() if defaults is None else defaults
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(tp):
            rows += reference(tp, key, value)
            continue
        allowed = _describe(tp)
        lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
        if lo is not None or hi is not None:
            allowed += f", {lo}..{hi}"
        if f.metadata.get("multiple_of"):
            allowed += f", multiple of {f.metadata['multiple_of']}"
        shown = yaml_size(value) if typing.get_origin(tp) is Annotated else json.dumps(value)
        rows.append((key, allowed, shown, f.metadata.get("doc", "")))
        origin_args = typing.get_args(tp)
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(origin_args[0]):
            rows += reference(origin_args[0], f"{key}[]")
    return rows


def reference_markdown() -> str:
    """The config reference as a markdown table (docs/guide/config.md is generated from it)."""
    lines = ["| key | allowed | default | meaning |", "|---|---|---|---|"]
    for key, allowed, default, text in reference():
        lines.append(f"| `{key}` | {allowed} | `{default}` | {text} |")
    return "\n".join(lines)
