"""The compiled cffi module, with a message that says how to build it when it is missing."""

from __future__ import annotations

# torch first: the native module links libgomp.so.1 (native/adam.c's threads are OpenMP's),
# and loaded after torch it shares the libgomp torch's wheel brought, so one OpenMP team
# serves ATen and tiermem's kernels; loaded before, torch would get the system's instead.
import torch  # noqa: F401, E402

try:
    from tiermem._native import ffi, lib  # noqa: F401  (re-exported)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "tiermem's native module (tiermem._native) is not built. Install the package with "
        "`pip install -e .` from the source tree; the build needs liburing-dev and a C compiler."
    ) from exc
