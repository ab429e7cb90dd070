"""tiermem's own CPU Adam/AdamW kernel (native/adam.c), called through cffi on raw pointers.

One fused pass per call reads the gradient (fp32, bf16 or fp16, upcast in registers),
updates the fp32 parameters and moments in place, and can write a bf16 or fp16 copy of
the updated parameters (round to nearest even) in the same pass. It equals torch's fused
CPU AdamW (`torch.optim.AdamW(fused=True)`) bit for bit: torch's kernel updates the last
numel % 8 elements of each tensor in a scalar loop that rounds exp_avg_sq another way,
and this kernel gives the elements its callers name (torch_tails, from tail_len) that
loop's arithmetic (torch_tail_width: the width, measured once). Where a torch build's
fused kernel does something else, it stays within 1e-6 relative (1e-7 absolute), the
tolerance tests/test_native_adam.py holds it to over 100 steps. Its AVX-512, AVX2 and
scalar paths give bitwise the same results as each other.

- `adam_native(...)`: the update part of tiermem.kernels.adam's kernel signature (the
  dispatcher's "native" kernel calls it) with its weights out: gradients may be fp32,
  bf16 or fp16, and each segment may write bf16/fp16 weights; segments end to end in
  every list run as one C call.
- `adam_fused_mixed(...)`: one flat fp32 master with its moments, a gradient of any of
  those dtypes and an optional bf16/fp16 weight written in the same pass. The moments
  may be bf16 (optimizer.state_dtype: bf16): upcast in registers, updated in fp32,
  stored rounded to nearest even or stochastically (`rounding`, `seed`, `offset`).
  With `checksums=(...)` it returns the CRC32C of the named arrays as they were left
  (each chunk hashed by the thread that updated it, right after: see tiermem/checksum.py).
- `state_seed(step=, partition=)`: the stochastic-rounding seed the pipeline uses.
- `set_isa` / `isa` / `supported_isas`: which SIMD path runs ("avx512", "avx2",
  "scalar", or "auto" for the best the CPU has). The environment variable
  TIERMEM_ADAM_ISA picks one before the first call.
- `set_prefetch` / `prefetch`: whether this kernel's passes (not the low-bit one's, which
  always do) ask for the lines ahead of them in software: on for Intel CPUs, off for AMD
  ones by default (measured both ways: native/adam.c). Results are the same either way.

The C code splits large calls across threads, as many as `torch.get_num_threads()` unless
`num_threads` says otherwise: from the main thread, OpenMP's team, the one torch's own ops
use, when the module was built with OpenMP; else (other threads, a child forked after the
module was loaded) a small pool of its own pthreads. `threads()` says which, and
`set_threads("pool")` forces the pool. The GIL is released for the duration of each call.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import Tensor

from tiermem._lib import ffi, lib
from tiermem.kernels.native_rules import check_tensor, native_threads

ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}
_ISA_NAMES = {v: k for k, v in ISAS.items()}
GRAD_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
OUT_DTYPES = {torch.bfloat16: 1, torch.float16: 2}
STATE_DTYPES = (torch.float32, torch.bfloat16)
STATE_MODES = {(torch.float32, "nearest"): 0, (torch.bfloat16, "nearest"): 1,
               (torch.bfloat16, "stochastic"): 2}
ROUNDINGS = ("nearest", "stochastic")
CRC_ARRAYS = {"master": 1, "exp_avg": 2, "exp_avg_sq": 4, "max_exp_avg_sq": 8}  # crc_mask bits
U64 = (1 << 64) - 1
ENV_ISA = "TIERMEM_ADAM_ISA"

_env_applied = False


def supported_isas() -> list[str]:
    """The paths this CPU can run, best last (always includes "scalar")."""
    return [name for name, code in ISAS.items() if code >= 0 and lib.tm_adam_isa_supported(code)]


def set_isa(name: str) -> None:
    """Force one path ("avx512", "avx2", "scalar"), or "auto" for the best available."""
    global _env_applied
    _env_applied = True  # an explicit choice overrides the environment
    code = ISAS.get(name)
    if code is None:
        raise ValueError(f"unknown ISA {name!r}; expected one of {', '.join(ISAS)}")
    if not lib.tm_adam_set_isa(code):
        raise ValueError(f"ISA {name!r} is not supported by this CPU "
                         f"(supported: {', '.join(supported_isas())})")


def set_prefetch(on: bool | None) -> None:
    """Software prefetch in this kernel's passes on or off; None: the CPU's default."""
    lib.tm_adam_set_prefetch(-1 if on is None else int(bool(on)))


def prefetch() -> bool:
    """Whether the next pass of this kernel prefetches in software."""
    return bool(lib.tm_adam_get_prefetch())


def _shares_torchs_openmp() -> bool:
    """OpenMP's team only helps if it is the one ATen uses: torch's parallel backend is
    OpenMP, and one libgomp is mapped (the module's is torch's). Otherwise (a torch on
    its native thread pool or another OpenMP runtime) the module's team would be a
    second one, spinning beside torch's threads: the kernel keeps its own pool."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps") as maps:
            runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return False
    return len(runtimes) <= 1


_OPENMP_OK = _shares_torchs_openmp()


def set_threads(which: str) -> None:
    """"auto": OpenMP's team where `threads()` allows it and it is torch's own (the
    default); "pool": threads of tiermem's own for every call. This kernel, the low-bit
    one (kernels.lowbit) and the rules' (kernels.sgd, kernels.adagrad) follow it. Results
    are the same either way."""
    if which not in ("auto", "pool"):
        raise ValueError(f"threads: {which!r}; expected 'auto' or 'pool'")
    lib.tm_adam_set_openmp(int(which == "auto" and _OPENMP_OK))


set_threads("auto")


def threads() -> str:
    """Whose threads a threaded call from this thread runs on: "openmp" (the OpenMP team
    torch's ops use: built with OpenMP and called from the main thread) or "pool" (the
    kernel's own pthreads: a build without OpenMP, another thread, such as tiermem's
    overlap worker, or a child forked after the module was loaded)."""
    return "openmp" if lib.tm_adam_openmp() else "pool"


def isa() -> str:
    """The path the next call will run."""
    _apply_env()
    return _ISA_NAMES[lib.tm_adam_get_isa()]


def _apply_env() -> None:
    global _env_applied
    if _env_applied:
        return
    _env_applied = True
    name = os.environ.get(ENV_ISA, "").strip().lower()
    if name:
        try:
            set_isa(name)
        except ValueError as exc:
            raise ValueError(f"{ENV_ISA}={name!r}: {exc}") from None


def _ptr(t: Tensor | None, ctype: str):
    return ffi.NULL if t is None else ffi.cast(ctype, t.data_ptr())


def state_seed(*, step: int | float | Tensor, partition: int) -> int:
    """The stochastic-rounding seed of one parameter's update at one step count (the
    callers pass the user's parameter index as `partition`; the offset is the element's
    place in that parameter): every step and parameter draws a different stream, and a
    rerun draws the same one. The kernel hashes it (splitmix64), so plain packing loses
    nothing."""
    step = int(step.item() if isinstance(step, Tensor) else step)
    return ((step << 32) ^ int(partition)) & U64


def adam_fused_mixed(*, master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                     max_exp_avg_sq: Tensor | None = None, weight_out: Tensor | None = None,
                     step: float | int | Tensor, lr: float | Tensor, beta1: float,
                     beta2: float, eps: float, weight_decay: float = 0.0,
                     amsgrad: bool = False, maximize: bool = False,
                     decoupled_weight_decay: bool = True, rounding: str = "nearest",
                     seed: int = 0, offset: int = 0, num_threads: int | None = None,
                     checksums: Sequence[str] = (), torch_tail: int = 0) -> dict[str, int]:
    """One Adam/AdamW step on one contiguous run, in one pass.

    master: fp32, updated in place. exp_avg, exp_avg_sq (and max_exp_avg_sq with
    amsgrad): all fp32, or all bf16, updated in place; bf16 moments are computed in fp32
    (the parameter update uses those values) and stored rounded as `rounding` says:
    "nearest" (even; what `.to(torch.bfloat16)` does) or "stochastic" (x + 16 random bits,
    truncated; element i draws the bits of stream index offset + i of `seed`, whatever
    the ISA or thread split). grad: fp32, bf16 or fp16. weight_out: None, or a bf16/fp16
    tensor of the same length that receives the updated master rounded to nearest even.
    step: the step count after this step's increment. All tensors: CPU, contiguous, same
    numel (shapes may differ).

    checksums: names among "master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"; returns
    {name: CRC32C of that tensor's bytes after the update}, computed in the same pass
    (empty without checksums).

    torch_tail: the last elements that take torch's fused kernel's scalar-loop arithmetic
    (tail_len: where the run ends a parameter)."""
    _apply_env()
    n = master.numel()
    check_tensor(master, "master", (torch.float32,), n)
    check_tensor(grad, "grad", tuple(GRAD_DTYPES), n)
    check_tensor(exp_avg, "exp_avg", STATE_DTYPES, n)
    check_tensor(exp_avg_sq, "exp_avg_sq", (exp_avg.dtype,), n)
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad needs max_exp_avg_sq")
        check_tensor(max_exp_avg_sq, "max_exp_avg_sq", (exp_avg.dtype,), n)
    if weight_out is not None:
        check_tensor(weight_out, "weight_out", tuple(OUT_DTYPES), n)
    mode = _state_mode(exp_avg.dtype, rounding, seed, offset)
    mask = 0
    for name in checksums:
        if name not in CRC_ARRAYS:
            raise ValueError(f"checksums: unknown array {name!r}; expected some of "
                             f"{', '.join(CRC_ARRAYS)}")
        if name == "max_exp_avg_sq" and not amsgrad:
            raise ValueError("checksums: max_exp_avg_sq is only written with amsgrad")
        mask |= CRC_ARRAYS[name]
    crcs = _run(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq if amsgrad else None,
                weight_out, n, float(step), float(lr), beta1, beta2, eps, weight_decay,
                amsgrad, maximize, decoupled_weight_decay, num_threads, mode, seed, offset,
                crc_mask=mask, tail_len=_checked_tail(torch_tail, n))
    return {name: crcs[bit.bit_length() - 1] for name, bit in CRC_ARRAYS.items()
            if mask & bit}


def _state_mode(dtype: torch.dtype, rounding: str, seed: int, offset: int) -> int:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: {rounding!r}; expected one of {', '.join(ROUNDINGS)}")
    if (dtype, rounding) not in STATE_MODES:
        raise ValueError(f"rounding={rounding!r} rounds bf16 moments; these are {dtype} "
                         "and are stored as computed")
    for name, value in (("seed", seed), ("offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= U64:
            raise ValueError(f"{name}: expected an integer in 0..2**64-1, got {value!r}")
    return STATE_MODES[dtype, rounding]


def _run(p: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Tensor | None, out: Tensor | None,
         n: int, step: float, lr: float, beta1: float, beta2: float, eps: float,
         weight_decay: float, amsgrad: bool, maximize: bool, decoupled: bool,
         num_threads: int | None, state_mode: int = 0, seed: int = 0,
         offset: int = 0, crc_mask: int = 0, tail_len: int = 0) -> list[int]:
    """Run the kernel; the CRC32C of each array in crc_mask (p, m, v, vmax) comes back."""
    if n == 0:
        return [0, 0, 0, 0]
    if step < 1:
        raise ValueError(f"step must be the count after this step's increment (>= 1), "
                         f"got {step}")
    crcs = ffi.new("uint32_t[4]")
    rc = lib.tm_adam_step_crc(
        _ptr(p, "float *"), _ptr(m, "void *"), _ptr(v, "void *"), _ptr(vmax, "void *"),
        _ptr(g, "void *"), GRAD_DTYPES[g.dtype], _ptr(out, "void *"),
        OUT_DTYPES[out.dtype] if out is not None else 0, n, lr, float(beta1),
        float(beta2), float(eps), float(weight_decay), step, int(amsgrad), int(maximize),
        int(decoupled), state_mode, seed, offset, native_threads(num_threads), crc_mask,
        crcs if crc_mask else ffi.NULL, tail_len)
    if rc != 0:
        raise RuntimeError(f"tm_adam_step failed: {os.strerror(-rc)}")
    return list(crcs)


_TAIL_WIDTH: int | None = None  # torch_tail_width(), once measured


def torch_tail_width() -> int:
    """How many elements wide the vector loop of torch's fused CPU Adam kernel is: it runs
    the last numel % width elements of each tensor it steps in a scalar loop, which
    rounds exp_avg_sq differently from its vector loop (native/numeric.h, torch_tail), so
    the native kernel gives those elements the scalar loop's arithmetic to stay bitwise
    equal to AdamW(fused=True). Measured once, by which width makes the native kernel
    equal torch._fused_adam_ bit for bit on a few small tensors: 8 with torch's AVX2
    build of that kernel (which x86 CPUs run, AVX-512 ones too); 0 when no tail needs
    other arithmetic; -1 when no width tried matches (the native kernel then keeps its
    own arithmetic everywhere, within 1e-6 relative of torch's)."""
    global _TAIL_WIDTH
    if _TAIL_WIDTH is None:
        _TAIL_WIDTH = _probe_tail_width()
    return _TAIL_WIDTH


def _probe_tail_width() -> int:
    gen = torch.Generator().manual_seed(0)
    rows, n = 6, 4 * 16 + 15  # every width tried leaves 7..15 elements to its scalar loop
    start = [torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen) * 0.01,
             torch.rand(rows, n, generator=gen) * 0.01]
    grads = [torch.randn(rows, n, generator=gen) for _ in range(3)]
    want = [t.clone() for t in start]
    try:
        for k, g in enumerate(grads, start=1):
            torch._fused_adam_(*(list(t.unbind(0)) for t in (want[0], g, want[1], want[2])),
                               [], [torch.tensor(float(k))] * rows, lr=0.01, beta1=0.9,
                               beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                               maximize=False)
    except (RuntimeError, NotImplementedError, AttributeError):
        return -1  # a torch without a fused CPU Adam: nothing to match
    for width in (0, 8, 16):
        got = [t.clone() for t in start]
        for k, g in enumerate(grads, start=1):
            for r in range(rows):
                _run(got[0][r], g[r], got[1][r], got[2][r], None, None, n, float(k), 0.01, 0.9,
                     0.999, 1e-8, 0.01, False, False, False, 1,
                     tail_len=n % width if width else 0)
        if all(torch.equal(a, b) for a, b in zip(got, want)):
            return width
    return -1


def tail_len(numel: int, start: int, n: int) -> int:
    """Of the n elements from element `start` of a tensor of `numel` elements (a segment of
    a parameter, or of a rank's share that torch's optimizer steps as one tensor), how many
    at the end are in torch's fused kernel's scalar loop: its last numel %
    torch_tail_width() elements. (Those are always the segment's last ones.)"""
    width = torch_tail_width()
    if width <= 0 or start + n > numel:
        return 0
    return max(0, start + n - max(start, numel - numel % width))


def _checked_tail(tail: int, n: int) -> int:
    if not isinstance(tail, int) or isinstance(tail, bool) or not 0 <= tail <= n:
        raise ValueError(f"torch tail: expected 0..{n} elements, got {tail!r}")
    return tail


def _next_to(a: Tensor, b: Tensor) -> bool:
    """b starts where a ends, in the same storage dtype."""
    return b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()


def adam_native(*, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor],
                lr: float | Tensor, beta1: float, beta2: float, eps: float,
                weight_decay: float, amsgrad: bool, maximize: bool,
                decoupled_weight_decay: bool,
                weights_out: Sequence[Tensor | None] | None = None,
                num_threads: int | None = None,
                torch_tails: Sequence[int] | None = None) -> None:
    """tiermem's native kernel (native/adam.c): one pass per contiguous run, SIMD, threaded
    (num_threads, else torch's count).

    Same arithmetic as torch's fused CPU kernel; grads may be fp32, bf16 or fp16.
    weights_out: per segment None or a bf16/fp16 tensor that receives the updated fp32
    params[i] rounded to nearest even (a bf16 model's weights beside its fp32 masters).
    Segments that lie end to end in every list (and share a step count, a grad dtype and
    a weight-out dtype) make one run, and every run goes to the C kernel in one call
    (tm_adam_step_runs when there are several): the same bits as one call per segment.
    torch_tails: per segment, its last elements that take torch's fused kernel's
    scalar-loop arithmetic (tail_len; None: none)."""
    _apply_env()
    k = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, lst in lists.items():
        if len(lst) != k:
            raise ValueError(f"{name}: {len(lst)} tensors for {k} params")
    outs = list(weights_out) if weights_out is not None else [None] * k
    if len(outs) != k:
        raise ValueError(f"weights_out: {len(outs)} tensors for {k} params")
    tails = list(torch_tails) if torch_tails is not None else [0] * k
    if len(tails) != k:
        raise ValueError(f"torch_tails: {len(tails)} entries for {k} params")
    lr = float(lr)
    for i in range(k):
        n = _check_segment(i, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, outs, amsgrad)
        check_tensor(grads[i], f"grads[{i}]", tuple(GRAD_DTYPES), n)
        tails[i] = _checked_tail(tails[i], n)
    step_values = _step_counts(steps)
    # the moments first: segments of two records (host records updated together) are
    # never end to end there, so the check stops at the first array
    arrays = [exp_avgs, exp_avg_sqs, params, grads, *((max_exp_avg_sqs,) if amsgrad else ())]
    runs = []  # (first segment, elements in the run)
    i = 0
    while i < k:
        j = i + 1  # extend the run [i, j) while every list continues end to end
        while (j < k and step_values[j] == step_values[i] and not tails[j - 1]
               and grads[j].dtype == grads[i].dtype
               and all(_next_to(lst[j - 1], lst[j]) for lst in arrays)
               and _outs_continue(outs[j - 1], outs[j])):
            j += 1
        runs.append((i, sum(params[t].numel() for t in range(i, j)), tails[j - 1]))
        i = j
    _run_all(runs, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else None,
             outs, step_values, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize,
             decoupled_weight_decay, num_threads)


def _check_segment(i: int, params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                   exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
                   outs: Sequence[Tensor | None], amsgrad: bool) -> int:
    """Segment i's fp32 weights and moments (and its weights out) as the kernel takes them;
    returns its element count."""
    n = params[i].numel()
    check_tensor(params[i], f"params[{i}]", (torch.float32,), n)
    check_tensor(exp_avgs[i], f"exp_avgs[{i}]", (torch.float32,), n)
    check_tensor(exp_avg_sqs[i], f"exp_avg_sqs[{i}]", (torch.float32,), n)
    if amsgrad:
        check_tensor(max_exp_avg_sqs[i], f"max_exp_avg_sqs[{i}]", (torch.float32,), n)
    if outs[i] is not None:
        check_tensor(outs[i], f"weights_out[{i}]", tuple(OUT_DTYPES), n)
    return n


def _step_counts(steps: Sequence[float | Tensor]) -> list[float]:
    """The step counts as floats, each the count after this step's increment."""
    counts = [float(s.item() if isinstance(s, Tensor) else s) for s in steps]
    for v in counts:
        if v < 1:
            raise ValueError(f"step must be the count after this step's increment (>= 1), "
                             f"got {v}")
    return counts


def _run_all(runs: list[tuple[int, int, int]], params: list[Tensor], grads: list[Tensor],
             exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
             max_exp_avg_sqs: list[Tensor] | None, outs: list[Tensor | None],
             step_values: list[float], lr: float, beta1: float, beta2: float, eps: float,
             weight_decay: float, amsgrad: bool, maximize: bool, decoupled: bool,
             num_threads: int | None = None) -> None:
    """One C call for `runs` ((first segment, elements, torch tail) each; the arrays
    continue end to end from that segment's tensors), checked by adam_native."""
    if not runs:
        return
    if len(runs) == 1:
        (i, n, tail), = runs
        _run(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
             max_exp_avg_sqs[i] if amsgrad else None, outs[i], n, step_values[i], lr, beta1,
             beta2, eps, weight_decay, amsgrad, maximize, decoupled, num_threads,
             tail_len=tail)
        return
    # Several runs go to the kernel in one call, whose threads take chunks across them:
    # one call per run would wait for its slowest thread each time and pay the Python
    # and the argument checks of a call in between.
    spec = ffi.new("tm_adam_run[]", len(runs))
    for r, (i, n, tail) in zip(spec, runs):
        _fill_run(r, i, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, outs, amsgrad)
        r.grad, r.grad_dtype = _ptr(grads[i], "void *"), GRAD_DTYPES[grads[i].dtype]
        r.n, r.step, r.tail_len = n, step_values[i], tail
    _step_runs(spec, len(runs), lr, beta1, beta2, eps, weight_decay, amsgrad, maximize,
               decoupled, num_threads)


def _fill_run(r: Any, i: int, params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
              exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor] | None,
              outs: Sequence[Tensor | None], amsgrad: bool) -> None:
    """The tm_adam_run entry `r` points at segment i's weights, moments and weights out."""
    r.p = _ptr(params[i], "float *")
    r.exp_avg, r.exp_avg_sq = _ptr(exp_avgs[i], "void *"), _ptr(exp_avg_sqs[i], "void *")
    r.max_exp_avg_sq = _ptr(max_exp_avg_sqs[i] if amsgrad else None, "void *")
    r.out = _ptr(outs[i], "void *")
    r.out_dtype = OUT_DTYPES[outs[i].dtype] if outs[i] is not None else 0


def _step_runs(spec: Any, count: int, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, amsgrad: bool, maximize: bool, decoupled: bool,
               num_threads: int | None) -> None:
    """tm_adam_step_runs over the first `count` entries of `spec`; raises on its failure."""
    rc = lib.tm_adam_step_runs(spec, count, float(lr), float(beta1), float(beta2),
                               float(eps), float(weight_decay), int(amsgrad), int(maximize),
                               int(decoupled), native_threads(num_threads))
    if rc != 0:
        raise RuntimeError(f"tm_adam_step_runs failed: {os.strerror(-rc)}")


class AdamRunTable:
    """tm_adam_step_runs' argument table over segments whose weights, moments and weight
    outputs stay where they are from one step to the next (host-tier records and a CPU
    model's parameters): those are checked and their addresses laid out once, and each
    step() checks and fills in only the gradients and the step counts. adam_native pays
    its checks, slices and run-merging on every call, about 0.1 ms of Python per 64 MiB
    partition, 3-4% of a host-tier step that runs at memory speed.

    Segment i updates params[i] (fp32, in place) with exp_avgs[i], exp_avg_sqs[i] (and
    max_exp_avg_sqs[i] with amsgrad), writing weights_out[i] (None, or a bf16/fp16 copy)
    in the same pass; its gradient is step()'s grads[slot] from element `start` on, for
    (slot, start) = grad_of[i], and its step count steps[slot]. grad_numels[slot]: the
    elements grads[slot] must have. Each segment is a run of its own: the kernel's threads
    take chunks across runs, the same bits as adam_native's runs. The table holds the
    tensors it points into, so their memory outlives it; a caller whose tensors may move
    (a parameter's .data replaced) makes a new table."""

    def __init__(self, *, params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
                 weights_out: Sequence[Tensor | None], amsgrad: bool,
                 grad_of: Sequence[tuple[int, int]], grad_numels: Sequence[int]) -> None:
        k = len(params)
        lists = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
                 "weights_out": weights_out, "grad_of": grad_of}
        if amsgrad:
            lists["max_exp_avg_sqs"] = max_exp_avg_sqs
        for name, lst in lists.items():
            if len(lst) != k:
                raise ValueError(f"{name}: {len(lst)} entries for {k} params")
        self._spec = ffi.new("tm_adam_run[]", max(k, 1))
        self._grad_of = [(int(slot), int(start)) for slot, start in grad_of]
        self._grad_numels = [int(n) for n in grad_numels]
        self._amsgrad = bool(amsgrad)
        for i, (r, (slot, start)) in enumerate(zip(self._spec, self._grad_of)):
            n = _check_segment(i, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, weights_out,
                               amsgrad)
            if not (0 <= slot < len(self._grad_numels)
                    and 0 <= start <= self._grad_numels[slot] - n):
                raise ValueError(f"grad_of[{i}]: elements {start}..{start + n} of gradient "
                                 f"{slot} are not inside it")
            _fill_run(r, i, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, weights_out,
                      amsgrad)
            r.n = n
            r.tail_len = tail_len(self._grad_numels[slot], start, n)
        self._n = k
        self._addr: list[tuple[int, int, int]] = []  # the gradients step() last pointed at
        # the memory the table points into stays allocated as long as the table lives
        self._keep = (list(params), list(exp_avgs), list(exp_avg_sqs),
                      list(max_exp_avg_sqs), list(weights_out))

    def step(self, *, grads: Sequence[Tensor], steps: Sequence[float | Tensor],
             lr: float | Tensor, beta1: float, beta2: float, eps: float,
             weight_decay: float, maximize: bool, decoupled_weight_decay: bool,
             num_threads: int | None = None) -> None:
        """One Adam/AdamW step of every segment: grads and steps per slot (the count after
        this step's increment), the hyperparameters as adam_native's."""
        _apply_env()
        slots = len(self._grad_numels)
        if len(grads) != slots or len(steps) != slots:
            raise ValueError(f"{len(grads)} grads and {len(steps)} step counts for "
                             f"{slots} gradient slots")
        addr = []
        for slot, g in enumerate(grads):
            check_tensor(g, f"grads[{slot}]", tuple(GRAD_DTYPES), self._grad_numels[slot])
            addr.append((g.data_ptr(), g.element_size(), GRAD_DTYPES[g.dtype]))
        counts = _step_counts(steps)
        if not self._n:
            return
        if addr != self._addr:  # new gradients (set_to_none); else the same memory again
            for r, (slot, start) in zip(self._spec, self._grad_of):
                base, size, code = addr[slot]
                r.grad, r.grad_dtype = ffi.cast("void *", base + start * size), code
            self._addr = addr
        for r, (slot, _) in zip(self._spec, self._grad_of):
            r.step = counts[slot]
        _step_runs(self._spec, self._n, lr, beta1, beta2, eps, weight_decay, self._amsgrad,
                   maximize, decoupled_weight_decay, num_threads)


def _outs_continue(a: Tensor | None, b: Tensor | None) -> bool:
    """Two segments' weight outputs make one run: both absent, or b right after a in
    a's dtype."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and _next_to(a, b)
