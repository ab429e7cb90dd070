"""The error of optimizer.state_dtype int8's codes on real Adam moments, against linear codes.

Trains a small MLP for --steps steps with fp32 AdamW, then quantises its moments with
tiermem's int8 codes (nearest and stochastic), linear absmax int8 in blocks of 256 and
2048, and bf16, and reports each one's relative error on exp_avg, exp_avg_sq and on
the update direction m / (sqrt(v) + eps) (docs/guide/numerics.md). No timing: the
figures do not depend on the machine.

Usage: python bench/int8_error.py [--steps 200] [--json out.json]
"""

from __future__ import annotations

import sys

from _harness import parser, run_header, save, show_table


def linear(x, signed: bool, block: int):
    """Linear absmax int8 per block (127 levels each way, or 255), nearest."""
    import torch

    n = x.numel()
    a = torch.nn.functional.pad(x, (0, (-n) % block)).view(-1, block)
    s = a.abs().amax(1, keepdim=True).clamp_min(1e-38)
    levels = 127 if signed else 255
    return (torch.round(a / s * levels).clamp(-levels, levels) / levels * s).reshape(-1)[:n]


def moments(steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    y = torch.tanh(x @ torch.randn(128, 64, generator=g)) + 0.01 * torch.randn(512, 64,
                                                                                 generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    cat = lambda k: torch.cat([opt.state[p][k].reshape(-1) for p in model.parameters()])  # noqa: E731
    return cat("exp_avg"), cat("exp_avg_sq")


def main(argv=None) -> int:
    p = parser(__doc__, json_name="int8_error.json", quick={"steps": 50})
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    header = run_header("int8_error", argv)
    from tiermem.kernels import lowbit as lb

    m, v = moments(args.steps)
    eps = 1e-8
    upd = m / (v.sqrt() + eps)
    codes = {}
    for r in ("nearest", "stochastic"):
        qm, sm = lb.quantize(m, signed=True, rounding=r, seed=1)
        qv, sv = lb.quantize(v, signed=False, rounding=r, seed=1, high=True)
        codes[f"tiermem int8 (exponent codes, block 256, {r})"] = (
            lb.dequantize(qm, sm, signed=True), lb.dequantize(qv, sv, signed=False))
    for block in (256, 2048):
        codes[f"linear int8 (absmax, block {block}, nearest)"] = (
            linear(m, True, block), linear(v, False, block))
    codes["bf16 (nearest)"] = (m.bfloat16().float(), v.bfloat16().float())
    rows, figures = [], {}
    for name, (mq, vq) in codes.items():
        f = {"exp_avg_median_rel": ((mq - m).abs() / m.abs().clamp_min(1e-30)).median().item(),
             "exp_avg_rel_l2": ((mq - m).norm() / m.norm()).item(),
             "exp_avg_sq_rel_l2": ((vq - v).norm() / v.norm()).item(),
             "update_rel_l2": ((mq / (vq.sqrt() + eps) - upd).norm() / upd.norm()).item(),
             "v_stored_as_zero": ((vq == 0) & (v > 0)).float().mean().item()}
        figures[name] = f
        rows.append([name, *(f"{f[k]:.3g}" for k in ("exp_avg_median_rel", "exp_avg_rel_l2",
                                                     "exp_avg_sq_rel_l2", "update_rel_l2")),
                     f"{f['v_stored_as_zero']:.2%}"])
    table = show_table(["code", "exp_avg median rel. err", "exp_avg rel. L2 err",
                        "exp_avg_sq rel. L2 err", "update m/(sqrt(v)+eps) rel. L2 err",
                        "v > 0 stored as 0"], rows,
                       title=f"\nAdam moments of a 3-layer MLP after {args.steps} steps "
                             f"({m.numel():,} elements)\n")
    save(args.json, header, args={"steps": args.steps}, figures=figures, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
