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
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tiermem.errors import TierMemError
from tiermem.swap.integrity import check
from tiermem.swap.manifest import RESIDENT_FILE, Manifest, read_manifest
from tiermem.kernels.lowbit import dequantize
from tiermem.partition import SCALE_KINDS, Partition, Segment, low_weight_dtypes

FORMAT = "tiermem-recover-1"
# Rules whose records hold one value per element of each state kind, under torch's own
# key names (optim/rules: adam, torch_family): the checkpoint follows from the manifest.
# tests/test_optimizer_recover.py keeps these in step with the rules.
ELEMENTWISE_RULES = {"AdamRule", "SGDRule", "AdagradRule", "RMSpropRule", "AdamaxRule",
                     "NAdamRule", "RAdamRule", "AdadeltaRule", "ASGDRule", "RpropRule"}
NO_STEP_RULES = {"SGDRule"}  # torch keeps no "step" count in their state
# torch builds these rules' state when the optimizer is made: kind -> the group value it
# starts at
EAGER_RULES = {"AdagradRule": {"sum": "initial_accumulator_value"}}
# kinds that hold weights, not torch state: an fp32 master, the bf16 weights a record keeps
# without one (master_weights kahan/none, crash-consistent) and their Kahan term
WEIGHT_KINDS = ("master", "weight", "kahan")


def _scalar(value: Any) -> Any:
    """A per-parameter scalar as the manifest keeps it (a number, or a 0-d tensor with its
    dtype) back as torch's state holds it."""
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=_dtype(value["dtype"]))
    return value


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TierMemError(f"manifest names an unknown parameter dtype {name!r}")
    return dtype


def _partition(entry: dict, params: list[dict]) -> Partition:
    segs = [Segment(None, index, start, length) for index, start, length in entry["segments"]]
    kinds = tuple(entry["kinds"])
    # an fp16 model's weights and Kahan term are fp16 in the record (one dtype a partition)
    dtypes = (low_weight_dtypes(kinds, _dtype(params[segs[0].index]["dtype"]))
              if segs and segs[0].index < len(params) else {})
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


def gather(run_dir: str) -> dict[str, Any]:
    """The checkpoint dict of the state committed in `run_dir` (see the module doc)."""
    m = read_manifest(run_dir, None)
    if not m.params:
        raise TierMemError(f"cannot recover: the manifest in {run_dir} lists no parameters")
    if m.rule not in ELEMENTWISE_RULES:
        # A whole-parameter rule's records hold state of the optimizer's own shapes (the
        # manifest does not say which): refused rather than written wrong.
        raise TierMemError(
            f"cannot recover {run_dir}: tiermem recover writes checkpoints of runs of Adam, "
            f"AdamW and torch's elementwise optimizers ({', '.join(sorted(ELEMENTWISE_RULES))}"
            f"), and this run's state is {m.rule}'s; resume it with "
            "tiermem.offload(..., resume=True) and save optimizer.state_dict()")
    has_step, eager = m.rule not in NO_STEP_RULES, m.rule in EAGER_RULES
    names = [p["name"] or f"param.{i}" for i, p in enumerate(m.params)]
    group_of = {i: g for g, group in enumerate(m.groups) for i in group["params"]}
    state: dict[int, dict[str, Any]] = {}
    weights: dict[int, torch.Tensor] = {}
    parts = [_partition(e, m.params) for e in m.partitions]
    kinds_of = {s.index: part.kinds for part in parts for s in part.segments}
    for i, step in enumerate(m.steps):
        if step == 0 and not eager:
            continue  # never stepped: torch keeps no state for it either
        shape = m.params[i]["shape"]
        st: dict[str, Any] = {"step": torch.tensor(float(step))} if has_step else {}
        st.update({k: _scalar(v) for k, v in (m.params[i].get("scalars") or {}).items()})
        for k in kinds_of.get(i, ()):
            if k not in WEIGHT_KINDS and k not in SCALE_KINDS:
                # never stepped (Adagrad builds its state when made): torch's starting value
                fill = m.groups[group_of[i]].get(EAGER_RULES.get(m.rule, {}).get(k), 0.0)
                st[k] = torch.full(shape, float(fill) if step == 0 else 0.0,
                                   dtype=torch.float32)
        if m.params[i]["dtype"] != "float32" and (
                {"master", "weight"} & set(kinds_of.get(i, ()))):
            st["master_param"] = torch.zeros(shape, dtype=torch.float32)
        if st:  # SGD without momentum keeps nothing
            state[i] = st
    for i, p in enumerate(m.params):
        if {"master", "weight"} & set(kinds_of.get(i, ())):
            weights[i] = torch.zeros(p["shape"], dtype=torch.float32)
    fresh = set(m.fresh)
    records = _Records(run_dir, m)
    try:
        for part in parts:
            if part.id in fresh:
                continue
            views = part.views(records.read(part))
            scale_of = {moment: k for k, moment in SCALE_KINDS.items() if k in views}
            slices = {k: part.slices(k) for k in views}
            for n, s in enumerate(part.segments):
                if m.steps[s.index] == 0 and s.index not in weights:
                    continue  # never stepped: the starting state set above
                # in record order: a "weight" kind comes before its "kahan" term
                for k, src in views.items():
                    if k in SCALE_KINDS:
                        continue
                    sl = slices[k][n]
                    value = src[sl]
                    if k in scale_of:  # int8 codes: the fp32 moments torch keeps
                        value = dequantize(value, views[scale_of[k]][slices[scale_of[k]][n]],
                                           signed=k == "exp_avg")
                    if k in ("master", "weight") and s.index in weights:
                        weights[s.index].view(-1)[s.start: s.start + s.length].copy_(value)
                    if m.steps[s.index] == 0:
                        continue
                    st = state.get(s.index, {})
                    if k == "kahan":
                        if "master_param" in st:  # weight + term, in fp32, as the update
                            w = st["master_param"].view(-1)[s.start: s.start + s.length]
                            w.copy_(w + value.float())
                        continue
                    key = "master_param" if k in ("master", "weight") else k
                    if key in st:
                        st[key].view(-1)[s.start: s.start + s.length].copy_(value)
    finally:
        records.close()
    for i, st in state.items():
        if "master_param" in st and m.steps[i] == 0 and i in weights:
            st["master_param"] = weights[i].clone()  # never stepped: the weights as they are
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g) for g in m.groups]
    out: dict[str, Any] = {"format": FORMAT, "step": m.step, "durability": m.durability,
                           "optimizer": {"state": state, "param_groups": groups}}
    if len(weights) == len(m.params):
        out["model"] = {names[i]: weights[i] for i in range(len(m.params))}
    return out


def recover(run_dir: str, out_path: str) -> dict[str, Any]:
    """Write the checkpoint of `run_dir` to `out_path` (atomically); returns a summary."""
    ckpt = gather(run_dir)
    tmp = out_path + ".tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, out_path)
    nbytes = sum(t.numel() * t.element_size() for st in ckpt["optimizer"]["state"].values()
                 for t in st.values() if isinstance(t, torch.Tensor))
    nbytes += sum(t.numel() * t.element_size() for t in ckpt.get("model", {}).values())
    return {"step": ckpt["step"], "durability": ckpt["durability"],
            "parameters": sum(len(g["params"]) for g in ckpt["optimizer"]["param_groups"]),
            "with_state": len(ckpt["optimizer"]["state"]), "has_model": "model" in ckpt,
            "bytes": nbytes, "path": out_path}
