"""Small helpers every benchmark script shares: sizes, a markdown table, JSON, machine facts.

Sizes use tiermem's own parser; everything else is free of tiermem imports, so
a benchmark can still report on a machine where the package fails to load.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

def parse_size(text: str) -> int:
    """Bytes in "4GiB", "512MiB", "1M" or "4096" (tiermem's own parser, one rule everywhere)."""
    return _tiermem_sizes().parse_size(text)


def format_size(nbytes: int) -> str:
    """The shortest exact IEC spelling of `nbytes`, e.g. 4294967296 -> "4GiB"."""
    return _tiermem_sizes().yaml_size(nbytes)


def _tiermem_sizes():
    # Imported on use, so the table and JSON helpers still work where tiermem does not load.
    from tiermem import sizes
    return sizes


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table with padded columns, readable as plain text too."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def fio_layout(path: str | os.PathLike, nbytes: int) -> None:
    """Write `nbytes` to `path` with fio (O_DIRECT, io_uring): a file for fio jobs to read,
    or to overwrite in place (O_DIRECT writes that extend a file are slow on ext4)."""
    subprocess.run(["fio", "--name=prep", f"--filename={path}", "--rw=write",
                    f"--size={nbytes}", "--ioengine=io_uring", "--direct=1", "--bs=4M",
                    "--iodepth=8", "--output-format=json"], check=True, capture_output=True)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as indented JSON, creating parent folders; atomic, so a reader never
    sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (platform.processor() is often empty)."""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_total_bytes() -> int | None:
    """Physical memory, from /proc/meminfo."""
    m = re.search(r"^MemTotal:\s+(\d+) kB", _read("/proc/meminfo"), re.M)
    return int(m.group(1)) * 1024 if m else None


def git_revision(repo: str | os.PathLike) -> str | None:
    """HEAD of the repository at `repo`, with "+dirty" when the tree has changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge figures from another machine: kernel, CPU, memory."""
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "os": _read("/etc/os-release").partition('PRETTY_NAME="')[2].partition('"')[0] or None,
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "mem_total_bytes": mem_total_bytes(),
        "python": platform.python_version(),
    }
