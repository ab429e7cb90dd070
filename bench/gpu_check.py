"""The GPU tier and both step devices on a real GPU, in one prepared run of a few minutes.

(a) parity: a small model on CUDA trained a few steps under tiermem for every tier mix
    (gpu, host, nvme, gpu+host+nvme) x optimizer.step_device (cpu, device) x
    pipeline.overlap_backward (off, on), against torch.optim.AdamW(fused=True) on CUDA:
    max abs / rel error of weights and moments, and whether they are bitwise equal;
(b) the CUDA tests of tests/test_device_step.py;
(c) a 2B-parameter bf16 model (a stack of nn.Linear on CUDA) with all optimizer state on
    NVMe, for each step device: step time, host->device and device->host GB/s (the copy
    streams' device-timed busy time), NVMe read/write GB/s, stall seconds;
(d) bench/train_loop.py on CUDA (--batch auto): the update overlapped with a GPU backward,
    state on NVMe, updated on the host;
(e) (run after (b), before the long runs) the parameter tier on CUDA: a small transformer (tied embedding, pre-norm blocks)
    trained with parameters.offload nvme (weights through pinned buffers into GPU memory,
    grads back, the step on the host, state on NVMe) against plain training on the GPU:
    losses and weights after a few steps (max abs / rel error), the iteration time of
    both, the bytes that crossed each way, and the CUDA tests of
    tests/test_params_cuda.py.
Correctness first, then what the issue asks figures for, then the overlap. Prints each
table as its phase ends and rewrites the JSON (--out) after every phase, so a run cut short
keeps what it measured; --budget S gives the child runs (b, d) timeouts from what is left
of S seconds, skips each big-model run of (c) when under 150 s are (it runs in this process
and cannot be cut short), and skips (d) when under 90 s are.

Without CUDA it refuses in one line; `--smoke` runs tiny sizes on the CPU emulation of the
device lanes (tiermem.offload(..., streams=DeferredBackend())) so every code path of this
script runs
in the test suite.

Usage: python3 bench/gpu_check.py [--swap-dir DIR] [--params 2B] [--steps 3]
       [--out bench/results/gpu_check.json] [--budget S] [--smoke] [--no-tests]
       [--no-train-loop] [--only-params]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any
from pathlib import Path

from _harness import (HERE, REPO, parse_count, parse_size, parser, run_header, show_table,
                      stat_medians, steady, write_json)

MIXES = ("gpu", "host", "nvme", "gpu+host+nvme")
STEP_DEVICES = ("cpu", "device")


def _config(swap: str, *, mix: str, state_bytes: int, step_device: str,
            partition_size: int, buffers: int = 4, prefetch: int = 2,
            overlap: bool = False) -> dict:
    """All state on one tier, or a third on each of gpu, host and nvme."""
    third = state_bytes // 3
    gpu = {"gpu": state_bytes * 2, "host": 0, "nvme": 0, "gpu+host+nvme": third}[mix]
    host = {"gpu": 0, "host": state_bytes * 2, "nvme": 0, "gpu+host+nvme": third}[mix]
    return {"swap": {"paths": [swap]},
            "tiers": {"gpu": {"capacity": gpu}, "host": {"capacity": host}},
            "pipeline": {"partition_size": partition_size, "buffer_count": buffers,
                         "prefetch_depth": prefetch, "overlap_backward": overlap},
            "optimizer": {"kernel": "fused", "step_device": step_device}}


def _max_errors(pairs) -> tuple[float, float, bool]:
    """(max abs error, max relative error, all bitwise equal) over (got, want) pairs. The
    relative error of a tensor is its largest difference over its largest magnitude: an
    element-wise ratio would blow up on moments that are nearly zero (a few ulps of 1e-12
    read as 100%)."""
    import torch

    abs_err = rel_err = 0.0
    bitwise = True
    for got, want in pairs:
        got, want = got.detach().double().cpu(), want.detach().double().cpu()
        bitwise &= bool(torch.equal(got, want))
        diff = (got - want).abs()
        abs_err = max(abs_err, float(diff.max()) if diff.numel() else 0.0)
        if diff.numel():
            scale = float(want.abs().max())
            rel_err = max(rel_err, float(diff.max()) / scale if scale else float(diff.max()))
    return abs_err, rel_err, bitwise


def _streams(device: str) -> Any:
    """The lanes' stream backend: CUDA's on a GPU; on the CPU (--smoke) the emulation, which
    makes the CPU model count as a device one so every device path runs."""
    if device != "cpu":
        return None
    from tiermem.device.lanes import DeferredBackend
    return DeferredBackend()


def parity(args: argparse.Namespace, device: str) -> list[dict]:
    """(a): every tier mix x step device x overlap against torch's fused AdamW on the same
    device, a weight clamped in place after the first step."""
    rows = []
    for overlap in (False, True):
        for mix in MIXES:
            for step_device in STEP_DEVICES:
                if "gpu" in mix and device != "cuda":
                    rows.append({"mix": mix, "step_device": step_device, "overlap": overlap,
                                 "status": "skipped", "why": "the gpu tier needs CUDA"})
                else:
                    rows.append(parity_one(args, device, mix, step_device, overlap))
    return rows


def parity_one(args: argparse.Namespace, device: str, mix: str, step_device: str,
               overlap: bool) -> dict:
    """One parity run: a few steps of a Linear stack under tiermem and under fused AdamW.
    With overlap the updates run during backward, in tiermem's worker thread."""
    import torch

    import tiermem
    from tiermem.partition import build_partitions

    torch.manual_seed(0)
    width = 64 if args.smoke else 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
    ref_model = copy.deepcopy(model)
    kw = dict(lr=1e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
    part_size = 64 << 10 if args.smoke else 1 << 20
    # What the records will hold (fp32 master + moments for a device model).
    state = sum(p.record_bytes for p in build_partitions(
        opt.param_groups, {}, part_size, keep_master=device != "cpu" or args.smoke))
    cfg = _config(tempfile.mkdtemp(dir=args.work), mix=mix, state_bytes=state,
                  step_device=step_device, partition_size=part_size, overlap=overlap)
    batches = [torch.randn(16, width, device=device) for _ in range(args.parity_steps)]

    def edit(m: Any, i: int) -> None:
        # An in-place edit between steps: the next step starts from it, as the plain
        # optimizer's does (a record's master on the host takes it, step_device cpu).
        if i == 0:
            with torch.no_grad():
                m[1].weight.clamp_(-0.01, 0.01)

    with tiermem.offload(opt, cfg, streams=_streams(device)) as tm:
        plan = tm.plan()
        for i, x in enumerate(batches):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            edit(model, i)
    for i, x in enumerate(batches):
        ref_model(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
        edit(ref_model, i)
    pairs = [(p, q) for p, q in zip(model.parameters(), ref_model.parameters())]
    pairs += [(opt.state[p][k], ref.state[q][k])
              for p, q in zip(model.parameters(), ref_model.parameters())
              for k in ("exp_avg", "exp_avg_sq")]
    abs_err, rel_err, bitwise = _max_errors(pairs)
    # The device updates run torch's fused CUDA kernel on the same values: bitwise.
    # The CPU step runs the fused CPU kernel: a few ulps from the CUDA one.
    want_bitwise = step_device == "device" or mix == "gpu" or device == "cpu"
    ok = bitwise if want_bitwise else rel_err < 1e-5
    return {"mix": mix, "step_device": step_device, "overlap": overlap,
            "state_bytes": plan["state_bytes"], "max_abs_err": abs_err,
            "max_rel_err": rel_err, "bitwise": bitwise,
            "expected": "bitwise" if want_bitwise else "rel < 1e-5",
            "status": "ok" if ok else "MISMATCH"}


def big_model(args: argparse.Namespace, device: str, step_device: str) -> dict:
    """(c): a bf16 stack of Linear layers, all optimizer state on NVMe, a few steps."""
    import torch

    import tiermem

    width = 128 if args.smoke else 8192
    layers = max(1, args.params // (width * width))
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                      for _ in range(layers)]).to(torch.bfloat16)
    for p in model.parameters():  # fixed gradients: the step's cost does not depend on them
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    swap = tempfile.mkdtemp(dir=args.work)
    cfg = {"swap": {"paths": [swap]}, "tiers": {"gpu": {"capacity": 0},
                                                 "host": {"capacity": 0}},
           "pipeline": {"partition_size": args.partition_size, "buffer_count": args.buffers,
                        "prefetch_depth": args.buffers - 2},
           "optimizer": {"kernel": "fused", "step_device": step_device}}
    times = []
    # Warnings say what would skew the figures (pageable buffers: staged, synchronous copies).
    with warnings.catch_warnings(record=True) as caught, \
            tiermem.offload(opt, cfg, name=f"gpu-check-{step_device}",
                            streams=_streams(device)) as tm:
        warnings.simplefilter("always")
        plan = tm.plan()
        for _ in range(args.steps):
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times.append(time.perf_counter() - t0)
        stats = tm.stats()
        tm.discard()  # the state is not needed: skip gathering it back into host memory
    med = stat_medians(steady(stats), ("h2d_gbps", "d2h_gbps", "read_gbps", "write_gbps",
                                       "stall_seconds", "transfer_seconds", "update_seconds"))
    return {"step_device": step_device, "params": n_params, "layers": layers, "width": width,
            "state_bytes_nvme": plan["state_bytes"]["nvme"], "partitions": plan["partitions"],
            "step_seconds": times, "steady_step_seconds": statistics.median(steady(times)),
            "h2d_gbps": med["h2d_gbps"], "d2h_gbps": med["d2h_gbps"],
            "nvme_read_gbps": med["read_gbps"], "nvme_write_gbps": med["write_gbps"],
            "stall_seconds": med["stall_seconds"], "transfer_seconds": med["transfer_seconds"],
            "update_seconds": med["update_seconds"], "pinned_bytes": plan["pinned_bytes"],
            "warnings": [str(w.message) for w in caught], "stats": stats}


def _transformer(dim: int, layers: int, vocab: int) -> Any:
    """A pre-norm decoder of `layers` blocks with a tied head: the shapes the parameter
    tier must handle (a weight used by two modules, LayerNorms whose backward reads their
    weights, attention through scaled_dot_product_attention)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, -1, 64).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, dim))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            x = self.emb(t)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return Decoder()


def param_tier(args: argparse.Namespace, device: str) -> dict:
    """(e): the transformer with parameters.offload nvme (optimizer state on NVMe too)
    against plain training on the same device, same batches, and the same in-place edit
    of a weight between steps."""
    import torch
    import torch.nn.functional as F

    import tiermem

    dim, layers, vocab, seq, batch = ((128, 2, 256, 16, 2) if args.smoke
                                      else (1024, 8, 32000, 512, 4))
    steps = max(3, args.parity_steps + 1)
    torch.manual_seed(0)
    model = _transformer(dim, layers, vocab).to(device)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, vocab, (batch, seq), generator=g).to(device),
             torch.randint(0, vocab, (batch, seq), generator=g).to(device))
            for _ in range(steps)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run(m: Any, opt: Any, clip: Any) -> tuple[list[float], list[float]]:
        losses, times = [], []
        for t, y in data:
            sync()
            t0 = time.perf_counter()
            loss = F.cross_entropy(m(t).reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            clip(1.0)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # an in-place edit between steps, kept by the tier's
                m.ln.weight.mul_(0.999)  # copy back to its record (params/device.py)
            losses.append(loss.item())  # waits the step's work on the device too
            sync()
            times.append(time.perf_counter() - t0)
        return losses, times

    kw = dict(lr=1e-4, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    want, plain_times = run(ref, ref_opt,
                            lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # Room for the largest module (the tied embedding) and one optimizer partition's
    # weights and grads opened together, and below the model's weights and grads.
    window = max(4 * largest, weights // 2) + (1 << 20)
    cfg = {"swap": {"paths": [tempfile.mkdtemp(dir=args.work)]},
           "tiers": {"gpu": {"capacity": 0}, "host": {"capacity": 0}},
           "pipeline": {"partition_size": "1MiB" if args.smoke else "64MiB",
                        "buffer_count": 4, "prefetch_depth": 2},
           "optimizer": {"kernel": "auto", "step_device": "cpu"},
           "parameters": {"offload": "nvme", "prefetch": 2, "window": window}}
    opt = torch.optim.AdamW(model.parameters(), **kw)
    with tiermem.offload(opt, cfg, model=model, streams=_streams(device)) as tm:
        got, tier_times = run(model, opt, tm.clip_grad_norm_)
        stats, plan = tm.param_stats(), tm.plan()["parameters"]
    abs_err, rel_err, bitwise = _max_errors(zip(model.parameters(), ref.parameters()))
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    # The step runs torch's (or tiermem's native) CPU kernels against the plain run's CUDA
    # ones, and the clip norm is summed in another order: close, not bitwise.
    ok = rel_err < 1e-3 and loss_err < 1e-3 and next(model.parameters()).device.type == \
        torch.device(device).type
    plain_s, tier_s = statistics.median(steady(plain_times)), statistics.median(
        steady(tier_times))
    return {"params": sum(p.numel() for p in model.parameters()), "weight_bytes": weights,
            "window": window, "device_window": plan.get("device_window"),
            "staging_bytes": plan.get("staging_bytes"), "losses": got, "plain_losses": want,
            "max_loss_rel_err": loss_err, "max_abs_err": abs_err, "max_rel_err": rel_err,
            "bitwise": bitwise, "plain_iteration_seconds": plain_s,
            "tiered_iteration_seconds": tier_s, "ratio": tier_s / plain_s,
            "h2d_bytes": stats["h2d_bytes"], "d2h_bytes": stats["d2h_bytes"],
            "prefetched": stats["prefetched"], "on_demand": stats["on_demand"],
            "peak_window_bytes": stats["peak_window_bytes"],
            "status": "ok" if ok else "MISMATCH"}


def params_cuda_tests(timeout: float) -> dict:
    """(e): the CUDA tests of tests/test_params_cuda.py, in a child pytest."""
    return _child([sys.executable, "-m", "pytest", "-q", "-k", "test_cuda",
                   str(REPO / "tests" / "test_params_cuda.py")], timeout)


def _child_env() -> dict:
    """The environment of a child run: this repository first on PYTHONPATH, and whatever
    was there kept (gpu_session.sh puts the carried cffi runtime there)."""
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _child(cmd: list[str], timeout: float) -> dict:
    """Run cmd; its exit code and the tail of its output, or a timeout said as one."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_child_env(),
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        lines = out.strip().splitlines()
        return {"returncode": None, "timed_out": True,
                "summary": f"stopped after {timeout:.0f} s (timeout)", "tail": lines[-40:]}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "",
            "tail": lines[-40:]}


def cuda_tests(timeout: float) -> dict:
    """(b): the CUDA tests of tests/test_device_step.py, in a child pytest."""
    return _child([sys.executable, "-m", "pytest", "-q", "-k", "cuda",
                   str(REPO / "tests" / "test_device_step.py")], timeout)


def train_loop(args: argparse.Namespace, device: str, timeout: float) -> dict:
    """(d): bench/train_loop.py with the model on `device`, its batch sized so that fwd+bwd
    takes as long as the step (state on NVMe, updated on the host): how much of the update
    and its I/O overlap hides behind a backward that leaves the host's cores free."""
    from tiermem.io import io_uring_status

    out = Path(args.json).with_name("train_loop_" + Path(args.json).name)
    # --smoke: the code path only (tests/test_overlap.py covers the batch sizing and the
    # other variants), so a fixed batch and the two variants the ratio needs.
    size = (["--dim", "64", "--heads", "2", "--layers", "1", "--vocab", "128", "--seq", "16",
             "--partition-size", "64KiB", "--buffers", "3", "--prefetch", "1",
             "--batch", "2", "--only", "step_only,overlap"]
            if args.smoke else ["--seq", "256", "--batch", "auto"])
    backend = "io_uring" if io_uring_status()[0] else "threads"
    cmd = [sys.executable, str(HERE / "train_loop.py"), "--device", device,
           "--rounds", "2", "--iters", "3", "--warmup", "1", "--backend", backend, *size,
           "--swap-dir", tempfile.mkdtemp(dir=args.work), "--json", str(out)]
    result = _child(cmd, timeout)
    if result["returncode"] == 0:
        figures = json.loads(out.read_text())
        result.update({k: figures.get(k) for k in ("ratio", "ratio_per_round", "batch",
                                                    "params", "median_seconds", "goal")},
                      json=str(out))
    return result


def main(argv: list[str] | None = None) -> int:
    # --out, not --json: gpu_session.sh and docs/guide/gpu.md name it so.
    ap = parser(__doc__, json_name="gpu_check.json", json_flags=("--out",))
    ap.add_argument("--swap-dir", default=os.environ.get("TMPDIR", "/tmp"),
                    help="where the NVMe-tier swap files go (default $TMPDIR or /tmp)")
    ap.add_argument("--params", type=parse_count, default="2B",
                    help="parameters of the big model, e.g. 2B, 250M (default 2B)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--parity-steps", type=int, default=3)
    ap.add_argument("--partition-size", type=parse_size, default="256MiB")
    ap.add_argument("--buffers", type=int, default=6)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU emulation of the device (no GPU needed)")
    ap.add_argument("--no-tests", action="store_true", help="skip the CUDA pytest run")
    ap.add_argument("--no-train-loop", action="store_true",
                    help="skip bench/train_loop.py on the device")
    ap.add_argument("--only-params", action="store_true",
                    help="run the parameter tier's section (e) only")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds the whole run may take (0: no limit): the child runs get "
                         "timeouts from what is left, and (d) is skipped with under 90 s")
    args = ap.parse_args(argv)
    args.started, args.argv = time.monotonic(), argv

    import torch

    if args.smoke:
        args.params = min(args.params, 1 << 18)
        args.partition_size = min(args.partition_size, 256 << 10)
        args.steps = min(args.steps, 2)
        args.parity_steps = min(args.parity_steps, 2)
        args.buffers = min(args.buffers, 4)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it "
              "on a GPU machine, or with --smoke for the CPU emulation", file=sys.stderr)
        return 2
    else:
        device = "cuda"
    os.makedirs(args.swap_dir, exist_ok=True)
    # One folder for every run's swap directory, removed at the end whatever happens.
    args.work = tempfile.mkdtemp(prefix="gpu_check-", dir=args.swap_dir)
    try:
        return _run(args, device)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


BIG_MODEL_SECONDS = 150  # what one step device's big-model run needs, at the least


def _left(args: argparse.Namespace, most: float) -> float:
    """Seconds a child run may take: `most`, or less where the budget has less left."""
    if not args.budget:
        return most
    return min(most, args.budget - (time.monotonic() - args.started))


def _run(args: argparse.Namespace, device: str) -> int:
    import torch

    result = {**run_header("gpu_check", args.argv), "device": device, "smoke": args.smoke,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None}

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        write_json(args.json, result)

    if args.only_params:
        failed = _run_params(args, device, result, save)
        print(f"\nwrote {args.json}")
        return failed
    result["parity"] = parity(args, device)
    show_table(
        ["tier mix", "step_device", "overlap", "max abs err", "max rel err", "bitwise",
         "expected", "status"],
        [[r["mix"], r["step_device"], "on" if r["overlap"] else "off",
          f"{r.get('max_abs_err', 0):.3g}", f"{r.get('max_rel_err', 0):.3g}",
          r.get("bitwise", "-"), r.get("expected", "-"),
          r["status"] + (f" ({r['why']})" if "why" in r else "")]
         for r in result["parity"]])
    save()
    if device == "cuda" and not args.no_tests:
        result["cuda_tests"] = cuda_tests(_left(args, 180))
        print(f"\nCUDA tests: {result['cuda_tests']['summary']}", flush=True)
        save()
    # correctness before the long runs: the parameter tier's section comes next
    params_failed = _run_params(args, device, result, save)
    print()
    result["big_model"] = []
    for sd in STEP_DEVICES:
        # In-process and not interruptible: at 2B parameters one step device writes and
        # reads ~72 GB per step, minutes on a fast drive, so it starts only with time left.
        if args.budget and _left(args, BIG_MODEL_SECONDS) < BIG_MODEL_SECONDS:
            result["big_model"].append({"step_device": sd, "status": "skipped: out of time"})
            print(f"big model, step_device {sd}: skipped, under {BIG_MODEL_SECONDS} s of the "
                  "budget left", flush=True)
            save()
            continue
        r = big_model(args, device, sd)
        result["big_model"].append(r)
        show_table(
            ["step_device", "params", "state on NVMe", "step s", "H2D GB/s", "D2H GB/s",
             "NVMe read GB/s", "NVMe write GB/s", "stall s"],
            [[r["step_device"], f"{r['params']:,}",
              f"{r['state_bytes_nvme'] / 2**30:.1f} GiB",
              f"{r['steady_step_seconds']:.2f}", f"{r['h2d_gbps']:.2f}",
              f"{r['d2h_gbps']:.2f}", f"{r['nvme_read_gbps']:.2f}",
              f"{r['nvme_write_gbps']:.2f}", f"{r['stall_seconds']:.2f}"]])
        for w in r["warnings"]:
            print(f"  warning: {w}")
        save()
    if not args.no_train_loop:
        left = _left(args, 300)
        if left < 90:
            result["train_loop"] = {"returncode": None, "summary": "skipped: out of time"}
        else:
            result["train_loop"] = train_loop(args, device, left)
        tl = result["train_loop"]
        print(f"\ntrain_loop on {device}: " + (
            f"batch {tl['batch']}, overlap / max(fwd+bwd, update+I/O) = {tl['ratio']:.3f} "
            f"(rounds {', '.join(f'{x:.3f}' for x in tl['ratio_per_round'])}; goal "
            f"{tl['goal']})" if tl.get("ratio") is not None else tl["summary"]), flush=True)
        save()
    print(f"\nwrote {args.json}")
    bad = [r for r in result["parity"] if r["status"] == "MISMATCH"]
    # A child run fails by its exit code or its timeout; train_loop skipped for time does not.
    failed = [k for k in ("cuda_tests", "train_loop") if k in result and (
        result[k].get("timed_out") or result[k]["returncode"] not in (0, None))]
    return 1 if bad or failed or params_failed else 0


def _run_params(args: argparse.Namespace, device: str, result: dict, save: Any) -> int:
    """Section (e), its table and its CUDA tests; 1 if something failed."""
    print()
    r = result["param_tier"] = param_tier(args, device)
    show_table(
        ["params", "window", "plain iter s", "tiered iter s", "ratio", "H2D MiB", "D2H MiB",
         "max rel err", "loss rel err", "status"],
        [[f"{r['params']:,}", f"{r['window'] / 2**20:.0f} MiB",
          f"{r['plain_iteration_seconds']:.3f}", f"{r['tiered_iteration_seconds']:.3f}",
          f"{r['ratio']:.2f}", f"{r['h2d_bytes'] / 2**20:.0f}",
          f"{r['d2h_bytes'] / 2**20:.0f}", f"{r['max_rel_err']:.3g}",
          f"{r['max_loss_rel_err']:.3g}", r["status"]]],
        title="parameter tier (parameters.offload nvme) against plain training")
    save()
    failed = r["status"] != "ok"
    if device == "cuda" and not args.no_tests:
        tests = result["params_cuda_tests"] = params_cuda_tests(_left(args, 180))
        print(f"\nparameter tier CUDA tests: {tests['summary']}", flush=True)
        save()
        failed |= bool(tests.get("timed_out") or tests["returncode"] not in (0, None))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
