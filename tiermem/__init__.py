"""tiermem: NVMe tiered memory for PyTorch optimizer state."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Imported on first use (PEP 562): `tiermem --version`, `validate`, `ls` and the other
# commands that need no torch start in a fraction of a second instead of several.
_LAZY = {
    "BufferPool": "tiermem.io.buffers", "aligned_empty": "tiermem.io.buffers",
    "ConfigError": "tiermem.config", "Settings": "tiermem.config",
    "load_config": "tiermem.config",
    "Offload": "tiermem.context", "offload": "tiermem.context",
    "TierMemError": "tiermem.errors", "TierMemIOError": "tiermem.errors",
    "TierMemWarning": "tiermem.errors",
    "IOEngine": "tiermem.io",
}

__all__ = [*sorted(_LAZY), "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiermem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
