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

# fio takes ~0.25 s to start its jobs here; the timed work starts once they have run a while.
RAMP_SECONDS = 0.6
FILE_BYTES = 256 << 20  # each job cycles over a file this large (O_DIRECT: no page cache)


def have_fio() -> bool:
    return shutil.which("fio") is not None


class DiskLoad:
    """Two fio jobs in `directory` (one reading, one writing, O_DIRECT, io_uring), each held
    to its rate. `prepare()` once, then `with load.running(read_bps, write_bps): ...` around
    each timed piece; `moved` collects what each run achieved; `remove()` at the end."""

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
            subprocess.run(["fio", "--name=prep", f"--filename={self.dir / name}",
                            "--rw=write", f"--size={FILE_BYTES}", "--ioengine=io_uring",
                            "--direct=1", "--bs=4M", "--iodepth=8", "--output-format=json"],
                           check=True, capture_output=True)

    def running(self, read_bps: float, write_bps: float) -> "_Run":
        return _Run(self, int(read_bps), int(write_bps))

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class _Run:
    def __init__(self, load: DiskLoad, read_bps: int, write_bps: int) -> None:
        self.load = load
        common = ["--ioengine=io_uring", "--direct=1", f"--bs={load.block_size}",
                  f"--iodepth={load.depth}", f"--size={FILE_BYTES}", "--time_based",
                  "--runtime=600"]
        self.cmd = ["fio", "--output-format=json", *common,
                    "--name=read", f"--filename={load.dir / 'read.bin'}", "--rw=read",
                    f"--rate={max(read_bps, 1)}",
                    "--name=write", f"--filename={load.dir / 'write.bin'}", "--rw=write",
                    f"--rate=,{max(write_bps, 1)}"]

    def __enter__(self) -> "_Run":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        time.sleep(RAMP_SECONDS)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:  # the timed work failed: its error is the one to see
            self.proc.kill()
            self.proc.communicate()
            return
        # SIGINT: fio ends its jobs and still prints its JSON report.
        self.proc.send_signal(signal.SIGINT)
        out, err = self.proc.communicate(timeout=60)
        try:
            jobs = {j["jobname"]: j for j in json.loads(out[out.index("{"):])["jobs"]}
        except ValueError:
            raise RuntimeError(f"fio gave no report (exit {self.proc.returncode}): "
                               f"{err.strip()[-400:]}") from None
        self.load.moved.append({
            "read_bytes": jobs["read"]["read"]["io_bytes"],
            "read_seconds": jobs["read"]["read"]["runtime"] / 1e3,
            "write_bytes": jobs["write"]["write"]["io_bytes"],
            "write_seconds": jobs["write"]["write"]["runtime"] / 1e3})
