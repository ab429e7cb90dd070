"""Soak: many steps of a small model with mixed placement and injected transient faults.

Reports open file descriptors, pinned (locked) bytes and RSS at the start and at
the end (they must not grow), the faults injected and how many were survived,
and checks the parameters bitwise against the same run without tiermem's
faults (kernel "match": bitwise parity with the plain optimizer).

Usage: python bench/soak.py [--steps 2000] [--fault-every 50] [--backend io_uring]
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
import time

import torch

from _harness import REPO, parser, run_header, save, settings, show_table

import tiermem  # noqa: E402 - after _harness, which puts this checkout first on sys.path

sys.path.insert(0, str(REPO / "tests"))
from faults import FailedTransfer  # noqa: E402 - tests/faults.py, the suite's fault injector


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def snapshot() -> dict:
    return {"open_fds": len(os.listdir("/proc/self/fd")), "locked_bytes": _status("VmLck"),
            "rss_bytes": _status("VmRSS")}


class TransientFaults:
    """Every `every`-th transfer fails once with EIO (its reissue goes through)."""

    def __init__(self, inner, every: int) -> None:
        self.inner, self.every, self.name = inner, every, inner.name
        self.n = self.injected = 0
        self._failed: set = set()

    def submit(self, *, op, file, addr, nbytes, offset, buf_index, **kw):
        self.n += 1
        key = (op, file, offset)
        if self.every and self.n % self.every == 0 and key not in self._failed:
            self._failed.add(key)
            self.injected += 1
            return FailedTransfer(errno.EIO, offset, nbytes)
        self._failed.discard(key)
        return self.inner.submit(op=op, file=file, addr=addr, nbytes=nbytes, offset=offset,
                                 buf_index=buf_index, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 128), torch.nn.Linear(128, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 128))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train(model, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 512, (8, 16), generator=g)
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()


def main(argv=None) -> int:
    p = parser(__doc__, json_name="soak.json", quick={"steps": 200})
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--fault-every", type=int, default=50,
                   help="every N-th transfer fails once (0: none)")
    p.add_argument("--backend", default="io_uring", choices=["io_uring", "threads"])
    p.add_argument("--durability", default="scratch", choices=["scratch", "crash_consistent"],
                   help="crash_consistent also commits a manifest after every step")
    a = p.parse_args(argv)
    header = run_header("soak", argv)
    with tempfile.TemporaryDirectory(prefix="tiermem-soak-") as swap:
        cfg = {"swap": {"paths": [swap], "durability": a.durability}, "io": {"backend": a.backend, "retries": 2},
               "tiers": {"host": {"capacity": "256KiB"}},  # mixed: some host, most NVMe
               "placement": [{"match": "0.*", "tier": "nvme"}],
               "pipeline": {"partition_size": "64KiB", "buffer_count": 4, "prefetch_depth": 2},
               "optimizer": {"kernel": "match"}}
        model, opt = model_and_opt()
        train(model, opt, 2)  # warm up torch before the first snapshot
        with tiermem.offload(opt, cfg, model=model) as tm:
            engine = tm.offloaded.tiers.engine
            faults = TransientFaults(engine._backend, a.fault_every)
            engine._backend = faults
            train(model, opt, 5)
            start = snapshot()
            t0 = time.perf_counter()
            train(model, opt, a.steps)
            seconds = time.perf_counter() - t0
            tm.stats()  # every transfer of the run has landed (or been reissued)
            end = snapshot()
            plan, survived, injected = tm.plan(), tm.faults_survived, faults.injected
        ref_model, ref_opt = model_and_opt()
        for n in (2, 5, a.steps):  # the same batches, in the same calls
            train(ref_model, ref_opt, n)
        equal = all(torch.equal(x, y) for x, y in zip(model.parameters(),
                                                       ref_model.parameters()))
    rows = [[k, start[k], end[k], end[k] - start[k]] for k in start]
    rows += [["faults injected", "", injected, ""],
             ["faults survived", "", survived, ""],
             ["bitwise equal to plain AdamW", "", equal, ""]]
    table = show_table(["what", "start", "end", "growth"], rows, title=(
        f"{a.steps} steps in {seconds:.1f} s, {plan['partitions']} partitions "
        f"({plan['state_bytes']}), backend {a.backend}, durability {a.durability}\n"))
    save(a.json, header, args=settings(a), start=start, end=end, seconds=seconds, plan=plan,
         faults_injected=injected, faults_survived=survived, bitwise_equal=equal, table=table)
    ok = equal and end["open_fds"] <= start["open_fds"] and survived == injected \
        and end["locked_bytes"] <= start["locked_bytes"]
    print("\nsoak: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
