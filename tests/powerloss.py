"""Simulated power losses for swap.durability: crash_consistent (CrashMonkey/ALICE style).

A run trains in this process while every operation its durability depends on
is recorded, in order, into a trace:

* record writes, at the I/O backend seam (a wrapper around whichever backend the
  engine starts, io_uring or threads): file, offset, the bytes, and when Python
  first saw the write complete;
* everything else through tiermem.swap.fsops (a recording FsOps is installed):
  mkdir, create, truncate, pwrite, fallocate, fsync/fdatasync of a file, fsync of
  a directory, rename, unlink;
* markers when TierManager.commit begins and returns (the promise under test:
  once commit() returned, a power loss must give that step back).

A small model of a disk replays the trace (`Disk`). It tracks, per inode, the
content that is durable and the operations that are not yet (writes, size
changes), and per directory the durable entries and the pending ones (add,
remove, rename). An fsync/fdatasync of a file makes its completed writes and
size changes durable; an fsync of a directory makes its entries durable;
nothing else is durable (strict POSIX, no ext4 auto_da_alloc kindness). A
crash image is the durable state plus any subset of the pending operations,
applied in trace order — which also models out-of-order persistence, since a
later write may be in the subset and an earlier one not — with writes
optionally torn at 4 KiB granularity (any subset of their 4 KiB blocks).

Each image is written out at the original paths, then `tiermem recover` and
`resume=True` must each give a step s with lo <= s <= hi (lo: the last step
whose commit returned, hi: the last step whose commit began) and that step's
state bitwise as plain torch AdamW computes it, or, only while no commit has
returned, refuse with a TierMemError. Anything else is a bad recovery: a wrong
state accepted, a committed step lost or refused, the two disagreeing, or an
exception that is not tiermem's.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

import tiermem
import tiermem.tiers.manager
from crash_run import backward_grads, crash_config, make_model, make_optimizer, set_grads
from tiermem._lib import ffi
from tiermem.errors import TierMemError
from tiermem.io.engine import IOEngine
from tiermem.io.native_transfer import NativeTransfer
from tiermem.swap import fsops
from tiermem.swap.recover import gather

BLOCK = 4096
SYNCS = ("fsync", "dirsync")


# -- recording -------------------------------------------------------------------------


class Trace:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.events: list[tuple] = []
        self.active = True
        self.lock = threading.Lock()
        self._wid = 0

    def add(self, *event: Any) -> None:
        with self.lock:
            if self.active:
                self.events.append(event)

    def mine(self, path: str) -> bool:
        path = os.path.abspath(path)
        return path == self.root or path.startswith(self.root + os.sep)

    def write_id(self) -> int:
        with self.lock:
            self._wid += 1
            return self._wid


class RecordingFsOps(fsops.FsOps):
    """Does the real operation, then records it. Sync sites in `disabled` are skipped
    (neither done nor recorded): the mutation check of the harness."""

    def __init__(self, trace: Trace, disabled: frozenset[str] = frozenset()) -> None:
        self.trace = trace
        self.disabled = disabled

    def _rec(self, *event: Any) -> None:
        if self.trace.mine(event[1]):
            self.trace.add(*event)

    def mkdir(self, path, mode=0o700):
        super().mkdir(path, mode)
        self._rec("mkdir", os.path.abspath(path))

    def create(self, path, mode=0o600):
        super().create(path, mode)
        self._rec("create", os.path.abspath(path))

    def write_file(self, path, data, *, site):
        path = os.path.abspath(path)
        existed = os.path.lexists(path)
        if existed:
            self._rec("trunc", path, 0)
        # The open(O_CREAT) happens inside super(): record it first, the model needs it
        # before the writes (nothing can observe the difference).
        if not existed:
            self._rec("create", path)
        super().write_file(path, data, site=site)

    def pwrite(self, fd, path, data, offset):
        super().pwrite(fd, path, data, offset)
        self._rec("write", os.path.abspath(path), offset, bytes(data), 0)

    def fallocate(self, fd, path, size):
        super().fallocate(fd, path, size)
        self._rec("grow", os.path.abspath(path), size)

    def fsync(self, fd, path, *, site):
        if site not in self.disabled:
            super().fsync(fd, path, site=site)
            self._rec("fsync", os.path.abspath(path), site)

    def fdatasync(self, fd, path, *, site):
        if site not in self.disabled:
            super().fdatasync(fd, path, site=site)
            self._rec("fsync", os.path.abspath(path), site)

    def fsync_dir(self, path, *, site):
        if site not in self.disabled:
            super().fsync_dir(path, site=site)
            self._rec("dirsync", os.path.abspath(path), site)

    def replace(self, src, dst):
        super().replace(src, dst)
        self._rec("rename", os.path.abspath(src), os.path.abspath(dst))

    def unlink(self, path):
        super().unlink(path)
        self._rec("unlink", os.path.abspath(path))


class _TrackedTransfer(NativeTransfer):
    """The backend's own transfer (a read may follow it in C, as in a real run), noting in
    the trace when the write completed."""

    __slots__ = ("trace", "wid", "seen")

    def __init__(self, inner: NativeTransfer, trace: Trace, wid: int) -> None:
        super().__init__(inner._owner, inner._req, inner._wait, inner._after)
        self.trace, self.wid, self.seen = trace, wid, False

    def _saw(self, finished: bool) -> bool:
        if finished and not self.seen and self.failure() is None:
            self.seen = True
            self.trace.add("complete", None, self.wid)
        return finished

    def done(self) -> bool:
        return self._saw(super().done())

    def wait(self, timeout):
        return self._saw(super().wait(timeout))


class RecordingBackend:
    """Wraps an io_uring or thread backend: every write is recorded with its bytes as
    submitted (a buffer changes while its write is in flight only where a read that
    follows the write takes memory the write has already sent)."""

    def __init__(self, inner: Any, trace: Trace) -> None:
        self.inner, self.trace = inner, trace
        self.name = inner.name
        self.paths: dict[int, str] = {}

    def add_file(self, fd: int) -> int:
        token = self.inner.add_file(fd)
        self.paths[token] = os.readlink(f"/proc/self/fd/{fd}")
        return token

    def remove_file(self, token: int) -> None:
        self.paths.pop(token, None)
        self.inner.remove_file(token)

    def submit(self, *, op, file, addr, nbytes, offset, buf_index, **kw):
        path = self.paths.get(file, "")
        record = op == "write" and self.trace.active and self.trace.mine(path)
        if record:
            data = bytes(ffi.buffer(ffi.cast("char *", addr), nbytes))
            wid = self.trace.write_id()
            self.trace.add("write", path, offset, data, wid)
        t = self.inner.submit(op=op, file=file, addr=addr, nbytes=nbytes, offset=offset,
                              buf_index=buf_index, **kw)
        return _TrackedTransfer(t, self.trace, wid) if record else t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def recording(trace: Trace, disabled: frozenset[str] = frozenset()) -> Iterator[None]:
    real_start = IOEngine._start_backend
    real_commit = tiermem.tiers.manager.TierManager.commit

    def start(self, backend):
        return RecordingBackend(real_start(self, backend), trace)

    def commit(self, *, step, **meta):
        trace.add("commit-begin", None, step)
        out = real_commit(self, step=step, **meta)
        trace.add("commit-done", None, step)
        return out

    IOEngine._start_backend = start
    tiermem.tiers.manager.TierManager.commit = commit
    try:
        with fsops.use(RecordingFsOps(trace, disabled)):
            yield
    finally:
        IOEngine._start_backend = real_start
        tiermem.tiers.manager.TierManager.commit = real_commit


# -- the disk model -----------------------------------------------------------------------


@dataclass
class Op:
    seq: int
    ino: int
    kind: str  # file: write, grow, trunc; directory: add, remove, rename
    a: Any = None
    b: Any = None
    c: Any = None
    complete: bool = True


def _apply_file(buf: bytearray, op: Op, blocks: set[int] | None = None) -> None:
    if op.kind == "write":
        off, data = op.a, op.b
        end = off + len(data)
        if len(buf) < end:
            buf.extend(bytes(end - len(buf)))
        if blocks is None:
            buf[off:end] = data
            return
        for blk in blocks:
            lo, hi = max(off, blk * BLOCK), min(end, (blk + 1) * BLOCK)
            if lo < hi:
                buf[lo:hi] = data[lo - off:hi - off]
    elif op.kind == "grow":
        if len(buf) < op.a:
            buf.extend(bytes(op.a - len(buf)))
    elif op.kind == "trunc":
        del buf[op.a:]
        buf.extend(bytes(op.a - len(buf)))


def _apply_dir(entries: dict, op: Op) -> None:
    if op.kind == "add":
        entries[op.a] = op.b
    elif op.kind == "remove":
        entries.pop(op.a, None)
    elif op.kind == "rename":  # within one directory: atomic
        if entries.get(op.a) == op.c:
            del entries[op.a]
        entries[op.b] = op.c


class Disk:
    """What the trace did, split into durable state and pending operations."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dirs = {0}
        self.vent: dict[int, dict[str, int]] = {0: {}}
        self.dent: dict[int, dict[str, int]] = {0: {}}
        self.ddata: dict[int, bytearray] = {}
        self.pending: list[Op] = []  # every op not yet durable, in trace order
        self.by_wid: dict[int, Op] = {}
        self.seq = 0
        self.next_ino = 1

    def _lookup(self, path: str) -> tuple[int, str]:
        """(inode of the parent directory, last name)."""
        rel = os.path.relpath(path, self.root).split(os.sep)
        d = 0
        for part in rel[:-1]:
            d = self.vent[d][part]
        return d, rel[-1]

    def _ino(self, path: str) -> int:
        d, name = self._lookup(path)
        return self.vent[d][name]

    def _op(self, ino: int, kind: str, *args: Any, complete: bool = True) -> Op:
        self.seq += 1
        op = Op(self.seq, ino, kind, *args, complete=complete)
        self.pending.append(op)
        return op

    def _new(self, path: str, is_dir: bool) -> None:
        d, name = self._lookup(path)
        ino = self.next_ino
        self.next_ino += 1
        if is_dir:
            self.dirs.add(ino)
            self.vent[ino], self.dent[ino] = {}, {}
        else:
            self.ddata[ino] = bytearray()
        self.vent[d][name] = ino
        self._op(d, "add", name, ino)

    def apply(self, ev: tuple) -> None:
        kind, path = ev[0], ev[1]
        if kind == "mkdir":
            self._new(path, True)
        elif kind == "create":
            self._new(path, False)
        elif kind == "write":
            op = self._op(self._ino(path), "write", ev[2], ev[3], complete=ev[4] == 0)
            if ev[4]:
                self.by_wid[ev[4]] = op
        elif kind == "complete":
            if ev[2] in self.by_wid:
                self.by_wid.pop(ev[2]).complete = True
        elif kind in ("grow", "trunc"):
            self._op(self._ino(path), kind, ev[2])
        elif kind == "rename":
            sd, sname = self._lookup(path)
            dd, dname = self._lookup(ev[2])
            ino = self.vent[sd].pop(sname)
            self.vent[dd][dname] = ino
            if sd == dd:
                self._op(sd, "rename", sname, dname, ino)
            else:
                self._op(sd, "remove", sname)
                self._op(dd, "add", dname, ino)
        elif kind == "unlink":
            d, name = self._lookup(path)
            self.vent[d].pop(name)
            self._op(d, "remove", name)
        elif kind == "fsync":
            ino = self._ino(path)
            keep = []
            for op in self.pending:
                if op.ino == ino and op.ino not in self.dirs and op.complete:
                    _apply_file(self.ddata[ino], op)
                else:
                    keep.append(op)
            self.pending = keep
        elif kind == "dirsync":
            ino = self._ino(path) if os.path.abspath(path) != self.root else 0
            keep = []
            for op in self.pending:
                if op.ino == ino and op.ino in self.dirs:
                    _apply_dir(self.dent[ino], op)
                else:
                    keep.append(op)
            self.pending = keep

    def image(self, chosen: list[Op], torn: dict[int, set[int]]) -> tuple[dict, dict]:
        """Durable state plus `chosen` pending ops (trace order); torn: op seq -> blocks."""
        dent = {d: dict(e) for d, e in self.dent.items()}
        data = {i: bytearray(b) for i, b in self.ddata.items()}
        for op in sorted(chosen, key=lambda o: o.seq):
            if op.ino in self.dirs:
                _apply_dir(dent[op.ino], op)
            else:
                _apply_file(data[op.ino], op, torn.get(op.seq))
        return dent, data

    def materialize(self, image: tuple[dict, dict]) -> None:
        dent, data = image
        for name in os.listdir(self.root):
            p = os.path.join(self.root, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)

        def walk(d: int, path: str) -> None:
            for name, ino in dent[d].items():
                p = os.path.join(path, name)
                if ino in self.dirs:
                    os.mkdir(p, 0o700)
                    walk(ino, p)
                else:
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data[ino])
        walk(0, self.root)


def _blocks(op: Op) -> list[int]:
    return list(range(op.a // BLOCK, (op.a + len(op.b) + BLOCK - 1) // BLOCK))


def subsets(pending: list[Op], rng: random.Random, n: int
            ) -> Iterator[tuple[str, list[Op], dict[int, set[int]]]]:
    """Up to `n` crash images' worth of (label, ops applied, torn writes)."""
    writes = [op for op in pending if op.kind == "write"]
    out = [("none", [], {}), ("all", list(pending), {})]
    if writes:
        last = writes[-1]
        bl = _blocks(last)
        out.append(("torn-last", list(pending), {last.seq: set(rng.sample(bl, len(bl) // 2))}))
    if pending:
        out.append(("prefix", pending[:rng.randrange(len(pending) + 1)], {}))
    while len(out) < n:
        chosen = [op for op in pending if rng.random() < 0.5]
        torn = {}
        for op in chosen:
            if op.kind == "write" and rng.random() < 0.3:
                bl = _blocks(op)
                torn[op.seq] = {b for b in bl if rng.random() < 0.5}
        out.append(("random+torn" if torn else "random", chosen, torn))
    yield from out[:n]


# -- scenarios, references, checks ------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    backend: str = "threads"
    paths: int = 1
    dtype: str = "fp32"  # model dtype
    grads: str = "synthetic"  # or "overlap": real backward, pipeline.overlap_backward
    steps: int = 3
    # optimizer.master_weights: kahan / none run a bf16 model with int8 moments, whose
    # records keep the bf16 weights (kind "weight")
    master: str = "fp32"

    @property
    def name(self) -> str:
        tail = "" if self.master == "fp32" else f"-int8-{self.master}"
        return f"{self.backend}-{self.paths}path-{self.dtype}-{self.grads}{tail}"

    def config(self, root: str) -> dict:
        paths = [os.path.join(root, f"swap{i}") for i in range(self.paths)]
        cfg = (crash_config(paths[0], self.backend) if self.master == "fp32"
               else crash_config(paths[0], self.backend, "int8", self.master))
        cfg["swap"]["paths"] = paths
        cfg["pipeline"]["overlap_backward"] = self.grads == "overlap"
        return cfg

    def model(self) -> torch.nn.Module:
        return make_model(torch.bfloat16 if self.dtype == "bf16" else torch.float32)

    def grad(self, model: torch.nn.Module, step: int) -> None:
        (backward_grads if self.grads == "overlap" else set_grads)(model, step)

    def run_dir(self, root: str) -> str:
        return os.path.join(root, "swap0", "tiermem-default")


_REFS: dict[Scenario, list] = {}


def reference(s: Scenario) -> list[tuple[list[torch.Tensor], dict[int, dict]]]:
    """Plain fp32 torch AdamW from the model's starting weights (upcast) on the gradients
    the model gives (rounded to its dtype): fp32 weights and per-parameter state."""
    key = Scenario(s.backend, 1, s.dtype, s.grads, s.steps, s.master)
    if key in _REFS:
        return _REFS[key]
    if s.master != "fp32":
        _REFS[key] = _uninterrupted(key)
        return _REFS[key]
    assert not (s.dtype == "bf16" and s.grads == "overlap"), "no reference for that pairing"
    model = s.model()
    ref = copy.deepcopy(model).float()
    opt = make_optimizer(ref)

    def snap():
        return ([p.detach().clone() for p in ref.parameters()],
                copy.deepcopy(opt.state_dict()["state"]))
    out = [snap()]
    for k in range(1, s.steps + 1):
        s.grad(ref, k)
        if s.dtype == "bf16":
            for p in ref.parameters():
                p.grad = p.grad.to(torch.bfloat16).float()
        opt.step()
        out.append(snap())
    _REFS[key] = out
    return out


def _uninterrupted(s: Scenario) -> list[tuple[list[torch.Tensor], dict[int, dict]]]:
    """No plain torch optimizer runs int8 moments with kahan/none weights: the reference is
    the same tiermem run, never crashed (its own directory), weights in fp32 (exactly) as
    recover writes them, and the whole torch-format state (master_param: weight + term)."""
    import tempfile

    model = s.model()
    opt = make_optimizer(model)
    root = tempfile.mkdtemp(prefix="tiermem-powerloss-ref-")
    try:
        out = []
        with tiermem.offload(opt, s.config(root), model=model) as tm:
            for k in range(s.steps + 1):
                if k:
                    s.grad(model, k)
                    opt.step()
                out.append(([p.detach().float() for p in model.parameters()],
                            {"full": copy.deepcopy(opt.state_dict()["state"])}))
            tm.discard()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _same(a: Any, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a, b))


def _state_matches(state: dict, ref_w: list[torch.Tensor], ref_st: dict, lowp: bool) -> str:
    """'' when `state` (torch state_dict["state"]) is the reference's, else what differs."""
    if "full" in ref_st:  # an uninterrupted tiermem run's state: every tensor, bitwise
        full = ref_st["full"]
        if set(state) != set(full):
            return f"state of parameters {sorted(state)}, expected {sorted(full)}"
        for i, r in full.items():
            for k, v in r.items():
                got = state[i].get(k)
                ok = (float(got) == float(v) if k == "step" and got is not None
                      else _same(got, v))
                if not ok:
                    return f"state[{i}][{k}]"
        return ""
    for i, w in enumerate(ref_w):
        r, st = ref_st.get(i), state.get(i) or {}
        if r:
            for k in ("exp_avg", "exp_avg_sq"):
                if not _same(st.get(k), r[k]):
                    return f"state[{i}][{k}]"
            if float(st.get("step", -1)) != float(r["step"]):
                return f"state[{i}][step]"
        elif st.get("exp_avg") is not None and bool(st["exp_avg"].any()):
            return f"state[{i}] present before any step"
        if lowp and (r or "master_param" in st) and not _same(st.get("master_param"), w):
            return f"state[{i}][master_param]"
    return ""


@dataclass
class Outcome:
    kind: str  # exact, refused, bad
    step: int | None = None
    why: str = ""


def _recover(s: Scenario, run_dir: str, ref: list) -> tuple[int | None, str]:
    ckpt = gather(run_dir)
    step = ckpt["step"]
    if not 0 <= step < len(ref):
        return step, f"recover gave step {step}, never run"
    w, st = ref[step]
    names = [n for n, _ in s.model().named_parameters()]
    for n, r in zip(names, w):
        if not _same(ckpt.get("model", {}).get(n), r):
            return step, f"recovered weight {n} differs from step {step}"
    return step, _state_matches(ckpt["optimizer"]["state"], w, st, s.dtype != "fp32")


def _resume(s: Scenario, root: str, ref: list) -> tuple[int | None, str]:
    model = s.model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # a resume must put the committed weights back
    opt = make_optimizer(model)
    with tiermem.offload(opt, s.config(root), model=model, resume=True) as tm:
        step = tm.resumed_step
        why = ""
        if step is None or not 0 <= step < len(ref):
            why = f"resume gave step {step}, never run"
        else:
            w, st = ref[step]
            for (n, p), r in zip(model.named_parameters(), w):
                if not _same(p.detach(), r.to(p.dtype)):
                    why = f"resumed weight {n} differs from step {step}"
                    break
            why = why or _state_matches(opt.state_dict()["state"], w, st, s.dtype != "fp32")
        tm.discard()
    return step, why


def evaluate(s: Scenario, root: str, ref: list, lo: int | None, hi: int | None) -> Outcome:
    """Recover, then resume, from the image now at `root`; judge against [lo, hi]."""
    results = []
    for fn, args in ((_recover, (s, s.run_dir(root), ref)), (_resume, (s, root, ref))):
        try:
            results.append(fn(*args))
        except TierMemError as exc:
            results.append((None, f"refused: {exc}"))
        except Exception as exc:  # noqa: BLE001 - anything not tiermem's is a finding
            return Outcome("bad", None, f"{fn.__name__}: raw {type(exc).__name__}: {exc}")
    (s1, why1), (s2, why2) = results
    if s1 is None and s2 is None:
        if lo is None:
            return Outcome("refused", None, why1)
        return Outcome("bad", None, f"refused although step {lo} was committed: {why1[:300]}")
    if s1 is None or s2 is None or s1 != s2:
        return Outcome("bad", None, f"recover {s1} ({why1[:200]}) vs resume {s2} "
                                    f"({why2[:200]})")
    if why1 or why2:
        return Outcome("bad", s1, f"wrong state accepted at step {s1}: {why1 or why2}")
    if (lo is not None and s1 < lo) or hi is None or s1 > hi:
        return Outcome("bad", s1, f"step {s1} outside the committed range [{lo}, {hi}]")
    return Outcome("exact", s1)


@dataclass
class Report:
    scenario: str
    points: int = 0
    images: int = 0
    exact: int = 0
    refused: int = 0
    bad: int = 0
    by_label: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    seconds: float = 0.0


def record(s: Scenario, root: str, disabled: frozenset[str] = frozenset()) -> Trace:
    """Train s.steps steps under a recording FsOps and backend; the trace of it."""
    trace = Trace(root)
    model = s.model()
    opt = make_optimizer(model)
    with recording(trace, disabled):
        with tiermem.offload(opt, s.config(root), model=model) as tm:
            for k in range(1, s.steps + 1):
                s.grad(model, k)
                opt.step()
            trace.active = False  # what the exit does next is no step's durability
            tm.discard()
    return trace


def crash_points(trace: Trace) -> list[int]:
    """Trace positions to crash before: every sync, and the end."""
    return [i for i, ev in enumerate(trace.events) if ev[0] in SYNCS] + [len(trace.events)]


def powerloss(s: Scenario, root: str, *, per_point: int = 6, seed: int = 0,
              disabled: frozenset[str] = frozenset(), points: int | None = None,
              stop_at_bad: bool = False) -> Report:
    """Record a run of `s` under `root` (an empty directory), then crash it at every
    durability boundary (or `points` of them, spread evenly), `per_point` images each."""
    t0 = time.monotonic()
    root = os.path.abspath(root)
    trace = record(s, root, disabled)
    ref = reference(s)
    rng = random.Random(seed)
    rep = Report(s.name + (f" without {'+'.join(sorted(disabled))}" if disabled else ""))
    where = crash_points(trace)
    if points is not None and points < len(where):
        where = sorted({where[round(i * (len(where) - 1) / max(points - 1, 1))]
                        for i in range(points)})
    disk = Disk(root)
    lo = hi = None
    pos = 0
    for stop in where:
        for ev in trace.events[pos:stop]:
            if ev[0] == "commit-begin":
                hi = ev[2]
            elif ev[0] == "commit-done":
                lo = ev[2]
            else:
                disk.apply(ev)
        pos = stop
        rep.points += 1
        for label, chosen, torn in subsets(disk.pending, rng, per_point):
            disk.materialize(disk.image(chosen, torn))
            out = evaluate(s, root, ref, lo, hi)
            rep.images += 1
            setattr(rep, out.kind, getattr(rep, out.kind) + 1)
            rep.by_label.setdefault(label, {}).setdefault(out.kind, 0)
            rep.by_label[label][out.kind] += 1
            if out.kind == "bad":
                ev = trace.events[stop] if stop < len(trace.events) else ("end",)
                rep.failures.append(f"before trace[{stop}] {ev[0]} {ev[-1] if len(ev) > 2 else ''}"
                                    f" [{label}, lo={lo}, hi={hi}]: {out.why}")
                if stop_at_bad:
                    rep.seconds = time.monotonic() - t0
                    return rep
    for name in os.listdir(root):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    rep.seconds = time.monotonic() - t0
    return rep
