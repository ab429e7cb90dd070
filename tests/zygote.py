"""Child processes that start in a tenth of a second: forked from a server that has already
imported torch and tiermem.

A crash test's child (crash_run.py, killed at a chosen point) spent about 3.5 of its
4.5 s importing torch and tiermem on the 2-core host, and the suite starts ~80 of them.
multiprocessing's forkserver imports those modules once, in a process of its own that
has run nothing else, and forks each child from it: the child gets a clean interpreter
with the modules loaded and none of pytest's threads, open engines or patched functions
(forking pytest itself would copy all of those).

Also the distributed tests' ranks (dist_harness.py), which import torch.distributed.

Only for children that die by a signal or exit through the script's own end: a forked
child leaves through os._exit (multiprocessing's bootstrap), so a script whose test is
about interpreter shutdown (atexit hooks, finalizers: test_exit_open_block.py,
test_signals.py) still runs as a real `python` process.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

# torch._dynamo: torch.optim.Optimizer.__init__ imports it (3.7 s of a crash child's 4.5).
# Not tiermem's native library: loaded before a fork, it marks every child as forked and
# runs it on its own thread pool instead of OpenMP's, which a fresh process would not.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "crash_run", "dist_harness"]
_ctx = None


@dataclass
class Finished:
    """What subprocess.run's CompletedProcess says, for a forked child."""
    returncode: int  # negative: killed by that signal, as subprocess reports it
    stdout: str
    stderr: str


def context():
    """The forkserver context (started on first use), for multiprocessing's Process and
    Queue: dist_harness.py starts its ranks from it."""
    global _ctx
    if _ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        # The server is started on first use with this module's directory on its sys.path
        # (the parent's sys.path travels with the preload), so crash_run imports there.
        ctx.set_forkserver_preload(PRELOAD)
        _ctx = ctx
    return _ctx


def _child(script: str, argv: list[str], out: str, err: str) -> None:
    # fds 1 and 2 point at the files before anything prints: the child's own prints, the
    # native code's and a traceback all land there, and survive a SIGKILL (no buffer in
    # this process holds them: crash_run flushes before it kills itself).
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_script(script: str | Path, *argv: str, timeout: float = 120) -> Finished:
    """`python script argv...` as a forked child; raises TimeoutError (after killing it)
    when it runs past `timeout` seconds."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = context().Process(target=_child, args=(str(script), list(argv), out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise TimeoutError(f"{script} {' '.join(argv)} ran past {timeout} s")
        return Finished(proc.exitcode, Path(out).read_text(), Path(err).read_text())
