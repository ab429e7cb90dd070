"""Shared fixtures: engines on both backends, aligned buffers, scratch mounts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tiermem  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tiermem  # noqa: F401

import torch
from hypothesis import HealthCheck, settings

from tiermem.io.buffers import aligned_empty
from tiermem.io import IOEngine, io_uring_status
from tiermem.kernels.vml import resolve_vml_dispatch

# The plain torch optimizers the tests compare against run here too: their first sqrt
# must not be a racy first VML call either (tiermem/kernels/vml.py).
resolve_vml_dispatch()

# torch's test utilities (the optimizer database the parity tests read) load a
# hypothesis profile of their own when first imported, which would replace ours for every
# test module imported after them: import them first, then load ours.
with contextlib.suppress(ImportError):
    import torch.testing._internal.common_utils  # noqa: F401

settings.register_profile(
    "tiermem", deadline=None, max_examples=100, print_blob=True,
    # The examples reuse one tmp_path file, rewritten (mode "w") by every example.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile("tiermem")

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ["io_uring", "threads"]
IS_ROOT = os.geteuid() == 0


def backend_param(name: str):
    """A pytest param for `name` that skips io_uring where the kernel refuses it."""
    if name == "io_uring":
        ok, why = io_uring_status()
        return pytest.param(name, marks=pytest.mark.skipif(not ok, reason=why))
    return pytest.param(name)


BACKEND_PARAMS = [backend_param(b) for b in BACKENDS]
# Kill-point sweeps run every point with every combination only with
# TIERMEM_FULL_SWEEP=1 (docs/dev/reliability.md); by default see sweep().
FULL_SWEEP = os.environ.get("TIERMEM_FULL_SWEEP") == "1"


def sweep(points: list, combos: list) -> list[tuple]:
    """(combination, point) pairs of a kill-point sweep: all of them with FULL_SWEEP, else
    each point once with the combinations taken in turn, so that every point and every
    combination still runs (a kill costs a child process: the whole cross would double
    the suite)."""
    if FULL_SWEEP:
        return [(c, p) for c in combos for p in points]
    return [(combos[i % len(combos)], p) for i, p in enumerate(points)]
_URING_OK, _URING_WHY = io_uring_status()
needs_io_uring = pytest.mark.skipif(not _URING_OK, reason=_URING_WHY)


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request) -> str:
    """Each backend name in turn."""
    return request.param


@pytest.fixture
def engine(backend):
    """An engine with a small block size so that modest transfers are split into pieces."""
    eng = IOEngine(backend, queue_depth=8, block_size=16384)
    assert eng.backend == backend
    yield eng
    eng.close()


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request) -> bool:
    return request.param


def aligned(nbytes: int, dtype=torch.uint8) -> torch.Tensor:
    """A small page-aligned test buffer (4 KiB pages, not locked)."""
    return aligned_empty(nbytes, dtype, huge_pages=False, lock=False)


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` reproducible random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def filled(nbytes: int, seed: int) -> torch.Tensor:
    """An aligned buffer holding pattern(nbytes, seed)."""
    buf = aligned(nbytes)
    buf.copy_(pattern(nbytes, seed))
    return buf


def read_file(path, offset: int = 0, nbytes: int | None = None) -> bytes:
    """The file's bytes, read with plain Python I/O (the oracle the engine is checked against)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read() if nbytes is None else f.read(nbytes)


@pytest.fixture
def reset_once_warnings(monkeypatch):
    """Forget which once-per-process TierMemWarnings were already issued."""
    import tiermem.io.buffers as buffers_mod
    import tiermem.io.engine as engine_mod
    monkeypatch.setattr(engine_mod, "_warned", set())
    monkeypatch.setattr(buffers_mod, "_warned_unlocked", False)


@contextlib.contextmanager
def mounted(where: Path, fstype: str, options: str | None = None):
    """Mount a fresh `fstype` on `where` for the duration; skip when that is not possible."""
    if not IS_ROOT:
        pytest.skip(f"mounting {fstype} needs root")
    where.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(where)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount {fstype}: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        # Lazy, so that a file an engine still holds open cannot leave the mount behind.
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def ramfs_dir(tmp_path):
    """A ramfs mount (a filesystem that refuses O_DIRECT)."""
    with mounted(tmp_path / "ramfs", "ramfs") as d:
        yield d


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, for running out of space."""
    with mounted(tmp_path / "tiny", "tmpfs", "size=1m,mode=0700") as d:
        yield d


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory on a read-only mount (root ignores chmod, so remount a tmpfs ro)."""
    with mounted(tmp_path / "ro", "tmpfs", "size=1m,mode=0700") as d:
        (d / "existing").write_bytes(b"x" * 4096)
        proc = subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot remount tmpfs read-only: {proc.stderr.strip()}")
        yield d


def run_without_ipc_lock(script: str, *args: str) -> dict:
    """Run `script` (python -c) without CAP_IPC_LOCK, so RLIMIT_MEMLOCK binds even for root;
    returns the JSON object its last stdout line prints. Skips where that is impossible."""
    import json
    import shutil

    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_IPC_LOCK")
    cmd = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock",
           sys.executable, "-c", script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    if proc.returncode != 0 and "setpriv" in proc.stderr:
        pytest.skip(f"setpriv cannot drop CAP_IPC_LOCK here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out.get("cap"):
        pytest.skip("the child kept CAP_IPC_LOCK")
    return out


# -- the suite's length (docs/dev/testing.md, "Two tiers") ---------------------------------

# Files whose subject is the I/O backends themselves: every case on both, always.
BACKEND_SUBJECT = {
    "test_io_engine.py", "test_io_errors.py", "test_io_follow.py", "test_faults.py",
    "test_buffers.py", "test_backend_selection.py", "test_integrity.py",
    "test_durability.py", "test_drive_failure.py", "test_powerloss.py", "test_swap_safety.py",
}


def _backend_twins(items: list) -> list:
    """The items to leave out of the default tier: of each case parametrized over the two
    backends in a file whose subject is not the backends, the twin on one backend, taking
    the backends in turn case by case, so that every table still runs on both."""
    groups: dict[tuple, list] = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or "backend" not in spec.params or item.path.name in BACKEND_SUBJECT:
            continue
        rest = tuple(sorted((k, repr(v)) for k, v in spec.params.items() if k != "backend"))
        groups.setdefault((item.nodeid.split("[", 1)[0], rest), []).append(item)
    turn: dict[str, int] = {}
    drop = []
    for (function, _), twins in groups.items():
        if len(twins) < 2:
            continue
        if not _URING_OK:  # io_uring's twins are skipped here: run the thread backend's
            keep = next(t for t in twins if t.callspec.params["backend"] != "io_uring")
        else:
            keep = twins[turn.get(function, 0) % len(twins)]
            turn[function] = turn.get(function, 0) + 1
        drop += [t for t in twins if t is not keep]
    return drop


_LEFT_OUT = pytest.StashKey[tuple]()  # (backend twins, long tests) the default tier left out


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long: in the full tier only (TIERMEM_FULL_SWEEP=1, `make test-full`): a "
        "slower variant of what a default-tier test also checks")


def pytest_collection_modifyitems(config, items):
    if FULL_SWEEP:
        return
    drop = _backend_twins(items)
    drop_ids = {id(t) for t in drop}
    long = [t for t in items if id(t) not in drop_ids and t.get_closest_marker("long")]
    drop_ids |= {id(t) for t in long}
    if drop_ids:
        config.hook.pytest_deselected(items=[t for t in items if id(t) in drop_ids])
        items[:] = [t for t in items if id(t) not in drop_ids]
    config.stash[_LEFT_OUT] = (len(drop), len(long))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    twins, long = config.stash.get(_LEFT_OUT, (0, 0))
    if twins or long:
        terminalreporter.write_line(
            f"tiermem: the default tier left out {twins} backend twins (each case ran on one "
            f"backend, in turn) and {long} long tests; TIERMEM_FULL_SWEEP=1 (make test-full) "
            "runs them")
