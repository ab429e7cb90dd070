"""Choosing io_uring or the thread pool, and what is said when io_uring is unavailable."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from conftest import IS_ROOT, REPO, needs_io_uring
from tiermem.errors import TierMemIOError, TierMemWarning
from tiermem.io import IOEngine, io_uring_status, uring_backend

REFUSALS = [
    (errno.EPERM, "io_uring_disabled"),
    (errno.ENOSYS, "no io_uring"),
    (errno.EACCES, "security module"),
    (errno.EINVAL, "unexpected"),
]


def tiermem_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, TierMemWarning)]


@pytest.fixture(params=REFUSALS, ids=[errno.errorcode[e] for e, _ in REFUSALS])
def refused(request, monkeypatch, reset_once_warnings):
    """io_uring_setup 'fails' with the given errno; yields (errno, hint the reason should give)."""
    err, hint = request.param
    monkeypatch.setattr(uring_backend, "probe", lambda: err)
    return err, hint


def test_io_uring_status_says_why(refused):
    """io_uring_status() is (False, reason) with the errno text and a hint at the cause."""
    err, hint = refused
    ok, why = io_uring_status()
    assert ok is False
    assert os.strerror(err) in why and hint in why


def test_auto_falls_back_to_threads_with_one_warning(refused, tmp_path):
    """backend="auto" uses threads, warns once per process however many engines, and works."""
    err, _ = refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engines = [IOEngine("auto"), IOEngine("auto")]
    assert [e.backend for e in engines] == ["threads", "threads"]
    msgs = tiermem_warnings(caught)
    assert len(msgs) == 1
    assert os.strerror(err) in msgs[0] and "threads" in msgs[0]
    with engines[0] as eng, eng.open(tmp_path / "f", "w", direct=False) as f:
        eng.write(f, b"hello", 0).wait()
        out = bytearray(5)
        eng.read(f, out, 0).wait()
    engines[1].close()
    assert out == b"hello"


def test_forced_io_uring_unavailable_raises(refused):
    """backend="io_uring" where it is refused raises TierMemIOError saying why."""
    err, hint = refused
    with pytest.raises(TierMemIOError) as info:
        IOEngine("io_uring")
    assert info.value.op == "io_uring_setup"
    assert os.strerror(err) in str(info.value) and hint in str(info.value)


def test_forced_io_uring_error_carries_errno(monkeypatch):
    """The io_uring-unavailable TierMemIOError sets .errno, like every other TierMemIOError."""
    monkeypatch.setattr(uring_backend, "probe", lambda: errno.EPERM)
    with pytest.raises(TierMemIOError) as info:
        IOEngine("io_uring")
    assert info.value.errno == errno.EPERM


def test_threads_backend_does_not_probe(monkeypatch):
    """backend="threads" never calls io_uring_setup."""
    def probe():
        raise AssertionError("probed io_uring")
    monkeypatch.setattr(uring_backend, "probe", probe)
    with IOEngine("threads") as eng:
        assert eng.backend == "threads"


@needs_io_uring
def test_auto_prefers_io_uring(reset_once_warnings):
    """Where io_uring works, backend="auto" uses it, silently."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with IOEngine("auto") as eng:
            assert eng.backend == "io_uring"
    assert tiermem_warnings(caught) == []


# -- the real thing: kernel.io_uring_disabled=2 -------------------------------------------------

SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")

CHILD = """
import json, sys, warnings
from tiermem.errors import TierMemIOError, TierMemWarning
from tiermem.io import IOEngine, io_uring_status
print("ready", flush=True)
sys.stdin.readline()                       # the parent has disabled io_uring
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["status"] = io_uring_status()
    auto = IOEngine("auto")
    try:
        IOEngine("io_uring")
        out["forced"] = None
    except TierMemIOError as exc:
        out["forced"] = [str(exc), exc.op]
print("built", flush=True)                 # the parent restores the sysctl now
out["auto"] = auto.backend
out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, TierMemWarning)]
with auto, auto.open(sys.argv[1], "w", direct=False) as f:
    auto.write(f, b"abc", 0).wait()
print(json.dumps(out), flush=True)
"""


def test_kernel_io_uring_disabled(tmp_path):
    """With kernel.io_uring_disabled=2: auto falls back with one warning, io_uring raises EPERM.

    The sysctl is system-wide, so it is set only while the (already imported)
    child builds its engines, and always restored.
    """
    if not IS_ROOT or not SYSCTL.exists():
        pytest.skip("needs root and the kernel.io_uring_disabled sysctl")
    original = SYSCTL.read_text().strip()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "f")], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        try:
            SYSCTL.write_text("2")
        except OSError as exc:
            pytest.skip(f"cannot write {SYSCTL}: {exc}")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "built", proc.stderr.read()
    finally:
        SYSCTL.write_text(original)
        watchdog.cancel()
        if sys.exc_info()[0] is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["status"][0] is False and os.strerror(errno.EPERM) in out["status"][1]
    assert out["auto"] == "threads"
    assert len(out["warnings"]) == 1 and "io_uring" in out["warnings"][0]
    assert out["forced"] is not None and out["forced"][1] == "io_uring_setup"
    assert os.strerror(errno.EPERM) in out["forced"][0]
    assert SYSCTL.read_text().strip() == original
