"""A tiermem.offload block still open when the interpreter exits (an ExitStack never
closed, a REPL that quit) is left by tiermem's exit hook, before teardown, the way an
exception through it would leave it: the process exits cleanly, a warning names the block,
and the state handed back equals the plain optimizer's.

Without the hook the block's generator is finalised during interpreter teardown and the
process aborts inside torch (an INTERNAL ASSERT in THPVariable_clear, exit status 134):
`TIERMEM_TEST_NO_EXIT_HOOK=1` unregisters it, and the first case then fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import BACKEND_PARAMS

CHILD = r"""
import atexit, contextlib, copy, json, os, sys, torch, tiermem
from tiermem import context
swap, backend, extra, blocks = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
runs = []
for b in range(blocks):
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64))
    plain_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    runs.append((model, opt, plain_model, plain))

def check():
    # registered before the blocks open: atexit runs it after tiermem's hook left them
    worst = 0.0
    for model, opt, plain_model, plain in runs:
        for p, q in zip(model.parameters(), plain_model.parameters()):
            worst = max(worst, (p - q).abs().max().item())
            for k in ("exp_avg", "exp_avg_sq"):
                worst = max(worst, (opt.state[p][k] - plain.state[q][k]).abs().max().item())
    print("CHECK", json.dumps({"worst": worst, "states": [len(o.state) for _, o, _, _ in runs]}),
          flush=True)

atexit.register(check)
cfg = {**extra, "swap": {**extra.get("swap", {}), "paths": [swap]}, "io": {"backend": backend}}
stack = contextlib.ExitStack()  # never closed
for b, (model, opt, _, _) in enumerate(runs):
    stack.enter_context(tiermem.offload(opt, cfg, model=model, name=f"b{b}"))
if os.environ.get("TIERMEM_TEST_NO_EXIT_HOOK") == "1":
    atexit.unregister(context._leave_open_blocks)
for step in range(3):
    x = torch.randn(16, 64)
    for model, opt, plain_model, plain in runs:
        for m, o in ((model, opt), (plain_model, plain)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
print("TRAINED", flush=True)
"""

NVME = {"tiers": {"host": {"capacity": 0}},
        "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 1}}

CASES = [
    pytest.param({}, 1, id="host-tier"),
    pytest.param(NVME, 1, id="nvme"),
    pytest.param({**NVME, "pipeline": {**NVME["pipeline"], "overlap_backward": True}}, 1,
                 id="nvme-overlap"),
    pytest.param({**NVME, "swap": {"durability": "crash_consistent"}}, 1,
                 id="nvme-crash-consistent"),
    pytest.param({**NVME, "parameters": {"offload": "nvme", "window": "256KiB",
                                         "prefetch": 1}}, 1, id="weights-on-nvme"),
    pytest.param(NVME, 2, id="two-blocks"),
]


def _run(tmp_path, backend, extra, blocks, env=None):
    swap = tmp_path / "swap"
    swap.mkdir()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(swap), backend, json.dumps(extra),
                           str(blocks)],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})
    return proc, swap


# The default tier runs each case on one backend, in turn (tests/conftest.py's backend
# twins): each is a fresh `python`, seconds of the suite on a 2-core host.
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("extra,blocks", CASES)
def test_block_open_at_exit_is_left_before_teardown(tmp_path, backend, extra, blocks):
    _verify(*_run(tmp_path, backend, extra, blocks), blocks)


def _verify(proc, swap, blocks):
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"rc {proc.returncode}\n{out}\n{err[-3000:]}"
    assert "INTERNAL ASSERT" not in err
    assert "TRAINED" in out
    left = [ln for ln in err.splitlines() if "was never left and was left at interpreter exit"
            in ln]
    assert len(left) == blocks, err
    assert all("handed back to the optimizer" in ln for ln in left), err
    # innermost first, as nested with-statements would have left them
    assert all(f"name='b{b}'" in ln for b, ln in zip(reversed(range(blocks)), left)), left
    assert all("opened at <string>:" in ln for ln in left), left
    check = json.loads(out.split("CHECK ", 1)[1].splitlines()[0])
    assert check["states"] == [4] * blocks  # every parameter's state came back
    assert check["worst"] <= 1e-6, check
    leftovers = [p.name for p in swap.iterdir()]
    assert leftovers == [], leftovers  # handed back: the run directories were removed


def test_without_the_exit_hook_the_process_aborts(tmp_path):
    """The harness's own check: the case above fails when the hook is removed (torch aborts
    in the teardown's garbage collection)."""
    proc, swap = _run(tmp_path, "threads", {}, 1, env={"TIERMEM_TEST_NO_EXIT_HOOK": "1"})
    assert "TRAINED" in proc.stdout
    with pytest.raises(AssertionError):
        _verify(proc, swap, 1)


FORK_CHILD = r"""
import contextlib, copy, os, sys, torch, tiermem
swap, backend, how = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64))
plain_model = copy.deepcopy(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
cfg = {"swap": {"paths": [swap]}, "io": {"backend": backend}, "tiers": {"host": {"capacity": 0}},
       "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 1}}

def train(steps):
    for _ in range(steps):
        x = torch.randn(16, 64)
        for m, o in ((model, opt), (plain_model, plain)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()

stack = contextlib.ExitStack()
block = stack.enter_context(tiermem.offload(opt, cfg, model=model))
train(2)
pid = os.fork()
if pid == 0:
    if how == "with":  # SystemExit through the block (the child's own exit path)
        stack.close()
    sys.exit(0)  # "atexit": the exit hook, then the generator's finalisation
_, status = os.waitpid(pid, 0)
assert status == 0, f"child status {status}"
assert os.listdir(swap), "the child removed the parent's run directory"
train(2)
stack.close()
worst = max(max((p - q).abs().max().item() for p, q in
                zip(model.parameters(), plain_model.parameters())),
            max((opt.state[p][k] - plain.state[q][k]).abs().max().item() for p, q in
                zip(model.parameters(), plain_model.parameters()) for k in ("exp_avg", "exp_avg_sq")))
assert worst <= 1e-6, worst
assert os.listdir(swap) == [], os.listdir(swap)
print("PARENT OK", flush=True)
"""


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("how", ["with", "atexit"])
def test_a_child_forked_inside_a_block_never_leaves_it(tmp_path, backend, how):
    """A child forked with the block open (a subprocess spawned by fork, a worker) exits
    without handing back or deleting the parent's state: only the process that opened a
    block leaves it, by the block's own exit or by the exit hook."""
    swap = tmp_path / "swap"
    swap.mkdir()
    proc = subprocess.run([sys.executable, "-c", FORK_CHILD, str(swap), backend, how],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "PARENT OK" in proc.stdout, proc.stderr[-3000:]
    assert "was never left" not in proc.stderr and "INTERNAL ASSERT" not in proc.stderr
