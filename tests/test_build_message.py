"""native/build_native.py stops with one readable sentence when liburing or a compiler is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.fixture
def native_copy(tmp_path):
    """A copy of native/ in a scratch dir, so that a build that wrongly proceeds lands there."""
    shutil.copytree(REPO / "native", tmp_path / "native",
                    ignore=shutil.ignore_patterns("*.o", "__pycache__"))
    return tmp_path


def run_build(where, args, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("CC", "TIERMEM_LIBURING_PREFIX")}
    full_env.update(env)
    return subprocess.run([sys.executable, *args], cwd=where, env=full_env, capture_output=True,
                          text=True, timeout=300)


def test_missing_liburing_says_what_to_install(native_copy):
    """A compiler that cannot see liburing: non-zero exit, 'liburing-dev' on stderr, no traceback."""
    proc = run_build(native_copy, ["native/build_native.py"], CC="gcc --sysroot=/nonexistent")
    assert proc.returncode != 0
    assert "liburing-dev" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not list(native_copy.rglob("_native*.so"))  # stopped before compiling


def test_missing_compiler_says_what_to_install(native_copy):
    """A CC that does not exist: non-zero exit, one sentence naming the compiler, no traceback."""
    proc = run_build(native_copy, ["native/build_native.py"], CC="/nonexistent/bin/cc -O2")
    assert proc.returncode != 0
    assert "/nonexistent/bin/cc" in proc.stderr and "C compiler" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("prefix", [None, "/usr", "/nonexistent/liburing"])
def test_liburing_check_passes_on_this_machine(native_copy, prefix):
    """With liburing-dev installed the check passes, with or without TIERMEM_LIBURING_PREFIX."""
    env = {} if prefix is None else {"TIERMEM_LIBURING_PREFIX": prefix}
    code = "import sys; sys.path.insert(0, 'native'); import build_native; print('checked')"
    proc = run_build(native_copy, ["-c", code], **env)
    assert proc.returncode == 0, proc.stderr
    assert "checked" in proc.stdout
