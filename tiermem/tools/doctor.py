"""`tiermem doctor`: what this machine offers tiermem, each line with a fix where one is needed.

In the spirit of DeepSpeed's `ds_report`: kernel, io_uring, O_DIRECT on each swap
path (the path checker's findings too), huge pages, the memlock limit, the CPU
features the native kernels use, torch and CUDA. It allocates nothing large and
writes only one empty probe file per existing swap path, removed at once.
"""

from __future__ import annotations

import errno
import os
import platform
import uuid
from dataclasses import dataclass, field

from tiermem.config import Settings
from tiermem.sizes import format_size
from tiermem.swap.paths import check_paths, expand
from tiermem.sysinfo import lockable_bytes


@dataclass
class Finding:
    topic: str
    status: str  # ok | warn | error | info
    detail: str
    fix: str = ""


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    def add(self, topic: str, status: str, detail: str, fix: str = "") -> None:
        self.findings.append(Finding(topic, status, detail, fix))

    @property
    def errors(self) -> int:
        return sum(f.status == "error" for f in self.findings)

    def lines(self) -> list[str]:
        mark = {"ok": "ok   ", "warn": "WARN ", "error": "ERROR", "info": "     "}
        out = []
        for f in self.findings:
            out.append(f"{mark[f.status]} {f.topic:<18} {f.detail}")
            if f.fix:
                out.append(f"{'':<25}fix: {f.fix}")
        return out


def _o_direct(path: str) -> str | None:
    """None when O_DIRECT opens work in `path`, else why not."""
    probe = os.path.join(path, f".tiermem-doctor-{uuid.uuid4().hex}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        return "refused by the filesystem" if exc.errno == errno.EINVAL else exc.strerror
    os.close(fd)
    os.unlink(probe)
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def diagnose(settings: Settings) -> Report:
    r = Report()
    r.add("kernel", "info", f"{platform.system()} {platform.release()} ({platform.machine()}), "
          f"Python {platform.python_version()}")
    from tiermem.io import io_uring_status
    ok, why = io_uring_status()
    r.add("io_uring", "ok" if ok else "warn", why or "available",
          "" if ok else "the threads backend works but costs CPU; io_uring needs Linux >= 5.6 "
          "and is often blocked by container seccomp profiles (docker --security-opt "
          "seccomp=unconfined, or sysctl kernel.io_uring_disabled=0)")

    report = check_paths(settings.swap.paths)
    for c in report.checks:
        status = "error" if c.errors else "warn" if c.warnings else "ok"
        where = f"{c.mount.fstype} at {c.mount.mountpoint}" if c.mount else "?"
        detail = f"{c.given} ({where})"
        if c.exists and not c.errors:
            why = _o_direct(os.path.normpath(expand(c.given)))
            detail += ", O_DIRECT " + ("works" if why is None else f"fails: {why}")
            if why is not None and status == "ok":
                status = "warn"
        elif not c.exists and not c.errors:
            detail += ", not created yet (O_DIRECT untested)"
        if c.notes:
            detail += "; " + "; ".join(c.notes)
        r.add("swap path", status, detail, "; ".join(c.errors + c.warnings))
    for w in report.warnings:
        r.add("swap stripes", "warn", w)
    for e in report.errors:
        r.add("swap paths", "error", e)

    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    r.add("huge pages", "info", f"transparent huge pages: {thp or 'unknown'}",
          "pinned buffers are faster to map with THP 'madvise' or 'always'"
          if thp and "[never]" in thp else "")
    lock = lockable_bytes()
    pinned = settings.tiers.host.capacity + \
        settings.pipeline.buffer_count * settings.pipeline.partition_size
    if lock is None:
        r.add("memlock", "ok", "unlimited (or CAP_IPC_LOCK)")
    else:
        short = lock < pinned
        r.add("memlock", "warn" if short else "ok",
              f"{format_size(lock)} may be page-locked; this config pins {format_size(pinned)}",
              "what cannot be locked stays pageable (slower, may be swapped out): raise it "
              "with `ulimit -l unlimited` or memlock in /etc/security/limits.conf"
              if short else "")

    flags = _cpu_flags()
    try:
        from tiermem.kernels.native_adam import isa, supported_isas
        r.add("native Adam", "ok", f"SIMD paths {', '.join(supported_isas())}; runs {isa()}")
    except Exception as exc:  # a missing build is what doctor is for
        r.add("native Adam", "error", f"the native module does not load: {exc}",
              "rebuild: pip install . (needs liburing-dev and a C compiler)")
    r.add("CRC32C", "ok" if "sse4_2" in flags else "info",
          "hardware CRC32C (SSE4.2)" if "sse4_2" in flags else
          "no SSE4.2: record checksums use the slower software CRC32C")

    import torch
    cuda = torch.cuda.is_available()
    r.add("torch", "ok", f"{torch.__version__}, {torch.get_num_threads()} CPU threads")
    if cuda:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        r.add("CUDA", "ok", f"{torch.version.cuda}: {names}")
    else:
        built = torch.version.cuda
        r.add("CUDA", "info", "no CUDA device: host and NVMe tiers only (tiers.gpu.capacity "
              "must be 0)" + (f"; torch was built with CUDA {built}" if built else
                              "; this torch is a CPU build"))
    return r
