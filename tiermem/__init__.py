"""tiermem: NVMe tiered memory for PyTorch optimizer state."""

from tiermem.buffers import BufferPool, aligned_empty
from tiermem.errors import TierMemError, TierMemIOError, TierMemWarning
from tiermem.io import IOEngine

__version__ = "0.1.0"

__all__ = ["BufferPool", "IOEngine", "TierMemError", "TierMemIOError", "TierMemWarning",
           "aligned_empty", "__version__"]
