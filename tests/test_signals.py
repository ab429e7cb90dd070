"""SIGINT and SIGTERM during training: the block exits cleanly, says where the state is,
and never leaves a swap directory half deleted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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


@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_training_hands_state_back(tmp_path, sig, durability):
    """Scratch mode abandons the step where it stood; crash-consistent mode rolls it back
    to the last commit. Either way the state comes back whole and the directory goes."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), durability],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "caught" in out and out.split()[-1] == "4"  # 4 params have their state back
    assert "tiermem: interrupted" in err and "handed back to the optimizer" in err
    assert os.listdir(tmp_path) == []  # the run directory is gone, whole
