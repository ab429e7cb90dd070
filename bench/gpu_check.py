"""The GPU tier and both step devices on a real GPU, in one prepared run of a few minutes.

(a) parity: a small model on CUDA trained a few steps under tiermem for every tier mix
    (gpu, host, nvme, gpu+host+nvme) x optimizer.step_device (cpu, device), against
    torch.optim.AdamW(fused=True) on CUDA: max abs / rel error of weights and moments,
    and whether they are bitwise equal;
(b) a 2B-parameter bf16 model (a stack of nn.Linear on CUDA) with all optimizer state on
    NVMe, for each step device: step time, host->device and device->host GB/s (the copy
    streams' device-timed busy time), NVMe read/write GB/s, stall seconds;
(c) the CUDA tests of tests/test_device_step.py.
Prints tables and writes JSON (--out).

Without CUDA it refuses in one line; `--smoke` runs tiny sizes on the CPU emulation of the
device lanes (tiermem.device_lanes.emulate_device) so every code path of this script runs
in the test suite.

Usage: python3 bench/gpu_check.py [--swap-dir DIR] [--params 2B] [--steps 3]
       [--out bench/results/gpu_check.json] [--smoke] [--no-tests]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from _report import git_revision, machine_facts, markdown_table, parse_size, write_json  # noqa: E402
from pipeline import parse_count  # noqa: E402

MIXES = ("gpu", "host", "nvme", "gpu+host+nvme")
STEP_DEVICES = ("cpu", "device")


def _config(swap: str, *, mix: str, state_bytes: int, step_device: str,
            partition_size: int, buffers: int = 4, prefetch: int = 2) -> dict:
    """All state on one tier, or a third on each of gpu, host and nvme."""
    third = state_bytes // 3
    gpu = {"gpu": state_bytes * 2, "host": 0, "nvme": 0, "gpu+host+nvme": third}[mix]
    host = {"gpu": 0, "host": state_bytes * 2, "nvme": 0, "gpu+host+nvme": third}[mix]
    return {"swap": {"paths": [swap]},
            "tiers": {"gpu": {"capacity": gpu}, "host": {"capacity": host}},
            "pipeline": {"partition_size": partition_size, "buffer_count": buffers,
                         "prefetch_depth": prefetch},
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


def parity(args: argparse.Namespace, device: str) -> list[dict]:
    """(a): every tier mix x step device against torch's fused AdamW on the same device."""
    import torch

    import tiermem
    from tiermem.partition import build_partitions

    rows = []
    for mix in MIXES:
        for step_device in STEP_DEVICES:
            if "gpu" in mix and device != "cuda":
                rows.append({"mix": mix, "step_device": step_device, "status": "skipped",
                             "why": "the gpu tier needs CUDA"})
                continue
            torch.manual_seed(0)
            width = 64 if args.smoke else 1024
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]
                                        ).to(device)
            ref_model = copy.deepcopy(model)
            kw = dict(lr=1e-3, weight_decay=0.1)
            opt = torch.optim.AdamW(model.parameters(), **kw)
            ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
            part_size = 64 << 10 if args.smoke else 1 << 20
            # What the records will hold (fp32 master + moments for a device model).
            state = sum(p.record_bytes for p in build_partitions(
                opt.param_groups, {}, part_size, keep_master=device != "cpu" or args.smoke))
            cfg = _config(tempfile.mkdtemp(dir=args.work), mix=mix, state_bytes=state,
                          step_device=step_device, partition_size=part_size)
            batches = [torch.randn(16, width, device=device) for _ in range(args.parity_steps)]
            with tiermem.offload(opt, cfg) as tm:
                plan = tm.plan()
                for x in batches:
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
            for x in batches:
                ref_model(x).square().mean().backward()
                ref.step()
                ref.zero_grad()
            pairs = [(p, q) for p, q in zip(model.parameters(), ref_model.parameters())]
            pairs += [(opt.state[p][k], ref.state[q][k])
                      for p, q in zip(model.parameters(), ref_model.parameters())
                      for k in ("exp_avg", "exp_avg_sq")]
            abs_err, rel_err, bitwise = _max_errors(pairs)
            # The device updates run torch's fused CUDA kernel on the same values: bitwise.
            # The CPU step runs the fused CPU kernel: a few ulps from the CUDA one.
            want_bitwise = step_device == "device" or mix == "gpu" or device == "cpu"
            ok = bitwise if want_bitwise else rel_err < 1e-5
            rows.append({"mix": mix, "step_device": step_device,
                         "state_bytes": plan["state_bytes"], "max_abs_err": abs_err,
                         "max_rel_err": rel_err, "bitwise": bitwise,
                         "expected": "bitwise" if want_bitwise else "rel < 1e-5",
                         "status": "ok" if ok else "MISMATCH"})
    return rows


def big_model(args: argparse.Namespace, device: str, step_device: str) -> dict:
    """(b): a bf16 stack of Linear layers, all optimizer state on NVMe, a few steps."""
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
    with tiermem.offload(opt, cfg, name=f"gpu-check-{step_device}") as tm:
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
    steady = stats[1:] or stats  # the first step only writes (fresh records)

    def med(key: str) -> float:
        return statistics.median(s[key] for s in steady)
    return {"step_device": step_device, "params": n_params, "layers": layers, "width": width,
            "state_bytes_nvme": plan["state_bytes"]["nvme"], "partitions": plan["partitions"],
            "step_seconds": times, "steady_step_seconds": statistics.median(times[1:] or times),
            "h2d_gbps": med("h2d_gbps"), "d2h_gbps": med("d2h_gbps"),
            "nvme_read_gbps": med("read_gbps"), "nvme_write_gbps": med("write_gbps"),
            "stall_seconds": med("stall_seconds"), "transfer_seconds": med("transfer_seconds"),
            "update_seconds": med("update_seconds"), "stats": stats}


def cuda_tests() -> dict:
    """(c): the CUDA tests of tests/test_device_step.py, in a child pytest."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-k", "cuda", str(REPO / "tests" /
                                                                   "test_device_step.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "",
            "tail": lines[-40:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swap-dir", default=os.environ.get("TMPDIR", "/tmp"),
                    help="where the NVMe-tier swap files go (default $TMPDIR or /tmp)")
    ap.add_argument("--params", type=parse_count, default=parse_count("2B"),
                    help="parameters of the big model, e.g. 2B, 250M (default 2B)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--parity-steps", type=int, default=3)
    ap.add_argument("--partition-size", type=parse_size, default=parse_size("256MiB"))
    ap.add_argument("--buffers", type=int, default=6)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_check.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU emulation of the device (no GPU needed)")
    ap.add_argument("--no-tests", action="store_true", help="skip the CUDA pytest run")
    args = ap.parse_args(argv)

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


def _run(args: argparse.Namespace, device: str) -> int:
    import torch

    from tiermem.device_lanes import emulate_device

    emulation = emulate_device() if device == "cpu" else contextlib.nullcontext()
    result = {"machine": machine_facts(), "revision": git_revision(REPO),
              "torch": torch.__version__, "device": device, "smoke": args.smoke,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    with emulation:
        result["parity"] = parity(args, device)
        print(markdown_table(
            ["tier mix", "step_device", "max abs err", "max rel err", "bitwise", "expected",
             "status"],
            [[r["mix"], r["step_device"], f"{r.get('max_abs_err', 0):.3g}",
              f"{r.get('max_rel_err', 0):.3g}", r.get("bitwise", "-"), r.get("expected", "-"),
              r["status"] + (f" ({r['why']})" if "why" in r else "")]
             for r in result["parity"]]))
        print()
        result["big_model"] = [big_model(args, device, sd) for sd in STEP_DEVICES]
    print(markdown_table(
        ["step_device", "params", "state on NVMe", "step s", "H2D GB/s", "D2H GB/s",
         "NVMe read GB/s", "NVMe write GB/s", "stall s"],
        [[r["step_device"], f"{r['params']:,}", f"{r['state_bytes_nvme'] / 2**30:.1f} GiB",
          f"{r['steady_step_seconds']:.2f}", f"{r['h2d_gbps']:.2f}", f"{r['d2h_gbps']:.2f}",
          f"{r['nvme_read_gbps']:.2f}", f"{r['nvme_write_gbps']:.2f}",
          f"{r['stall_seconds']:.2f}"] for r in result["big_model"]]))
    if device == "cuda" and not args.no_tests:
        result["cuda_tests"] = cuda_tests()
        print(f"\nCUDA tests: {result['cuda_tests']['summary']}")
    path = write_json(args.out, result)
    print(f"\nwrote {path}")
    bad = [r for r in result["parity"] if r["status"] == "MISMATCH"]
    failed_tests = result.get("cuda_tests", {}).get("returncode", 0) != 0
    return 1 if bad or failed_tests else 0


if __name__ == "__main__":
    sys.exit(main())
