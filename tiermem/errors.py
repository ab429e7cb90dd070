"""Exception types every layer raises; kept in one leaf module so that no layer imports upward."""

from __future__ import annotations

import errno as _errno
import os


class TierMemError(Exception):
    """Base class of tiermem's own errors."""


class TierMemWarning(UserWarning):
    """A degraded but working set-up: a fallback backend, unlocked buffers, buffered I/O."""


class TierMemIOError(TierMemError, OSError):
    """An I/O operation failed: names the operation, file, offset, length and errno."""

    def __init__(self, message: str, *, op: str | None = None, path: str | None = None,
                 offset: int | None = None, length: int | None = None,
                 errno: int | None = None) -> None:
        OSError.__init__(self, message)
        self.op = op
        self.path = path
        self.offset = offset
        self.length = length
        # OSError's own errno slot, so `except OSError as e: e.errno` works.
        self.errno = errno

    def __str__(self) -> str:
        return self.args[0]

    @classmethod
    def from_failure(cls, *, op: str, path: str, offset: int, length: int,
                     err: int, follows_write: bool = False) -> "TierMemIOError":
        """Build the error for a failed transfer; err is a positive errno; follows_write:
        a read that followed a write into its memory (IOEngine.read(after=...))."""
        if op == "read" and err == _errno.ENODATA:
            why = "unexpected end of file (was the file truncated while in use?)"
        elif follows_write and err == _errno.ECANCELED:
            why = ("cancelled (ECANCELED): the write it follows failed, and the memory "
                   "from here on still holds that write's bytes")
        else:
            why = f"{os.strerror(err)} ({_errno.errorcode.get(err, err)})"
        return cls(f"{op} of {length} bytes at offset {offset} in {path} failed: {why}",
                   op=op, path=path, offset=offset, length=length, errno=err)


class WeightsLost(TierMemError):
    """The parameter tier could not give some weights (or gradients) back to the model at
    the end of a block (a record that cannot be read): those parameters are left empty."""

    def __init__(self, names: list[str], cause: BaseException) -> None:
        self.names = list(names)
        shown = ", ".join(self.names[:5]) + (", ..." if len(self.names) > 5 else "")
        super().__init__(f"the weights of {len(self.names)} parameter(s) ({shown}) could not "
                         f"be read back from the parameter tier ({cause}); the model holds "
                         "them as empty tensors (a gradient named: that gradient is None)")
