"""Convergence of tiermem's optimizer-state formats on real text: a small GPT-style language model.

A byte-level GPT (vocabulary 256; pre-LN blocks of causal self-attention and a 4x GELU
MLP; learned positions; output head tied to the embedding) trained on the Python
standard library's own source files, which every Python install carries: the `*.py`
files under `sysconfig.get_paths()["stdlib"]` outside site-packages and the test
suites, in sorted order of their relative paths; every 10th file is held out. Each
step draws `batch` random windows of `seq + 1` bytes from the training stream; the
held-out loss is the mean over a fixed set of evenly spaced held-out windows, the
same for every run.

Every combination trains from the same initial weights and on the same batches for a
given seed (the fp32 model is built under `torch.manual_seed(seed)`; a bf16 model is
that model cast with `.to(torch.bfloat16)`), with AdamW (linear warmup, cosine decay to
a tenth, gradient clipping at 1.0) through `tiermem.offload(opt, config)`:

- fp32 model x optimizer.state_dtype {fp32, bf16, int8};
- bf16 model x optimizer.master_weights {fp32, kahan, none} x state_dtype {fp32, int8},
  and kahan / none with bf16 moments;
- `torch`: the plain torch.optim.AdamW on the fp32 model, no tiermem.

A combination whose config does not load is reported as "not available: <the config
error>", so the script runs on any tiermem and picks up new formats when they exist.
The state sits in the host tier by default (`--tier host`): the numerics are the same
records as on NVMe, without the I/O, so the run measures the formats and not the disk;
`--tier nvme` puts every record on NVMe under `--swap-dir`.

Reported per combination, over the seeds: the final train loss (mean over the last
`--last` steps), the held-out loss, the seed spread (max - min of the held-out loss),
and the relative gap of the held-out loss to the fp32-state run of the fp32 model
(`fp32.fp32`) and, for a bf16 model, to its own fp32-master fp32-state run
(`bf16.fp32.fp32`), each paired by seed. Goals (issue #18), judged against the run that
differs only in what is asked about: int8 moments within 1% of fp32 state
(fp32.int8 vs fp32.fp32, bf16.fp32.int8 vs bf16.fp32.fp32), kahan within 2% and none
within 3% of bf16.fp32.fp32, whatever the moments' format.

Runs go `--jobs` at a time (default: one per core), each in a process of its own with
`--threads` torch threads (default 1): a model this small trains faster on a core of
its own than on two shared, and every run is the same whatever the split. The default
size (0.25M parameters, 3000 steps of 16 x 64 bytes, about 25 ms of CPU a step on one
core) runs the whole table (20 runs) in about 10-15 minutes on two quiet cores; `--quick`
in about a minute.

Usage: python bench/convergence.py [--quick] [--steps 3000] [--seeds 2] [--combos fp32.fp32,fp32.bf16]
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import parser, run_header, save, settings, show_table

import torch
import torch.nn.functional as F
from torch import nn

HELD_OUT_EVERY = 10  # file i is held out when i % 10 == 9
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


# -- the combinations ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Combo:
    """One row: the model's dtype, the master weights (bf16 model only) and the state dtype;
    `tiermem` False for the plain torch AdamW."""

    name: str
    weights: str  # "fp32" | "bf16"
    master: str | None  # "fp32" | "kahan" | "none" for a bf16 model
    state: str  # "fp32" | "bf16" | "int8"
    tiermem: bool = True
    baseline: str | None = None  # the run it is judged against
    goal: float | None = None  # relative held-out gap allowed

    def optimizer_section(self) -> dict[str, str]:
        """The config's optimizer keys for this row. `master_weights: fp32` is what a bf16
        model gets without the key, so it is left out: the row then runs on a tiermem that
        predates the key, as the fp32 master it describes."""
        section = {"state_dtype": self.state}
        if self.master not in (None, "fp32"):
            section["master_weights"] = self.master
        return section


def _combos() -> dict[str, Combo]:
    rows = [Combo("torch", "fp32", None, "fp32", tiermem=False)]
    rows += [Combo(f"fp32.{s}", "fp32", None, s) for s in ("fp32", "bf16", "int8")]
    rows += [Combo(f"bf16.{m}.{s}", "bf16", m, s)
             for m in ("fp32", "kahan", "none") for s in ("fp32", "int8")]
    # master-less bf16 weights with bf16 moments (the 4 and 6 B/param formats)
    rows += [Combo(f"bf16.{m}.bf16", "bf16", m, "bf16") for m in ("kahan", "none")]
    goals = {"fp32.int8": ("fp32.fp32", 0.01), "bf16.fp32.int8": ("bf16.fp32.fp32", 0.01),
             **{f"bf16.kahan.{s}": ("bf16.fp32.fp32", 0.02) for s in ("fp32", "bf16", "int8")},
             **{f"bf16.none.{s}": ("bf16.fp32.fp32", 0.03) for s in ("fp32", "bf16", "int8")}}
    out = {}
    for c in rows:
        base, goal = goals.get(c.name, (None, None))
        out[c.name] = dataclasses.replace(c, baseline=base, goal=goal)
    return out


COMBOS = _combos()
REFERENCE = "fp32.fp32"
BF16_REFERENCE = "bf16.fp32.fp32"


# -- the corpus ----------------------------------------------------------------------------


def corpus_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's `*.py` files outside site-packages and the test suites,
    sorted by relative path (one order on every machine with the same Python)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found += [Path(dirpath, f).relative_to(root) for f in files if f.endswith(".py")]
    return [root / p for p in sorted(found, key=lambda p: p.as_posix())]


@dataclasses.dataclass
class Corpus:
    train: torch.Tensor  # uint8 byte stream
    held: torch.Tensor
    info: dict[str, Any]


def load_corpus(max_files: int | None = None, root: str | os.PathLike | None = None) -> Corpus:
    """The training and held-out byte streams: files joined in order, every
    HELD_OUT_EVERY-th file held out; `max_files` takes only the first files (a slice for
    tests)."""
    files = corpus_files(root)[:max_files]
    if len(files) < HELD_OUT_EVERY:
        raise SystemExit(f"the corpus needs at least {HELD_OUT_EVERY} files; found "
                         f"{len(files)} under {root or sysconfig.get_paths()['stdlib']}")
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    digest = hashlib.sha256()
    for i, f in enumerate(files):
        data = f.read_bytes()
        digest.update(data)
        parts[i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1].append(data)

    def stream(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8)

    train, held = stream(parts[False]), stream(parts[True])
    info = {"root": str(Path(root or sysconfig.get_paths()["stdlib"])), "files": len(files),
            "held_out_files": len(parts[True]), "train_bytes": train.numel(),
            "held_out_bytes": held.numel(), "sha256": digest.hexdigest()[:16]}
    return Corpus(train, held, info)


def unigram_loss(corpus: Corpus) -> float:
    """Cross-entropy (nats/byte) of the held-out bytes under the training bytes'
    frequencies (add-one): what a model that ignores context scores."""
    counts = torch.bincount(corpus.train.long(), minlength=256).double() + 1
    logp = (counts / counts.sum()).log()
    held = torch.bincount(corpus.held.long(), minlength=256).double()
    return float(-(held * logp).sum() / held.sum())


def batch_starts(corpus: Corpus, steps: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """(steps, batch) window starts in the training stream, drawn once per seed, so every
    combination of a seed sees the same batches in the same order."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, corpus.train.numel() - seq - 1, (steps, batch), generator=g)


def windows(stream: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    """(n, seq + 1) int64 windows of `stream` at `starts`."""
    return stream[starts.unsqueeze(-1) + torch.arange(seq + 1)].long()


def eval_windows(corpus: Corpus, n: int, seq: int) -> torch.Tensor:
    """n evenly spaced held-out windows: one fixed evaluation set for every run."""
    starts = torch.linspace(0, corpus.held.numel() - seq - 2, n).long()
    return windows(corpus.held, starts, seq)


# -- the model -----------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        # Written out rather than F.scaled_dot_product_attention, whose CPU backward in bf16
        # costs 10x the rest of a small model's step; the softmax runs in fp32, as autocast
        # would run it.
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        a = scores.float().masked_fill(causal, -math.inf).softmax(-1).to(v.dtype) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(nn.Module):
    """Byte embedding + learned positions -> blocks -> LayerNorm -> tied output head."""

    def __init__(self, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        if dim % heads:
            raise SystemExit(f"--dim {dim} is not a multiple of --heads {heads}")
        self.emb = nn.Embedding(256, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        nn.init.normal_(self.emb.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.emb.weight.t()


def loss_of(model: nn.Module, win: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats), computed in fp32 whatever the model's dtype."""
    logits = model(win[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, 256), win[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, win: torch.Tensor, batch: int) -> float:
    total = sum(loss_of(model, win[i:i + batch]).item() * len(win[i:i + batch])
                for i in range(0, len(win), batch))
    return total / len(win)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup to lr, then cosine decay to lr/10 at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


# -- one run -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run is made of, besides the combination and the seed."""

    # Sized for the whole table (20 runs) in 10-15 minutes on two quiet cores, a run per
    # core: 0.25M parameters, 3000 steps of 16 x 64 bytes (about 25 ms of CPU a step).
    dim: int = 96
    layers: int = 2
    heads: int = 4
    seq: int = 64
    batch: int = 16
    steps: int = 3000
    lr: float = 3e-3
    warmup: int = 100
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.1
    last: int = 100
    eval_windows: int = 256
    tier: str = "host"
    swap_dir: str = "/tmp/tiermem-convergence"
    partition_size: str = "512KiB"


def tiermem_config(combo: Combo, setup: Setup, swap_dir: str) -> dict[str, Any]:
    """The config of a tiermem row: every record in the host tier (or all on NVMe)."""
    host = "256MiB" if setup.tier == "host" else 0
    return {"swap": {"paths": [swap_dir]}, "tiers": {"host": {"capacity": host}},
            "pipeline": {"partition_size": setup.partition_size},
            "optimizer": combo.optimizer_section()}


def unavailable(combo: Combo, setup: Setup) -> str | None:
    """None when this tiermem loads the row's config, else the config error."""
    if not combo.tiermem:
        return None
    from tiermem.config import ConfigError, load_config
    try:
        load_config(tiermem_config(combo, setup, setup.swap_dir))
    except ConfigError as exc:
        return str(exc)
    return None


def build(setup: Setup, seed: int, weights: str) -> nn.Module:
    torch.manual_seed(seed)
    model = ByteGPT(setup.dim, setup.layers, setup.heads, setup.seq)
    return model.to(torch.bfloat16) if weights == "bf16" else model


def train(combo: Combo, seed: int, corpus: Corpus, setup: Setup,
          eval_set: torch.Tensor) -> dict[str, Any]:
    """Train one combination from the seed's weights on the seed's batches; the losses."""
    import tiermem
    model = build(setup, seed, combo.weights)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, betas=setup.betas,
                            weight_decay=setup.weight_decay)
    starts = batch_starts(corpus, setup.steps, setup.batch, setup.seq, seed)
    losses: list[float] = []

    def loop() -> None:
        for step in range(setup.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, setup.steps, setup.lr, setup.warmup)
            loss = loss_of(model, windows(corpus.train, starts[step], setup.seq))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                raise SystemExit(f"{combo.name} seed {seed}: loss {losses[-1]} at step {step}")

    t0 = time.perf_counter()
    if combo.tiermem:
        Path(setup.swap_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=setup.swap_dir, prefix="run-") as swap:
            with tiermem.offload(opt, tiermem_config(combo, setup, swap), model=model):
                loop()
    else:
        loop()
    seconds = time.perf_counter() - t0
    every = max(1, setup.steps // 20)
    return {"seed": seed, "train_loss": statistics.fmean(losses[-setup.last:]),
            "run_mean_loss": statistics.fmean(losses),
            "held_out_loss": evaluate(model, eval_set, setup.batch * 4),
            "seconds": seconds, "ms_per_step": 1000 * seconds / setup.steps,
            "curve": [statistics.fmean(losses[i:i + every])
                      for i in range(0, len(losses), every)]}


# -- many runs ----------------------------------------------------------------------------

_DATA: dict[str, Any] = {}  # this process's corpus and evaluation set


def _load(max_files: int | None, eval_n: int, seq: int, threads: int) -> None:
    torch.set_num_threads(threads)
    corpus = load_corpus(max_files)
    _DATA.update(corpus=corpus, eval_set=eval_windows(corpus, eval_n, seq))


def _run(name: str, seed: int, setup: Setup) -> tuple[str, int, dict]:
    return name, seed, train(COMBOS[name], seed, _DATA["corpus"], setup, _DATA["eval_set"])


def run_all(tasks: list[tuple[str, int]], setup: Setup, *, jobs: int, threads: int,
            max_files: int | None) -> dict[str, list[dict]]:
    """Every (combination, seed), `jobs` at a time in processes of their own (one core each
    trains this small a model better than two threads share one run); results keyed by
    combination in seed order. The runs are the same whatever `jobs` is."""
    def report(name: str, seed: int, r: dict) -> None:
        print(f"{name} seed {seed}: train {r['train_loss']:.4f} held-out "
              f"{r['held_out_loss']:.4f} ({r['seconds']:.0f} s)", flush=True)

    done: dict[tuple[str, int], dict] = {}
    if jobs <= 1:
        _load(max_files, setup.eval_windows, setup.seq, threads)
        for name, seed in tasks:
            done[name, seed] = _run(name, seed, setup)[2]
            report(name, seed, done[name, seed])
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_load,
                                 initargs=(max_files, setup.eval_windows, setup.seq,
                                           threads)) as pool:
            for fut in [pool.submit(_run, n, s, setup) for n, s in tasks]:
                name, seed, r = fut.result()
                done[name, seed] = r
                report(name, seed, r)
    runs: dict[str, list[dict]] = {}
    for name, seed in tasks:
        runs.setdefault(name, []).append(done[name, seed])
    return runs


# -- the table -----------------------------------------------------------------------------


def paired_gap(runs: dict[str, list[dict]], name: str, base: str) -> list[float] | None:
    """Per seed, (held-out loss - the baseline's) / the baseline's; None when either
    row did not run."""
    if name not in runs or base not in runs:
        return None
    ref = {r["seed"]: r["held_out_loss"] for r in runs[base]}
    return [(r["held_out_loss"] - ref[r["seed"]]) / ref[r["seed"]] for r in runs[name]
            if r["seed"] in ref]


def pct(gaps: list[float] | None) -> str:
    if not gaps:
        return "-"
    mean = statistics.fmean(gaps)
    return f"{100 * mean:+.2f}%" + (f" ({100 * min(gaps):+.2f}..{100 * max(gaps):+.2f})"
                                    if len(gaps) > 1 else "")


def summarise(runs: dict[str, list[dict]], missing: dict[str, str],
              names: list[str]) -> tuple[list[list[str]], dict[str, Any]]:
    rows, summary = [], {}
    for name in names:
        c = COMBOS[name]
        head = [name, c.weights, c.master or "-", c.state]
        if name in missing:
            rows.append(head + [f"not available: {missing[name]}"] + [""] * 6)
            summary[name] = {"available": False, "why": missing[name]}
            continue
        rs = runs[name]
        held = [r["held_out_loss"] for r in rs]
        gap_ref = paired_gap(runs, name, REFERENCE) if name != REFERENCE else None
        gap_own = (paired_gap(runs, name, BF16_REFERENCE)
                   if c.weights == "bf16" and name != BF16_REFERENCE else None)
        verdict, judged = "", None
        if c.goal is not None:
            judged = paired_gap(runs, name, c.baseline)
            if judged:
                worst = max(judged)
                verdict = (f"{'met' if worst <= c.goal else 'NOT met'} "
                           f"(<= {100 * c.goal:g}% vs {c.baseline})")
            else:
                verdict = f"{c.baseline} did not run"
        spread = max(held) - min(held)
        rows.append(head + [f"{statistics.fmean(r['train_loss'] for r in rs):.4f}",
                            f"{statistics.fmean(held):.4f}",
                            f"{spread:.4f} ({100 * spread / statistics.fmean(held):.2f}%)",
                            pct(gap_ref), pct(gap_own), verdict,
                            f"{statistics.fmean(r['ms_per_step'] for r in rs):.1f}"])
        summary[name] = {"available": True, "train_loss": [r["train_loss"] for r in rs],
                         "held_out_loss": held, "seed_spread": spread,
                         "gap_vs_fp32_state": gap_ref, "gap_vs_bf16_fp32_master": gap_own,
                         "goal": c.goal, "baseline": c.baseline,
                         "goal_met": None if not judged else max(judged) <= c.goal}
    return rows, summary


HEADERS = ["combo", "weights", "master", "state", "train loss", "held-out loss",
           "seed spread", "gap vs fp32.fp32", "gap vs bf16.fp32.fp32", "goal", "ms/step"]


def main() -> None:
    p = parser(__doc__, json_name="convergence.json",
               quick={"steps": 150, "dim": 64, "layers": 1, "seq": 64, "warmup": 20,
                      "last": 20, "eval_windows": 64, "lr": 3e-3})
    d = Setup()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default 2)")
    p.add_argument("--combos", default=",".join(COMBOS),
                   help="comma-separated rows (default all): " + ", ".join(COMBOS))
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--beta2", type=float, default=d.betas[1])
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--last", type=int, default=d.last,
                   help="the train loss is the mean over the last N steps")
    p.add_argument("--eval-windows", type=int, default=d.eval_windows,
                   help="held-out windows of seq+1 bytes in the evaluation set")
    p.add_argument("--tier", choices=["host", "nvme"], default=d.tier,
                   help="where tiermem keeps the state (host: no I/O, the same records)")
    p.add_argument("--swap-dir", default=d.swap_dir)
    p.add_argument("--partition-size", default=d.partition_size,
                   help="a handful of partitions, so the step measures numerics, "
                        "not per-partition bookkeeping")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                   help="runs at a time, each in a process of its own (default: the cores)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads in each run (default 1)")
    p.add_argument("--max-files", type=int, default=None, help="only the first N files")
    args = p.parse_args()

    names = [n.strip() for n in args.combos.split(",") if n.strip()]
    wrong = [n for n in names if n not in COMBOS]
    if wrong:
        p.error(f"--combos: unknown {', '.join(wrong)}; known: {', '.join(COMBOS)}")
    torch.set_num_threads(args.threads)
    setup = Setup(dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq,
                  batch=args.batch, steps=args.steps, lr=args.lr, warmup=args.warmup,
                  betas=(0.9, args.beta2), weight_decay=args.weight_decay,
                  last=min(args.last, args.steps), eval_windows=args.eval_windows,
                  tier=args.tier, swap_dir=args.swap_dir, partition_size=args.partition_size)
    header = run_header("convergence")
    corpus = load_corpus(args.max_files)
    unigram = unigram_loss(corpus)
    params = sum(q.numel() for q in build(setup, 0, "fp32").parameters())
    print(f"corpus: {corpus.info['files']} files of the standard library "
          f"({corpus.info['train_bytes'] / 1e6:.2f} MB train, "
          f"{corpus.info['held_out_bytes'] / 1e6:.2f} MB held out), unigram held-out loss "
          f"{unigram:.4f} nats/byte; model {params / 1e6:.2f}M parameters; {setup.steps} steps "
          f"of {setup.batch}x{setup.seq} bytes; state in the {setup.tier} tier; "
          f"{args.jobs} run(s) at a time, {args.threads} thread(s) each", flush=True)

    missing = {n: why for n in names if (why := unavailable(COMBOS[n], setup))}
    for name, why in missing.items():
        print(f"{name}: not available: {why}", flush=True)
    t0 = time.perf_counter()
    runs = run_all([(n, s) for n in names if n not in missing for s in range(args.seeds)],
                   setup, jobs=args.jobs, threads=args.threads, max_files=args.max_files)
    print(f"{time.perf_counter() - t0:.0f} s for all runs", flush=True)
    try:  # the runs' own folders are gone; the parent goes too when this made it
        os.rmdir(setup.swap_dir)
    except OSError:
        pass

    rows, summary = summarise(runs, missing, names)
    table = show_table(HEADERS, rows, title=(
        f"Held-out loss (nats/byte; unigram {unigram:.4f}) after {setup.steps} steps, "
        f"{args.seeds} seed(s); gaps paired by seed, mean (min..max)"))
    save(args.json, header, settings=settings(args), setup=dataclasses.asdict(setup),
         corpus=corpus.info, parameters=params, unigram_loss=unigram, table=table,
         summary=summary, runs=runs)


if __name__ == "__main__":
    sys.exit(main())
