"""tiermem.io: asynchronous file I/O over io_uring, with a thread-pool fallback."""

from tiermem.errors import TierMemIOError
from tiermem.io.engine import DIRECT_ALIGN, File, IOEngine, Request, io_uring_status

__all__ = ["DIRECT_ALIGN", "File", "IOEngine", "Request", "TierMemIOError", "io_uring_status"]
