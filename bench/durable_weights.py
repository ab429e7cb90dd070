"""What keeping the bf16 weights in a crash-consistent record costs the int8 update.

With optimizer.master_weights kahan or none and swap.durability crash_consistent, every
update of a bf16 segment is followed by a copy of its updated weights into the record
(kind "weight"), so the commit holds them; the kernel's CRC of the weights serves the
copy. This times, on one segment of --params elements (CPU, native kernel, int8 moments),
the update alone and the update plus that copy, in paired rounds (each ratio against
the update timed just before it), for kahan and none. A record's write grows by 2 B/param
too (4.03 -> 6.03 B/param with kahan, 2.03 -> 4.03 with none): the I/O side of the cost,
which bench/pipeline.py measures for a given drive.

Usage: python bench/durable_weights.py [--params 16M] [--rounds 5] [--json out.json] [--quick]
"""

from __future__ import annotations

import statistics

from _harness import (median_over_rounds, paired, parse_count, parser, run_header, save,
                      show_table, time_calls)


def measure(n: int, master: str, rounds: int, calls: int) -> dict:
    import torch

    from tiermem.kernels import lowbit as lb

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, generator=g).to(torch.bfloat16)
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    nb = lb.blocks(n)
    st = dict(exp_avg=torch.zeros(n, dtype=torch.uint8),
              exp_avg_sq=torch.zeros(n, dtype=torch.uint8),
              exp_avg_scale=torch.zeros(nb), exp_avg_sq_scale=torch.zeros(nb))
    kahan = torch.zeros(n, dtype=torch.bfloat16) if master == "kahan" else None
    record = torch.empty(n, dtype=torch.bfloat16)  # the record's "weight" kind
    step = [0]

    # the CRCs a checksummed record takes from the pass; keeping the weights adds theirs
    # (the kernel's "master" array is the bf16 weights it updates)
    base = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale") + (
        ("kahan",) if kahan is not None else ())

    def update(keep: bool) -> None:
        step[0] += 1
        lb.lowbit_update(kernel="native", param=weight, grad=grad, kahan=kahan,
                         master=master, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.01, rounding="stochastic", seed=step[0],
                         offset=0, checksums=base + (("master",) if keep else ()), **st)
        if keep:
            record.copy_(weight)

    ratios, plain, kept = [], [], []
    for _ in range(rounds):
        a = time_calls(lambda: update(False), calls, warmup=1)["seconds"]
        b = time_calls(lambda: update(True), calls, warmup=1)["seconds"]
        plain += a
        kept += b
        ratios.append(paired(b, a))
    med, per_round = median_over_rounds(ratios)
    return {"master": master, "params": n,
            "update_ns_per_param": statistics.median(plain) / n * 1e9,
            "with_copy_ns_per_param": statistics.median(kept) / n * 1e9,
            "ratio": med, "ratio_per_round": per_round}


def main(argv=None) -> int:
    p = parser(__doc__, json_name="durable_weights.json",
               quick={"params": "1M", "rounds": 2, "calls": 3})
    p.add_argument("--params", default="16M", help="elements in the segment")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5, help="timed calls per round and variant")
    args = p.parse_args(argv)
    header = run_header("durable_weights", argv)
    n = parse_count(args.params)
    results = [measure(n, m, args.rounds, args.calls) for m in ("kahan", "none")]
    table = show_table(
        ["master_weights", "update ns/param", "+ weight copy ns/param", "ratio (paired)"],
        [[r["master"], f"{r['update_ns_per_param']:.3f}", f"{r['with_copy_ns_per_param']:.3f}",
          f"{r['ratio']:.3f}"] for r in results],
        title=f"int8 update of one {args.params}-element bf16 segment, with and without the "
              "copy of its weights into the record")
    save(args.json, header, settings=vars(args), results=results, table=table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
