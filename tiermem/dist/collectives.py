"""Collectives with a deadline, and errors that name the rank that is missing.

Every collective tiermem issues is asynchronous and waited for with
`distributed.timeout`, so a rank that died, hangs or raised cannot hold the
others forever. When a wait fails, the c10d store (the one the process group
was created with) says why: each rank records there the step it reached, and a
rank leaving `tiermem.offload` on an exception records the exception. The
error then names the ranks that failed or fell behind.

A rank that dies (killed, out of memory) records nothing, and may die after it
recorded the step the others are in. So every rank also beats a heartbeat, a
counter in the store bumped by a daemon thread every `beat` seconds; a failed wait
watches the counters for a few beats and names the ranks whose counter stood
still: dead, or frozen so hard that not even a Python thread runs.
"""

from __future__ import annotations

import collections
import hashlib
import math
import pickle
import threading
import time
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tiermem.errors import TierMemError

# torch 2.13 renamed the flat-tensor collectives to *_single and deprecated the old names;
# older releases (2.11 on the GPU image) have only the old ones. Same semantics.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# how many offloads this process built over each group (its ranks) under each name: every
# member of a group builds the same ones in the same order, whatever other groups it is in
_instances: collections.Counter = collections.Counter()
# Collectives.agree calls over each group (its ranks), whichever block made them: every rank
# makes them in the same order, each one a collective over the group
_agreements: collections.Counter = collections.Counter()


class PeerError(TierMemError):
    """Another rank failed, hung or fell behind while this one waited in a collective."""


class RankMismatch(TierMemError):
    """The ranks entered different operations (Collectives.agree); `doing`: what each rank
    said it was doing, in rank order (None where the store could not say)."""

    def __init__(self, message: str, doing: list[str | None]) -> None:
        super().__init__(message)
        self.doing = doing


def scalar_table(coll: Collectives | None, cols: Sequence[str],
                 held: Iterable[tuple[int, dict[str, Any]]], n: int, what: str
                 ) -> torch.Tensor:
    """The per-parameter scalars `cols` (ASGD's eta, ...) of `n` parameters as an n x
    len(cols) float64 table, -inf where no one holds one; `held`: (parameter index, its
    scalars) pairs. Under a process group (coll) the MAX over the ranks: every rank holding
    a piece of a parameter steps it alike, so they agree, and one holding none has -inf."""
    table = torch.full((n, len(cols)), -math.inf, dtype=torch.float64)
    for i, have in held:
        for c, k in enumerate(cols):
            if k in have:
                table[i, c] = float(have[k])
    if coll is not None and table.numel():
        coll.wait(coll.all_reduce(table, dist.ReduceOp.MAX), what)
    return table


class Collectives:
    """One offload's view of its process group."""

    def __init__(self, group: Any, timeout: float, name: str) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timedelta(seconds=timeout)
        self.store = c10d._get_default_store()
        # Namespaced by run name, by the group's ranks and by the how-manyth offload over that
        # group: keys of an earlier block (or job sharing a FileStore) are never read as this
        # one's, nor those of another group on the same store (pipeline stages' data-parallel
        # groups all have a rank 0), and a rank that ran offloads over a subgroup the others
        # were not in still counts this group's as they do.
        ranks = [self.global_rank(r) for r in range(self.world)]
        group_id = hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
        instance = _instances[(name, group_id)]
        _instances[(name, group_id)] += 1
        self.prefix = f"tiermem/{name}/{group_id}/{instance}/"
        self.group_id = group_id
        self.block = f"tiermem.offload(name={name!r})" + (f" #{instance + 1}" if instance else "")
        self.where = "set-up"
        # Often enough that a dead rank is named soon after a wait fails, rarely enough that
        # the store (rank 0's TCPStore under torchrun) does not notice.
        self.beat = min(5.0, max(0.1, timeout / 10))
        self._stop = threading.Event()
        self._beats = 0
        self._set("beat/" + str(self.rank), "0")
        self._heart = threading.Thread(target=self._beat, name=f"tiermem-heartbeat-{self.rank}",
                                       daemon=True)  # never keeps a finished process alive
        self._heart.start()

    def _beat(self) -> None:
        # Only this thread writes this rank's beat key; the store client serialises its own
        # requests, so sharing it with the main thread and the process group is safe.
        while not self._stop.wait(self.beat):
            self._beats += 1
            self._set("beat/" + str(self.rank), str(self._beats))

    def close(self) -> None:
        """Stop the heartbeat; the others then read that this rank left, not that it died."""
        if self._heart.is_alive():
            self._stop.set()
            self._heart.join()
            self._set("beat/" + str(self.rank), "left")

    def global_rank(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    # -- collectives (all asynchronous; wait() bounds them) -----------------------

    def all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> Any:
        return dist.all_reduce(t, op=op, group=self.group, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Sum of every rank's `inp`, rank r receiving slice r (equal slices)."""
        return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=self.group,
                               async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Every rank's `inp` back to back in `out` (equal sizes)."""
        return _all_gather(out, inp, group=self.group, async_op=True)

    def broadcast(self, t: torch.Tensor, src: int) -> Any:
        """Rank `src`'s `t` (rank in this group) into every rank's `t` (equal sizes)."""
        return dist.broadcast(t, src=self.global_rank(src), group=self.group, async_op=True)

    def gather(self, inp: torch.Tensor, outs: list[torch.Tensor] | None, dst: int) -> Any:
        """Every rank's `inp` into rank `dst`'s `outs` (one per rank, equal sizes; None on
        the other ranks)."""
        return dist.gather(inp, gather_list=outs, dst=self.global_rank(dst), group=self.group,
                           async_op=True)

    def scatter(self, out: torch.Tensor, ins: list[torch.Tensor] | None, src: int) -> Any:
        """Rank `src`'s `ins[r]` into rank r's `out` (equal sizes; None off rank `src`)."""
        return dist.scatter(out, scatter_list=ins, src=self.global_rank(src),
                            group=self.group, async_op=True)

    def from_lowest(self, offers: dict[int, Any], n: int, what: str) -> dict[int, Any]:
        """Items 0..n-1, each from the lowest rank that offers it (`offers`: this rank's,
        item -> a picklable value), on every rank; an item no rank offers is absent. For
        the few small values a rank's step may know and another's not (a param group's
        count on a rank that owns none of its parameters), and for whole-parameter state
        entries, which only their owner offers. One item in flight at a time."""
        if self.world == 1:
            return {i: v for i, v in offers.items() if i < n}
        blobs = {i: pickle.dumps(v) for i, v in offers.items()}
        sizes = self.table([float(len(blobs[i])) if i in blobs else 0.0 for i in range(n)],
                           what)
        out: dict[int, Any] = {}
        for i in range(n):
            src = next((r for r in range(self.world) if sizes[r][i]), None)
            if src is None:
                continue
            data = (torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8)
                    if src == self.rank else torch.empty(int(sizes[src][i]), dtype=torch.uint8))
            self.wait(self.broadcast(data, src), what)
            # (pickled by this group's own ranks, running this same code)
            out[i] = pickle.loads(data.numpy().tobytes())
        return out

    def table(self, row: list[float], what: str) -> list[list[float]]:
        """Every rank's `row` (numbers; exact up to 2**53), in rank order."""
        t = torch.zeros(self.world, len(row), dtype=torch.float64)
        t[self.rank] = torch.tensor(row, dtype=torch.float64)
        self.wait(self.all_reduce(t), what)  # the other rows are zero: the sum is the table
        return t.tolist()

    def agreed_steps(self, n: int, shadow: dict[int, dict[str, Any]], what: str
                     ) -> torch.Tensor:
        """Each of the `n` parameters' step count as the ranks holding its state know it
        (-1 where no rank does): a rank owning none of a parameter has no count of its own."""
        steps = torch.full((n,), -1.0)
        for i, st in shadow.items():
            steps[i] = float(st["step"])
        if n:
            self.wait(self.all_reduce(steps, dist.ReduceOp.MAX), what)
        return steps

    def agreed_scalars(self, keys_of: Sequence[Sequence[str]],
                       shadow: dict[int, dict[str, Any]], what: str
                       ) -> list[dict[str, torch.Tensor]]:
        """Each parameter's scalars besides its step (`keys_of[i]`: ASGD's eta and mu,
        NAdam's mu_product; fp32 0-d tensors) as the ranks holding its state know them:
        every holder steps it alike, so they agree; a rank owning none of it has none."""
        cols = sorted({k for keys in keys_of for k in keys})
        if not cols:
            return [{} for _ in keys_of]
        table = scalar_table(self, cols, shadow.items(), len(keys_of), what)
        return [{k: torch.tensor(table[i, cols.index(k)].item(), dtype=torch.float32)
                 for k in keys if table[i, cols.index(k)] != -math.inf}
                for i, keys in enumerate(keys_of)]

    def agree(self, op: str, step: int) -> None:
        """Check that every rank is entering the same operation (`op`; `step`: the calls of
        opt.step() in this block so far, the one entered included) before its collectives:
        the first collectives of two operations can have the same shape (a step's and a
        state_dict's agreement on the parameters are both one float per parameter), so
        ranks in different operations would pair them silently and go on with each other's
        data, or wait for the timeout at the first collective that differs. One small
        all-reduce; on a mismatch every rank raises, naming what each rank is doing, and
        the group is left in step."""
        if self.world == 1:
            return
        # What each rank is doing, under keys of the group, not of this block (the ranks may
        # be in different blocks); two keys per rank, taken in turn: a rank may write its
        # next agreement's before a slower one read this one's (never the one after: that
        # needs the slower one in the next agreement, after its reading), and the store
        # does not grow with the steps.
        n = _agreements[self.group_id]
        _agreements[self.group_id] += 1
        key = f"tiermem/agree/{self.group_id}/{{}}/{n % 2}"
        mine = f"{op} of {self.block} (opt.step() calls in this block so far: {step})"
        try:
            self.store.set(key.format(self.rank), mine)
        except Exception:
            pass  # the store only explains a mismatch
        # the block too: two offloads open at once over one group (a GAN's two optimizers)
        # issue collectives of the same shapes
        code = float(int.from_bytes(hashlib.sha1((self.prefix + op).encode()).digest()[:6],
                                    "big"))
        # MAX of (x, -x) gives the largest and the smallest x: equal only if all agree
        t = torch.tensor([code, -code, float(step), -float(step)], dtype=torch.float64)
        self.wait(self.all_reduce(t, dist.ReduceOp.MAX), f"starting {op}")
        if t[0] == -t[1] and t[2] == -t[3]:
            return
        doing: list[str | None] = []
        for r in range(self.world):
            try:
                got = self.store.get(key.format(r)).decode(errors="replace")
            except Exception:  # the store only explains; the mismatch itself is certain
                got = None
            doing.append(got)
        said = "; ".join(f"rank {self.global_rank(r)} is in {d}" if d is not None else
                         f"rank {self.global_rank(r)} could not say" for r, d in enumerate(doing))
        raise RankMismatch(f"rank {self.global_rank(self.rank)}: the ranks are not in the same "
                           f"operation ({said}); every rank must call opt.step(), "
                           "opt.state_dict(), tiermem.dist.dcp's save and load, and leave "
                           "tiermem.offload, together and in the same order", doing)

    def wait(self, work: Any, what: str) -> None:
        try:
            if not work.wait(self.timeout):
                raise RuntimeError("the wait returned without completing")
        except Exception as exc:
            raise self.failure(what, exc) from exc

    # -- who is where ------------------------------------------------------------------

    def arrive(self, step: int) -> None:
        """Record that this rank entered `step` (read only when a wait fails)."""
        self.where = f"step {step}"
        self._set(f"step/{self.rank}", str(step))

    def post_failure(self, exc: BaseException) -> None:
        """Tell the other ranks why this one left (they name it when their wait fails)."""
        self._set(f"failed/{self.rank}", f"{type(exc).__name__}: {exc}"[:2000])

    def failed_why(self, r: int) -> str | None:
        """What rank `r` (in this group) posted on failing (post_failure), if it did."""
        try:
            return self._get(f"failed/{r}")
        except Exception:
            return None

    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(self.prefix + key, value)
        except Exception:
            pass  # the store is only consulted to explain a failure; never fail for it

    def _get(self, key: str) -> str | None:
        key = self.prefix + key
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode(errors="replace")

    def _stopped(self, ranks: list[int]) -> dict[int, str]:
        """Ranks whose heartbeat stands still for 3 beats (or who left), and how to say so."""
        first = {r: self._get(f"beat/{r}") for r in ranks}
        out = {r: "left tiermem.offload" for r, v in first.items() if v == "left"}
        watch = [r for r in ranks if r not in out]
        deadline = time.monotonic() + 3 * self.beat
        while watch and time.monotonic() < deadline:
            time.sleep(self.beat / 2)
            watch = [r for r in watch if self._get(f"beat/{r}") == first[r]]
        out.update({r: ("died or froze (its heartbeat stopped; it beats every "
                        f"{self.beat:g} s)" if first[r] is not None else
                        "has no heartbeat (it died before, or never entered, tiermem.offload)")
                    for r in watch})
        return out

    def failure(self, what: str, exc: BaseException) -> PeerError:
        """The error for a wait that failed: which ranks failed or fell behind, and where."""
        head = (f"rank {self.global_rank(self.rank)} waited for the other ranks in {what} "
                f"({self.where}) and gave up after {self.timeout.total_seconds():g} s or an "
                f"error ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        try:
            failed, behind = [], []
            mine = self._get(f"step/{self.rank}")
            others = [r for r in range(self.world) if r != self.rank]
            stopped = self._stopped(others)
            for r in others:
                why = self._get(f"failed/{r}")
                if why is not None:
                    failed.append(f"rank {self.global_rank(r)} failed: {why}")
                    continue
                step = self._get(f"step/{r}")
                at = "set-up" if step is None else "step " + step
                if r in stopped:
                    failed.append(f"rank {self.global_rank(r)} {stopped[r]} at {at}")
                elif step != mine:
                    behind.append(f"rank {self.global_rank(r)} is at {at}")
        except Exception as err:  # the store itself may have died with its host rank
            return PeerError(f"{head}; the c10d store could not say which rank is missing "
                             f"({type(err).__name__}: {err}); rank 0 hosts a TCPStore")
        if failed or behind:
            return PeerError(f"{head}; " + "; ".join(failed + behind))
        return PeerError(f"{head}; every rank reached the same step, so the collective itself "
                         "failed or a rank is stuck inside it")
