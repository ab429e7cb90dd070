"""Collectives with a deadline, and errors that name the rank that is missing.

Every collective tiermem issues is asynchronous and waited for with
`distributed.timeout`, so a rank that died, hangs or raised cannot hold the
others forever. When a wait fails, the c10d store (the one the process group
was created with) says why: each rank records there the step it reached, and a
rank leaving `tiermem.offload` on an exception records the exception. The
error then names the ranks that failed or fell behind.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tiermem.errors import TierMemError

_instances = itertools.count()  # every rank builds its offloads in the same order


class PeerError(TierMemError):
    """Another rank failed, hung or fell behind while this one waited in a collective."""


class Collectives:
    """One offload's view of its process group."""

    def __init__(self, group: Any, timeout: float, name: str) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timedelta(seconds=timeout)
        self.store = c10d._get_default_store()
        # Namespaced by run name and by the how-manyth offload of this process: keys of an
        # earlier block (or job sharing a FileStore) are never read as this one's.
        self.prefix = f"tiermem/{name}/{next(_instances)}/"
        self.where = "set-up"

    def global_rank(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    # -- collectives (all asynchronous; wait() bounds them) -----------------------

    def all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> Any:
        return dist.all_reduce(t, op=op, group=self.group, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Sum of every rank's `inp`, rank r receiving slice r (equal slices)."""
        return dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=self.group,
                                          async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Every rank's `inp` back to back in `out` (equal sizes)."""
        return dist.all_gather_single(out, inp, group=self.group, async_op=True)

    def table(self, row: list[float], what: str) -> list[list[float]]:
        """Every rank's `row` (numbers; exact up to 2**53), in rank order."""
        t = torch.zeros(self.world, len(row), dtype=torch.float64)
        t[self.rank] = torch.tensor(row, dtype=torch.float64)
        self.wait(self.all_reduce(t), what)  # the other rows are zero: the sum is the table
        return t.tolist()

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

    def failure(self, what: str, exc: BaseException) -> PeerError:
        """The error for a wait that failed: which ranks failed or fell behind, and where."""
        head = (f"rank {self.global_rank(self.rank)} waited for the other ranks in {what} "
                f"({self.where}) and gave up after {self.timeout.total_seconds():g} s or an "
                f"error ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        try:
            failed, behind = [], []
            mine = self._get(f"step/{self.rank}")
            for r in range(self.world):
                if r == self.rank:
                    continue
                why = self._get(f"failed/{r}")
                if why is not None:
                    failed.append(f"rank {self.global_rank(r)} failed: {why}")
                    continue
                step = self._get(f"step/{r}")
                if step != mine:
                    behind.append(f"rank {self.global_rank(r)} is at "
                                  f"{'set-up' if step is None else 'step ' + step}")
        except Exception as err:  # the store itself may have died with its host rank
            return PeerError(f"{head}; the c10d store could not say which rank is missing "
                             f"({type(err).__name__}: {err}); rank 0 hosts a TCPStore")
        if failed or behind:
            return PeerError(f"{head}; " + "; ".join(failed + behind))
        return PeerError(f"{head}; every rank reached the same step, so the collective itself "
                         "failed or a rank is stuck inside it")
