"""Record checksum cost, measured in one run: XXH3-64 (python xxhash, what tiermem used
before CRC32C; skipped if not installed) against CRC32C in C (each path the CPU has:
table, SSE4.2 3-way, 128-bit PCLMULQDQ folding, AVX-512 VPCLMULQDQ folding; the one
tiermem picks on 1 and 2 threads), a plain read of the buffer (torch sum: what one core reads from DRAM), and
the native Adam update with and without the CRCs computed in its own pass.

    python3 bench/checksum.py --mib 512 --params 64M
"""

from __future__ import annotations

import sys

import torch

from _harness import parse_count, parser, ratio, run_header, save, show_table, time_calls
from tiermem.kernels import native_adam as na
from tiermem.kernels.checksum import (crc32c, crc32c_clmul, crc32c_portable, crc32c_sse42, crc_path,
                                      has_clmul, has_sse42)


def best_of(fn, repeat: int) -> float:
    # One untimed call first: page faults, thread start.
    return min(time_calls(fn, repeat, warmup=1)["seconds"])


def main(argv=None) -> int:
    ap = parser(__doc__, json_name=None, quick={"mib": 64, "params": "8M", "repeat": 2})
    ap.add_argument("--mib", type=int, default=512, help="buffer hashed, MiB")
    ap.add_argument("--params", type=parse_count, default="64M",
                    help="elements of the Adam update")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    header = run_header("checksum", argv)
    buf = torch.randint(0, 256, (a.mib << 20,), dtype=torch.uint8)
    threads = torch.get_num_threads()
    rows = {}
    try:
        import xxhash
        mv = memoryview(buf.numpy())
        rows["xxh3-64, 1 thread"] = best_of(lambda: xxhash.xxh3_64_intdigest(mv), a.repeat)
    except ImportError:
        pass
    mv = memoryview(buf.numpy())
    rows["crc32c table, 1 thread"] = best_of(lambda: crc32c_portable(mv), 1)
    if has_sse42():
        rows["crc32c sse4.2 3-way, 1 thread"] = best_of(lambda: crc32c_sse42(mv), a.repeat)
    if has_clmul():
        rows["crc32c pclmul fold, 1 thread"] = best_of(lambda: crc32c_clmul(mv), a.repeat)
    torch.set_num_threads(1)
    as_float = buf.view(torch.float32)
    rows["read (torch sum), 1 thread"] = best_of(lambda: as_float.sum(), a.repeat)
    torch.set_num_threads(threads)
    rows[f"crc32c ({crc_path()}), 1 thread"] = best_of(lambda: crc32c(buf), a.repeat)
    rows["crc32c, 2 threads"] = best_of(lambda: crc32c(buf, threads=2), a.repeat)
    out = {"hash_gbps": {name: buf.numel() / t / 1e9 for name, t in rows.items()}}
    tables = [show_table(["hash", "GB/s"], [[k, f"{v:.1f}"] for k, v in out["hash_gbps"].items()],
                         title=f"hashing {a.mib} MiB (best of {a.repeat}):")]

    n = a.params
    g = torch.Generator().manual_seed(0)
    t = dict(master=torch.randn(n, generator=g), grad=torch.randn(n, generator=g).bfloat16(),
             exp_avg=torch.zeros(n, dtype=torch.bfloat16),
             exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16))
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    arrays = ("master", "exp_avg", "exp_avg_sq")
    plain = best_of(lambda: na.adam_fused_mixed(**t, **kw), a.repeat)
    fused = best_of(lambda: na.adam_fused_mixed(**t, checksums=arrays, **kw), a.repeat)
    record = t["master"].numel() * 4 + 2 * n * 2
    sep1 = best_of(lambda: [crc32c(t[k]) for k in arrays], a.repeat)
    out.update(params=n, update_ns=plain * 1e9 / n, fused_ns=fused * 1e9 / n,
               separate_crc_ns=sep1 * 1e9 / n)
    tables.append(show_table(
        ["Adam update", "ns/param", "vs update alone"],
        [["update alone", f"{out['update_ns']:.3f}", ""],
         ["update + CRCs in the same pass", f"{out['fused_ns']:.3f}",
          f"{ratio(fused, plain) - 1:+.1%}"],
         ["separate CRC32C pass, 1 thread", f"{out['separate_crc_ns']:.3f}",
          f"{ratio(sep1, plain):.2f}x"]],
        title=f"\nAdam update, {n} params, bf16 grads, fp32 master + bf16 moments "
              f"({record / 1e9:.2f} GB record), {torch.get_num_threads()} threads:"))
    save(a.json, header, **out, table="\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
