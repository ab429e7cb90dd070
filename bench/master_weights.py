"""The update of one segment of a bf16 (or fp16) model per optimizer.master_weights and
moment format, against the fp32-master update, in the same run.

Each variant updates one segment of --params elements on the CPU (bf16 gradients in,
the weights updated in place, --threads threads), as tiermem's default kernel runs it
on a host record: the fp32-master row is native/adam.c (an fp32 master and fp32
moments in the record, the model's bf16 weights written in the same pass); the kahan /
none rows are native/adam_lowbit.c's pass with int8, fp32 or bf16 moments. The
`reference` rows time kernels.lowbit's plain-torch reference on the same segment (the
only other kernel that holds bitwise parity for these formats: the default must beat
it). Each ratio is against the fp32-master update timed just before it (paired rounds),
so the machine's drift cancels; the bytes per parameter are the record's (what an
NVMe-bound step reads and writes).

Usage: python bench/master_weights.py [--params 16M] [--rounds 5] [--dtype bf16|fp16]
       [--json out.json] [--quick]
"""

from __future__ import annotations

import statistics

from _harness import (median_over_rounds, paired, parse_count, parser, run_header, save,
                      show_table, time_calls)

# (master_weights, moments, kernel): the rows, after the fp32-master reference row
VARIANTS = [("kahan", "fp32", "native"), ("kahan", "bf16", "native"),
            ("kahan", "int8", "native"), ("none", "fp32", "native"),
            ("none", "bf16", "native"), ("none", "int8", "native"),
            ("kahan", "fp32", "reference")]
RECORD_BYTES = {"fp32": 8, "bf16": 4, "int8": 2 + 8 / 256}  # the moments, per parameter


def make_update(n: int, master: str, moments: str, kernel: str, dtype, threads: int):
    import torch

    from tiermem.kernels import lowbit as lb
    from tiermem.kernels.adam import adam_update

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, generator=g).to(dtype)
    grad = (torch.randn(n, generator=g) * 1e-2).to(dtype)
    step = [0]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    if master == "fp32":
        mp, m, v = weight.float(), torch.zeros(n), torch.zeros(n)

        def update() -> None:
            step[0] += 1
            adam_update(kernel="native", params=[mp], grads=[grad], exp_avgs=[m],
                        exp_avg_sqs=[v], max_exp_avg_sqs=[], steps=[torch.tensor(
                            float(step[0]))], amsgrad=False, maximize=False,
                        decoupled_weight_decay=True, weights_out=[weight], **hp)
        return update
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[moments]
    st = dict(exp_avg=torch.zeros(n, dtype=dt), exp_avg_sq=torch.zeros(n, dtype=dt))
    if moments == "int8":
        st.update(exp_avg_scale=torch.zeros(lb.blocks(n)),
                  exp_avg_sq_scale=torch.zeros(lb.blocks(n)))
    kahan = torch.zeros(n, dtype=dtype) if master == "kahan" else None

    def update() -> None:
        step[0] += 1
        lb.lowbit_update(kernel=kernel, param=weight, grad=grad, kahan=kahan, master=master,
                         step=step[0], rounding="stochastic", seed=step[0], offset=0,
                         num_threads=threads if kernel == "native" else None, **st, **hp)
    return update


def main(argv=None) -> int:
    import torch

    p = parser(__doc__, json_name="master_weights.json",
               quick={"params": "1M", "rounds": 2, "calls": 2})
    p.add_argument("--params", default="16M", help="elements in the segment")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="timed calls per round and variant")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = p.parse_args(argv)
    header = run_header("master_weights", argv)
    n = parse_count(args.params)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.set_num_threads(args.threads)
    base = make_update(n, "fp32", "fp32", "native", dtype, args.threads)
    results = []
    for master, moments, kernel in VARIANTS:
        fn = make_update(n, master, moments, kernel, dtype, args.threads)
        calls = args.calls if kernel == "native" else 1
        ratios, times, ref = [], [], []
        for _ in range(args.rounds):
            a = time_calls(base, args.calls, warmup=1)["seconds"]
            b = time_calls(fn, calls, warmup=1 if kernel == "native" else 0)["seconds"]
            ref += a
            times += b
            ratios.append(paired(b, [statistics.median(a)] * len(b)))
        med, per_round = median_over_rounds(ratios)
        results.append({"master_weights": master, "moments": moments, "kernel": kernel,
                        "ns_per_param": statistics.median(times) / n * 1e9,
                        "fp32_master_ns_per_param": statistics.median(ref) / n * 1e9,
                        "ratio": med, "ratio_per_round": per_round,
                        "record_bytes_per_param": RECORD_BYTES[moments]
                        + (2 if master == "kahan" else 0)})
    table = show_table(
        ["master_weights", "moments", "kernel", "B/param", "ns/param",
         "fp32 master ns/param", "time vs fp32 master (paired)"],
        [[r["master_weights"], r["moments"], r["kernel"], f"{r['record_bytes_per_param']:.2f}",
          f"{r['ns_per_param']:.3f}", f"{r['fp32_master_ns_per_param']:.3f}",
          f"{r['ratio']:.3f}"] for r in results],
        title=f"Adam update of one {args.params}-element {args.dtype} segment, "
              f"{args.threads} threads (fp32 master: 12 B/param)")
    save(args.json, header, settings=vars(args), results=results, table=table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
