"""cffi (API mode) build of ``tiermem._native`` from ``native/*.c`` against liburing.

setup.py names ``native/build_native.py:ffibuilder`` in ``cffi_modules``. Before
cffi runs the compiler we compile a five-line program that includes liburing.h
and links -luring; when that fails the build stops with one sentence naming the
package to install instead of a page of compiler output.

Environment:
  CC                        compiler (may carry flags), as for any Python build
  TIERMEM_LIBURING_PREFIX   a liburing installed outside the system paths
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ["io_engine.c", "memory.c", "thread_pool.c", "adam.c", "adam_lowbit.c", "crc32c.c",
           "rules.c", "edits.c"]

MISSING_LIBURING = (
    "tiermem: cannot build the native I/O engine: liburing development files "
    "(liburing.h and -luring) were not found. Install them with "
    "'apt-get install liburing-dev' (Debian/Ubuntu), 'dnf install liburing-devel' "
    "(Fedora/RHEL) or 'apk add liburing-dev' (Alpine), or point "
    "TIERMEM_LIBURING_PREFIX at a liburing install, then build again."
)

PROBE_PROGRAM = """
#include <liburing.h>
int main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0) < -1000; }
"""


OPENMP_PROBE = """
#include <omp.h>
int main(void) { int n = 0;
#pragma omp parallel reduction(+:n)
    n += 1;
    return n < 1 || omp_get_max_threads() < 1; }
"""


def openmp_flags() -> list[str]:
    """["-fopenmp"] when the compiler builds and links an OpenMP program, else [] (adam.c
    then runs on its own pthread pool). TIERMEM_NO_OPENMP=1 leaves it out."""
    if os.environ.get("TIERMEM_NO_OPENMP", "") not in ("", "0"):
        return []
    with tempfile.TemporaryDirectory(prefix="tiermem-build-") as tmp:
        src = Path(tmp) / "omp.c"
        src.write_text(OPENMP_PROBE)
        cmd = _compiler() + ["-fopenmp", str(src), "-o", str(Path(tmp) / "omp")]
        try:
            ok = subprocess.run(cmd, capture_output=True).returncode == 0
        except OSError:
            ok = False
    return ["-fopenmp"] if ok else []


class LiburingMissing(SystemExit):
    """Raised (as a SystemExit, so pip prints only the message) when liburing is absent."""


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _prefix_flags() -> tuple[list[str], list[str]]:
    prefix = os.environ.get("TIERMEM_LIBURING_PREFIX")
    if not prefix:
        return [], []
    p = Path(prefix)
    return [str(p / "include")], [str(p / "lib"), str(p / "lib64")]


def check_liburing() -> None:
    """Compile and link a tiny liburing program; raise LiburingMissing if it fails."""
    includes, libdirs = _prefix_flags()
    with tempfile.TemporaryDirectory(prefix="tiermem-build-") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(PROBE_PROGRAM)
        cmd = _compiler() + [str(src), "-o", str(Path(tmp) / "probe")]
        cmd += [f"-I{d}" for d in includes] + [f"-L{d}" for d in libdirs] + ["-luring"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise LiburingMissing(
                f"tiermem: cannot build the native I/O engine: no C compiler ({cmd[0]}: "
                f"{exc.strerror}). Install one with 'apt-get install build-essential'."
            ) from None
    if proc.returncode != 0:
        raise LiburingMissing(MISSING_LIBURING)


def make_ffibuilder() -> FFI:
    check_liburing()
    includes, libdirs = _prefix_flags()
    # adam.c's threads are OpenMP's when it can be had. The module links libgomp.so.1 by
    # that name; tiermem imports torch first (tiermem/_lib.py), so the loader hands it the
    # libgomp torch's CPU wheel already loaded, and one team serves both.
    omp = openmp_flags()
    ffi = FFI()
    ffi.cdef((HERE / "tiermem_native.h").read_text())
    ffi.set_source(
        "tiermem._native",
        '#include "tiermem_native.h"\n',
        sources=[os.path.relpath(HERE / s) for s in SOURCES],  # setuptools wants relative paths
        include_dirs=[os.path.relpath(HERE)] + includes,
        library_dirs=libdirs,
        libraries=["uring", "pthread", "m"],
        # -ffp-contract=off: adam.c's and adam_lowbit.c's SIMD and scalar paths must round alike, so
        # no multiply-add may be fused unless the source asks for an FMA.
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function",
                            "-ffp-contract=off", *omp],
        extra_link_args=omp,
    )
    return ffi


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    # `python native/build_native.py` builds in place, for quick iteration.
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=bool(os.environ.get("V")))
    print("built tiermem._native", file=sys.stderr)
