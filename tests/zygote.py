"""Child processes that start in a tenth of a second: forked from a server that has already
imported torch.

A test's child (crash_run.py killed at a chosen point, `python -m tiermem ...`, a bench
script at a toy size) spent 3-4 s of its run importing torch and torch._dynamo on the
2-core host, and the suite starts hundreds of them. multiprocessing's forkserver
imports those modules once, in a process of its own that has run nothing else, and
forks each child from it: the child gets a clean interpreter with the modules loaded
and none of pytest's threads, open engines or patched functions (forking pytest itself
would copy all of those). The distributed tests' ranks (dist_harness.py) start from it
too.

What differs from `python ...`: the child ends with os._exit after the script's atexit
hooks (run_python runs them), so the interpreter's teardown after those never runs.
Tests about that teardown, or about a fresh process's own figures (peak RSS), start a
real `python`: test_exit_open_block.py, test_signals.py, test_params_stress.py.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
import threading
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


def _child(args: list[str], out: str, err: str, cwd: str | None, env: dict | None) -> None:
    # fds 1 and 2 point at the files before anything prints: the child's own prints, the
    # native code's and a traceback all land there, and survive a SIGKILL (no buffer in
    # this process holds them: crash_run flushes before it kills itself).
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    try:
        if args[0] == "-m":
            # as `python -m`: the working directory first on sys.path, argv[0] the module's
            # file (run_module sets it)
            sys.path.insert(0, os.getcwd())
            sys.argv = ["-m", *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    finally:
        # What an interpreter's exit runs before its teardown: non-daemon threads joined,
        # then the atexit hooks (tiermem's leave an open block). multiprocessing ends
        # the child with os._exit after this, which skips both.
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def run_python(*args: object, cwd: str | Path | None = None, env: dict | None = None,
               timeout: float = 120) -> Finished:
    """`python *args` (a script and its arguments, or "-m", a module and its arguments; each
    taken as its str(), so paths and numbers may be passed as they are) as
    a forked child, with `env` as its whole environment when given; raises TimeoutError
    (after killing it) when it runs past `timeout` seconds."""
    import tempfile

    args = [str(a) for a in args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = context().Process(target=_child, args=(
            args, out, err, None if cwd is None else str(cwd),
            None if env is None else dict(env)))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise TimeoutError(f"python {' '.join(args)} ran past {timeout} s")
        return Finished(proc.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    # absent when the child died before its first line ran (the server could not fork)
    return Path(path).read_text() if os.path.exists(path) else ""
