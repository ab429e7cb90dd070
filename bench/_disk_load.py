"""Disk traffic from fio beside a computation, to measure what the traffic alone costs it.

On a virtual machine the disk's transfers are not free for the guest's compute:
the host copies every block into or out of guest memory. `DiskLoad` runs fio,
rate-limited to the bytes per second a tiermem step moves, while the caller
times a forward+backward, so a benchmark can say how much of an overlapped
iteration's excess is the disk's doing rather than tiermem's.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

from _harness import fio_layout

STATUS_INTERVAL = "100ms"  # fio appends a JSON report of its jobs this often
START_TIMEOUT = 10.0  # seconds fio may take to move its first bytes before we give up
SETTLE_SECONDS = 0.2  # after its first bytes, so that the timed work sees the steady rate
FILE_BYTES = 256 << 20  # each job cycles over a file this large (O_DIRECT: no page cache)


def have_fio() -> bool:
    return shutil.which("fio") is not None


def _reports(path: Path) -> list[dict]:
    """The complete JSON reports fio has written to `path` so far (the last may be cut)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    decoder, out, i = json.JSONDecoder(), [], 0
    while (j := text.find("{", i)) >= 0:
        try:
            obj, i = decoder.raw_decode(text, j)
        except json.JSONDecodeError:
            break
        out.append(obj)
    return out


def _moved(report: dict) -> dict:
    """Bytes and seconds of the read and the write job (zero for a job not run)."""
    jobs = {j["jobname"]: j for j in report["jobs"]}
    out = {}
    for op in ("read", "write"):
        stats = jobs[op][op] if op in jobs else {"io_bytes": 0, "runtime": 0}
        out[f"{op}_bytes"] = stats["io_bytes"]
        out[f"{op}_seconds"] = stats["runtime"] / 1e3
    return out


class DiskLoad:
    """Two fio jobs in `directory` (one reading, one writing, O_DIRECT, io_uring), each held
    to its rate. `prepare()` once, then `with load.running(read_bps, write_bps): ...` around
    each timed piece; `moved` collects what each run achieved while the piece ran;
    `remove()` at the end."""

    def __init__(self, directory: str | Path, *, block_size: int, depth: int = 8) -> None:
        self.dir = Path(directory) / "disk-load"
        self.block_size = block_size
        self.depth = depth
        self.moved: list[dict] = []  # per run: read/write bytes and seconds, from fio

    def prepare(self) -> None:
        """Lay both files out on disk: reads need data, and O_DIRECT writes that extend a
        file are slow on ext4 (the write job would fall short of its rate)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("read.bin", "write.bin"):
            fio_layout(self.dir / name, FILE_BYTES)

    def running(self, read_bps: float, write_bps: float) -> "_Run":
        return _Run(self, int(read_bps), int(write_bps))

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class _Run:
    """One fio process: entered once both jobs move bytes, left with fio's final report."""

    def __init__(self, load: DiskLoad, read_bps: int, write_bps: int) -> None:
        self.load = load
        self.status = load.dir / "status.json"
        common = ["--ioengine=io_uring", "--direct=1", f"--bs={load.block_size}",
                  f"--iodepth={load.depth}", f"--size={FILE_BYTES}", "--time_based",
                  "--runtime=600", "--thread"]
        # A job only for a direction that moves bytes (a step whose records all stayed in
        # buffers reads nothing).
        self.ops = [op for op, bps in (("read", read_bps), ("write", write_bps)) if bps > 0]
        jobs = {"read": ["--name=read", f"--filename={load.dir / 'read.bin'}", "--rw=read",
                         f"--rate={read_bps}"],
                "write": ["--name=write", f"--filename={load.dir / 'write.bin'}",
                          "--rw=write", f"--rate=,{write_bps}"]}
        self.cmd = ["fio", "--output-format=json", f"--output={self.status}",
                    f"--status-interval={STATUS_INTERVAL}", *common,
                    *(arg for op in self.ops for arg in jobs[op])]

    def __enter__(self) -> "_Run":
        self.status.unlink(missing_ok=True)
        self.start = _moved({"jobs": []})
        if not self.ops:
            self.proc = None
            return self
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            reports = _reports(self.status)
            if reports:
                m = _moved(reports[-1])
                if all(m[f"{op}_bytes"] > 0 for op in self.ops):
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                err = self.proc.communicate()[1]
                raise RuntimeError(f"fio moved no bytes within {START_TIMEOUT:.0f} s (exit "
                                   f"{self.proc.returncode}): {err.strip()[-400:]}")
            time.sleep(0.02)
        time.sleep(SETTLE_SECONDS)
        reports = _reports(self.status)
        self.start = _moved(reports[-1])
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.proc is None:  # nothing to move
            self.load.moved.append(dict(self.start))
            return
        if exc_type is not None:  # the timed work failed: its error is the one to see
            self.proc.kill()
            self.proc.communicate()
            return
        # SIGINT: fio ends its jobs and still writes its final report.
        self.proc.send_signal(signal.SIGINT)
        err = self.proc.communicate(timeout=60)[1]
        reports = _reports(self.status)
        if not reports:
            raise RuntimeError(f"fio gave no report (exit {self.proc.returncode}): "
                               f"{err.strip()[-400:]}")
        end = _moved(reports[-1])
        # What moved from the last report before the timed work to the end (fio's own
        # start-up and first bytes excluded).
        self.load.moved.append({k: end[k] - self.start[k] for k in end})
