"""tiermem: NVMe tiered memory for PyTorch optimizer state."""

from tiermem.io.buffers import BufferPool, aligned_empty
from tiermem.config import ConfigError, Settings, load_config
from tiermem.context import Offload, offload
from tiermem.errors import TierMemError, TierMemIOError, TierMemWarning
from tiermem.io import IOEngine

__version__ = "0.1.0"

__all__ = ["BufferPool", "ConfigError", "IOEngine", "Offload", "Settings", "TierMemError",
           "TierMemIOError", "TierMemWarning", "aligned_empty", "load_config", "offload",
           "__version__"]
