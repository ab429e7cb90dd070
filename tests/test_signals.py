"""SIGINT and SIGTERM during training: the block exits cleanly, says where the state is,
and never leaves a swap directory half deleted."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BACKEND_PARAMS, FULL_SWEEP, sweep

SCRIPT = r"""
import sys, torch, tiermem
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
o = torch.optim.AdamW(m.parameters())
cfg = {"swap": {"paths": [sys.argv[1]], "durability": sys.argv[2]}, "tiers": {"host": {"capacity": 0}},
       "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2}}
try:
    with tiermem.offload(o, cfg):
        step = 0
        while True:
            m(torch.randn(8, 256)).square().mean().backward()
            o.step(); o.zero_grad(); step += 1
            if step == 3:
                print("ready", flush=True)
except KeyboardInterrupt as e:
    print("caught", type(e).__name__, len(o.state), flush=True)
    sys.exit(3)
"""


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so that Python installs its
    KeyboardInterrupt handler even when this test runs in a background job (which starts
    with SIGINT ignored, and Python then leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Each signal with one durability (the other pair with TIERMEM_FULL_SWEEP=1): the handler
# does not depend on the durability, the hand-back does and each runs once.
@pytest.mark.parametrize("sig,durability", [
    pytest.param(s, d, id=f"{s.name}-{d}")
    for s, d in sweep(["scratch", "crash_consistent"], [signal.SIGINT, signal.SIGTERM])])
def test_signal_mid_training_hands_state_back(tmp_path, sig, durability):
    """Scratch mode abandons the step where it stood; crash-consistent mode rolls it back
    to the last commit. Either way the state comes back whole and the directory goes."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), durability],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a child that missed the signal trains forever: never leave it running
        proc.wait()
    assert proc.returncode == 3, err
    assert "caught" in out and out.split()[-1] == "4"  # 4 params have their state back
    assert "tiermem: interrupted" in err and "handed back to the optimizer" in err
    assert os.listdir(tmp_path) == []  # the run directory is gone, whole


# The signal arrives while a record is being sealed for its write-back (its generation
# counted, its write not yet issued): it must wait for a point where no write is half
# issued, or the exit finds a record one generation older than it expects.
SEAL_SCRIPT = r"""
import os, signal, sys, torch, tiermem, tiermem.swap.store
where, durability, backend, signame = sys.argv[2:6]
sig = getattr(signal, signame)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
o = torch.optim.AdamW(m.parameters())
cfg = {"swap": {"paths": [sys.argv[1]], "durability": durability},
       "tiers": {"host": {"capacity": 0}}, "io": {"backend": backend},
       "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2}}
seal = tiermem.swap.store.seal
armed = [0]  # signal during the armed[0]-th seal from now (the 1st stays in its buffer)
def seal_and_signal(*args, **kwargs):
    if armed[0]:
        armed[0] -= 1
        if not armed[0]:
            os.kill(os.getpid(), sig)  # Python runs the handler at the next bytecode: here
    return seal(*args, **kwargs)
tiermem.swap.store.seal = seal_and_signal
try:
    with tiermem.offload(o, cfg):
        for step in range(1, 4):
            m(torch.randn(8, 256)).square().mean().backward()
            armed[0] = 2 if step == 3 and where == "step" else 0
            o.step(); o.zero_grad()
        armed[0] = 2 if where == "state_dict" else 0
        sd = o.state_dict()
        for _ in range(2):
            m(torch.randn(8, 256)).square().mean().backward()
            o.step(); o.zero_grad()
    print("no signal", flush=True)
except KeyboardInterrupt as e:
    print("caught", type(e).__name__, len(o.state), flush=True)
    sys.exit(3)
"""


def _seal_cases() -> list:
    """(backend, signal, durability, where): the whole cross with TIERMEM_FULL_SWEEP=1,
    else five rows that hold every pair of values of any two of the four (each process
    costs seconds; the 16-row cross took a minute and a half of the suite)."""
    backends = [b.values[0] for b in BACKEND_PARAMS]
    values = (backends, ["SIGINT", "SIGTERM"], ["scratch", "crash_consistent"],
              ["step", "state_dict"])
    if FULL_SWEEP:
        rows = list(itertools.product(*[range(len(v)) for v in values]))
    else:
        rows = [(0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)]
    cases = []
    for row in rows:
        case = tuple(v[i % len(v)] for v, i in zip(values, row))
        marks = next(b.marks for b in BACKEND_PARAMS if b.values[0] == case[0])
        cases.append(pytest.param(*case, marks=marks, id="-".join(case)))
    return cases


@pytest.mark.parametrize("backend,signame,durability,where", _seal_cases())
def test_signal_while_a_record_is_sealed_waits_for_a_safe_point(tmp_path, where, durability,
                                                                signame, backend):
    proc = subprocess.run([sys.executable, "-c", SEAL_SCRIPT, str(tmp_path), where,
                           durability, backend, signame],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=_default_sigint)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["caught", "Terminated" if signame == "SIGTERM"
                                   else "KeyboardInterrupt", "4"]
    assert "handed back to the optimizer" in proc.stderr
    assert "IntegrityError" not in proc.stderr
    assert os.listdir(tmp_path) == []
