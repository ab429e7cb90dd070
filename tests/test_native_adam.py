"""tiermem's native Adam/AdamW kernel (native/adam.c via tiermem.kernels.native_adam).

- parity: 100 steps against torch.optim.Adam/AdamW(fused=True) over the flag table,
  within RTOL/ATOL (the tolerance native_adam's docstring states)
  (Adam/AdamW, amsgrad, maximize, weight decay, grad dtype, low-precision output);
- ISA paths: every SIMD path this CPU runs gives bitwise the scalar path's result,
  including ragged tails, the threaded path and special values;
- conversions: bf16/fp16 grads are upcast exactly, the weight output is the updated
  master rounded to nearest even (master.to(dtype));
- hypothesis: lengths 1..70000 and random hyperparameters;
- the "native" entry in tiermem.kernels.adam, argument checks, threads, fork.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.kernels import adam as kernels
from tiermem.kernels import native_adam as na

from adam_helpers import assert_bitwise, isa, on_another_thread, on_team_and_pool

RTOL, ATOL = 1e-6, 1e-7
ISAS = na.supported_isas()
SIMD_ISAS = [i for i in ISAS if i != "scalar"]
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD = {"fp32": torch.float32, **LOW}


class State:
    """Flat fp32 master and moments plus a model weight, for the native kernel."""

    def __init__(self, p0: torch.Tensor, amsgrad: bool, out: torch.dtype | None):
        n = p0.numel()
        self.p = p0.clone()
        self.m = torch.zeros(n)
        self.v = torch.zeros(n)
        self.vmax = torch.zeros(n) if amsgrad else None
        self.out = torch.empty(n, dtype=out) if out is not None else None

    def step(self, grad: torch.Tensor, step: int, hp: dict) -> None:
        na.adam_fused_mixed(master=self.p, grad=grad, exp_avg=self.m, exp_avg_sq=self.v,
                            max_exp_avg_sq=self.vmax, weight_out=self.out, step=step, **hp)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.p, self.m, self.v, self.vmax, self.out) if t is not None]


def reference(p0: torch.Tensor, hp: dict):
    """torch's fused optimizer on a copy of p0, with hp in tiermem's keyword form."""
    param = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if hp["decoupled_weight_decay"] else torch.optim.Adam
    opt = cls([param], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
              weight_decay=hp["weight_decay"], amsgrad=hp["amsgrad"],
              maximize=hp["maximize"], fused=True)
    return param, opt


def hyper(**kw) -> dict:
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False,
              maximize=False, decoupled_weight_decay=True)
    hp.update(kw)
    return hp


def grads_for(n: int, dtype: torch.dtype, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 0.05).to(dtype) for _ in range(steps)]


# -- parity with torch's fused optimizer over the flag table --------------------------------

TABLE = [pytest.param(dict(decoupled_weight_decay=dec, amsgrad=ams, maximize=mx,
                           weight_decay=wd), gdt, out,
                      id=f"{'adamw' if dec else 'adam'}-ams{int(ams)}-max{int(mx)}-wd{wd}"
                         f"-g{gdt}-out{out}")
         for dec in (False, True) for ams in (False, True) for mx in (False, True)
         for wd in (0.0, 0.1) for gdt in GRAD for out in (None, "bf16")]


@pytest.mark.parametrize("flags,gdt,out", TABLE)
def test_matches_torch_fused_100_steps(flags, gdt, out):
    n, steps = 1000 + 37, 100  # a ragged tail for every SIMD width
    hp = hyper(**flags)
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    param, opt = reference(p0, hp)
    mine = State(p0, hp["amsgrad"], LOW.get(out))
    for k, g in enumerate(grads_for(n, GRAD[gdt], steps, seed=2), start=1):
        param.grad = g.float()
        opt.step()
        mine.step(g, k, hp)
        if mine.out is not None:
            assert_bitwise(mine.out, mine.p.to(mine.out.dtype), f"weight out, step {k}")
    ref = opt.state[param]
    torch.testing.assert_close(mine.p, param.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mine.m, ref["exp_avg"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mine.v, ref["exp_avg_sq"], rtol=RTOL, atol=ATOL)
    if hp["amsgrad"]:
        torch.testing.assert_close(mine.vmax, ref["max_exp_avg_sq"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("decoupled", [False, True])
def test_kernel_entry_matches_fused_entry(decoupled):
    """kernels.adam_update(kernel="native") on segment lists (merged into runs where
    they lie end to end, separate where not) against kernel="fused" on the same ones."""
    n = 5000
    hp = hyper(weight_decay=0.1, amsgrad=True, decoupled_weight_decay=decoupled)
    cuts = [0, 700, 1800, 1801, 4000, n]

    def lists(base: torch.Tensor, holes: bool) -> list[torch.Tensor]:
        # views of one buffer (end to end: one run), or each segment a tensor of its own
        views = [base[a:b] for a, b in zip(cuts, cuts[1:])]
        return [v.clone() for v in views] if holes else views

    g = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=g)
    results = {}
    for kernel in ("fused", "native"):
        for holes in (False, True):
            p = lists(p0.clone(), holes)
            moms = [lists(torch.zeros(n), holes) for _ in range(3)]
            stepv = [torch.tensor(0.0), torch.tensor(0.0)]
            steps = [stepv[0]] * 3 + [stepv[1]] * (len(cuts) - 4)
            gen = torch.Generator().manual_seed(4)
            for _ in range(5):
                grads = [torch.randn(t.numel(), generator=gen) for t in p]
                for s in stepv:
                    s.add_(1)
                kernels.adam_update(kernel=kernel, params=p, grads=grads, exp_avgs=moms[0],
                                    exp_avg_sqs=moms[1], max_exp_avg_sqs=moms[2],
                                    steps=steps, **hp)
            results[kernel, holes] = [torch.cat(x) for x in (p, *moms)]
    for holes in (False, True):
        for a, b in zip(results["native", holes], results["fused", holes]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for a, b in zip(results["native", False], results["native", True]):
        assert_bitwise(a, b, "adjacent vs separate segments")


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("holes", [False, True])
def test_weights_out_runs_merge_like_segment_calls(out, holes, monkeypatch):
    """kernels.adam_update(kernel="native", weights_out=...) on segment lists whose masters,
    grads, moments and low-precision weights lie end to end goes to the C kernel as one
    run per step count, and gives bitwise what one adam_fused_mixed call per segment
    gives; where a list breaks (a segment of its own, a weight-out gap) it runs apart."""
    n = 6000
    hp = hyper(weight_decay=0.1, decoupled_weight_decay=True)
    cuts = [0, 900, 2500, 2501, 4100, n]
    # two step counts: the run breaks where the count changes (after segment 2)
    step_of = [0, 0, 0, 1, 1]

    def lists(base: torch.Tensor, apart: bool) -> list[torch.Tensor]:
        views = [base[a:b] for a, b in zip(cuts, cuts[1:])]
        return [v.clone() for v in views] if apart else views

    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(4)]
    calls, c_calls = [], []
    run_all = na._run_all

    def counted(runs, *a):
        calls.extend(n for _, n, _ in runs)
        c_calls.append(len(runs))
        return run_all(runs, *a)
    monkeypatch.setattr(na, "_run_all", counted)
    got = {}
    for way in ("merged", "per segment"):
        p = lists(p0.clone(), holes)
        m, v = lists(torch.zeros(n), holes), lists(torch.zeros(n), holes)
        w = lists(torch.zeros(n, dtype=out), holes)
        stepv = [torch.tensor(0.0), torch.tensor(0.0)]
        stepv[1].add_(3)  # the later segments' parameter took three steps more
        calls.clear()
        c_calls.clear()
        for g in grads:
            for t in stepv:
                t.add_(1)
            gs = lists(g, holes)
            steps = [stepv[k] for k in step_of]
            if way == "merged":
                assert kernels.adam_update(kernel="native", params=p, grads=gs, exp_avgs=m,
                                           exp_avg_sqs=v, max_exp_avg_sqs=[], steps=steps,
                                           weights_out=w, **hp) is None
            else:
                for i in range(len(p)):
                    na.adam_fused_mixed(master=p[i], grad=gs[i], exp_avg=m[i],
                                        exp_avg_sq=v[i], weight_out=w[i], step=steps[i],
                                        **hp)
        got[way] = [torch.cat(x) for x in (p, m, v, w)]
        if way == "merged":
            runs = len(p) if holes else 2
            assert len(calls) == runs * len(grads), calls
            assert c_calls == [runs] * len(grads)  # one C call per update, all runs in it
    for a, b in zip(got["merged"], got["per segment"]):
        assert_bitwise(a, b, "merged runs vs one call per segment")
    assert_bitwise(got["merged"][3], got["merged"][0].to(out), "weights out")


def test_weights_out_gap_splits_the_run(monkeypatch):
    """Masters, grads and moments end to end but the weights out not: one call each, and
    a weight-out list of the wrong length is refused."""
    n = 4000
    hp = hyper()
    p = torch.randn(n)
    g = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    w = torch.zeros(n + 8, dtype=torch.bfloat16)
    outs = [w[:1000], w[1008:4008]]  # a gap of 8 elements between the two
    calls = []
    run_all = na._run_all
    monkeypatch.setattr(na, "_run_all",
                        lambda runs, *a: calls.extend(n for _, n, _ in runs) or run_all(runs, *a))
    kernels.adam_update(kernel="native", params=[p[:1000], p[1000:]], grads=[g[:1000], g[1000:]],
                        exp_avgs=[m[:1000], m[1000:]], exp_avg_sqs=[v[:1000], v[1000:]],
                        max_exp_avg_sqs=[], steps=[torch.tensor(1.0)] * 2, weights_out=outs,
                        **hp)
    assert calls == [1000, 3000]
    assert_bitwise(torch.cat(outs), p.to(torch.bfloat16), "weights out")
    with pytest.raises(ValueError, match="weights_out: 1 tensors for 2 params"):
        na.adam_native(params=[p[:1000], p[1000:]], grads=[g[:1000], g[1000:]],
                       exp_avgs=[m[:1000], m[1000:]], exp_avg_sqs=[v[:1000], v[1000:]],
                       max_exp_avg_sqs=[], steps=[torch.tensor(2.0)] * 2,
                       weights_out=[w[:1000]], **hp)


def update_segments(together: bool, p, gs, moms, w, steps, hp) -> None:
    """One step of the segment lists p, gs, moms (exp_avg, exp_avg_sq, max), w (weights
    out, or None): through kernels.adam_update in one call, or one adam_fused_mixed call
    per (non-empty) segment."""
    amsgrad = hp["amsgrad"]
    if together:
        kernels.adam_update(kernel="native", params=p, grads=gs, exp_avgs=moms[0],
                            exp_avg_sqs=moms[1], max_exp_avg_sqs=moms[2] if amsgrad else [],
                            steps=steps, weights_out=w, **hp)
        return
    for i in range(len(p)):
        if p[i].numel():
            na.adam_fused_mixed(master=p[i], grad=gs[i], exp_avg=moms[0][i],
                                exp_avg_sq=moms[1][i],
                                max_exp_avg_sq=moms[2][i] if amsgrad else None,
                                weight_out=w[i] if w is not None else None,
                                step=steps[i], **hp)


@pytest.mark.parametrize("amsgrad,grad_dtype,out", [
    (False, torch.float32, None), (True, torch.float32, None),
    (False, torch.bfloat16, torch.bfloat16), (True, torch.float16, torch.float16)])
def test_runs_in_one_call_match_one_call_per_run(amsgrad, grad_dtype, out):
    """Separate runs (each its own tensors, two step counts, ragged lengths) go to the C
    kernel in one tm_adam_step_runs call, whose threads take chunks across the runs: the
    same bits as one call per run, on OpenMP's team, on tiermem's pool and from another
    thread. Big enough that the threads split the work (the single-thread cut-off is
    256K elements in all)."""
    hp = hyper(weight_decay=0.1, decoupled_weight_decay=True, amsgrad=amsgrad)
    sizes = [70_001, 1, 262_144 + 17, 65_536, 130_000]
    step_of = [1, 1, 4, 4, 2]
    gen = torch.Generator().manual_seed(21)
    p0 = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(grad_dtype) for n in sizes] for _ in range(3)]

    def run(merged: bool):
        p = [x.clone() for x in p0]
        moms = [[torch.zeros(n) for n in sizes] for _ in range(3)]
        w = [torch.zeros(n, dtype=out) for n in sizes] if out is not None else None
        for k, gs in enumerate(grads):
            steps = [torch.tensor(float(s + k)) for s in step_of]
            update_segments(merged, p, gs, moms, w, steps, hp)
        return [torch.cat(x) for x in (p, *moms[: 3 if amsgrad else 2], *([w] if w else []))]

    want = run(False)
    for got in (*on_team_and_pool(lambda: run(True)), on_another_thread(lambda: run(True))):
        for a, b in zip(got, want, strict=True):
            assert_bitwise(a, b, "runs in one call vs one call per run")


def test_runs_call_refuses_a_bad_run():
    """The C entry checks every run before it updates any: a bad one updates nothing."""
    from tiermem._lib import ffi, lib

    p, g, m, v = (torch.ones(1000) for _ in range(4))
    before = p.clone()
    spec = ffi.new("tm_adam_run[]", 2)
    for r in spec:
        r.p = ffi.cast("float *", p.data_ptr())
        r.exp_avg, r.exp_avg_sq = ffi.cast("void *", m.data_ptr()), ffi.cast("void *", v.data_ptr())
        r.grad, r.grad_dtype, r.n, r.step = ffi.cast("void *", g.data_ptr()), 0, 1000, 1.0
    spec[1].grad_dtype = 7  # no such dtype
    assert lib.tm_adam_step_runs(spec, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0, 1, 2) < 0
    spec[1].grad_dtype, spec[1].step = 0, 0.0  # a step count before any step
    assert lib.tm_adam_step_runs(spec, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0, 1, 2) < 0
    spec[1].step, spec[1].exp_avg_sq = 1.0, ffi.NULL
    assert lib.tm_adam_step_runs(spec, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0, 1, 2) < 0
    assert_bitwise(p, before, "nothing updated")
    assert lib.tm_adam_step_runs(spec, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0, 1, 2) == 0


def table_run(sizes, cuts, order, grad_dtype, out, amsgrad, steps=3, seed=0):
    """`steps` steps of parameters of `sizes` cut at `cuts` (per parameter, the sorted
    element offsets where a new segment starts), the segments in `order`: through one
    AdamRunTable (each parameter's whole gradient a slot, a new tensor every step) and
    through one adam_fused_mixed call per segment. Returns both results."""
    hp = hyper(weight_decay=0.1, decoupled_weight_decay=True, amsgrad=amsgrad)
    hp.pop("amsgrad")
    gen = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
             for _ in range(steps)]
    segs = []  # (param, start, stop)
    for k, n in enumerate(sizes):
        bounds = sorted({0, *(c for c in cuts[k] if 0 < c < n), n})
        segs += [(k, a, b) for a, b in zip(bounds, bounds[1:])]
    segs = [segs[i % len(segs)] for i in order] if order else segs
    segs = list(dict.fromkeys(segs))

    def state():
        return ([x.clone() for x in p0], [[torch.zeros(n) for n in sizes] for _ in range(3)],
                [torch.zeros(n, dtype=out) for n in sizes] if out else None)

    p, moms, w = state()
    table = na.AdamRunTable(
        params=[p[k][a:b] for k, a, b in segs], exp_avgs=[moms[0][k][a:b] for k, a, b in segs],
        exp_avg_sqs=[moms[1][k][a:b] for k, a, b in segs],
        max_exp_avg_sqs=[moms[2][k][a:b] for k, a, b in segs] if amsgrad else [],
        weights_out=[w[k][a:b] if w else None for k, a, b in segs], amsgrad=amsgrad,
        grad_of=[(k, a) for k, a, b in segs], grad_numels=sizes)
    for i, gs in enumerate(grads):
        table.step(grads=[g.clone() for g in gs], steps=[torch.tensor(float(i + 1 + k))
                                                        for k in range(len(sizes))], **hp)
    got = [*p, *moms[0], *moms[1], *(moms[2] if amsgrad else []), *(w or [])]
    p, moms, w = state()
    for i, gs in enumerate(grads):
        for k, a, b in segs:
            na.adam_fused_mixed(master=p[k][a:b], grad=gs[k][a:b], exp_avg=moms[0][k][a:b],
                                exp_avg_sq=moms[1][k][a:b],
                                max_exp_avg_sq=moms[2][k][a:b] if amsgrad else None,
                                weight_out=w[k][a:b] if w else None, amsgrad=amsgrad,
                                step=torch.tensor(float(i + 1 + k)),
                                torch_tail=na.tail_len(sizes[k], a, b - a), **hp)
    want = [*p, *moms[0], *moms[1], *(moms[2] if amsgrad else []), *(w or [])]
    return got, want


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=3),
       cuts=st.lists(st.lists(st.integers(0, 3000), max_size=4), min_size=3, max_size=3),
       order=st.lists(st.integers(0, 20), max_size=12),
       grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       out=st.sampled_from([None, torch.bfloat16, torch.float16]), amsgrad=st.booleans())
def test_run_table_matches_one_call_per_segment(sizes, cuts, order, grad_dtype, out, amsgrad):
    """AdamRunTable (laid out once, each segment reading its gradient from where it starts
    in its parameter's, new gradient tensors every step, segments in any order, some
    left out) gives the bits of one call per segment."""
    got, want = table_run(sizes, cuts, order, grad_dtype, out, amsgrad)
    for a, b in zip(got, want, strict=True):
        assert_bitwise(a, b, "table vs one call per segment")


def test_run_table_threads_match_one_call_per_segment():
    """The same, big enough that the kernel's threads split the work and take chunks
    across the segments, on OpenMP's team, on tiermem's pool and from another thread."""
    def run():
        return table_run([300_007, 200_003], [[70_001, 150_000], [1]], [], torch.bfloat16,
                         torch.bfloat16, False, steps=2)
    for got, want in (*on_team_and_pool(run), on_another_thread(run)):
        for a, b in zip(got, want, strict=True):
            assert_bitwise(a, b, "table vs one call per segment")


@pytest.mark.parametrize("n", [1, 7, 13, 1000, 1007, 70_001, 600_003])
@pytest.mark.parametrize("weight_decay, decoupled", [(0.0, False), (0.05, False), (0.05, True)])
@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, True)])
def test_torch_tails_make_the_pass_equal_torch_fused(n, weight_decay, decoupled, amsgrad,
                                                     maximize):
    """With torch_tails from tail_len the pass equals torch's fused Adam/AdamW bit for bit
    on every ISA, the scalar-loop elements at a tensor's end included; without them those
    elements are an ulp off (what makes this table able to fail)."""
    if na.torch_tail_width() < 0:
        pytest.skip("torch's fused kernel's tail arithmetic is not one tiermem knows")
    gen = torch.Generator().manual_seed(n)
    p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    v0 = torch.rand(n, generator=gen) * 0.01
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
              amsgrad=amsgrad, maximize=maximize)
    want = [p0.clone(), m0.clone(), v0.clone(), v0.clone()]
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for k, g in enumerate(grads, start=1):
        fused([want[0]], [g], [want[1]], [want[2]], [want[3]] if amsgrad else [],
              [torch.tensor(float(k))], grad_scale=None, found_inf=None, **hp)
    for name in ISAS:
        for tails in ([na.tail_len(n, 0, n)], None):
            got = [p0.clone(), m0.clone(), v0.clone(), v0.clone()]
            with isa(name):
                for k, g in enumerate(grads, start=1):
                    na.adam_native(params=[got[0]], grads=[g], exp_avgs=[got[1]],
                                   exp_avg_sqs=[got[2]], max_exp_avg_sqs=[got[3]],
                                   steps=[torch.tensor(float(k))], torch_tails=tails,
                                   decoupled_weight_decay=decoupled, **hp)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            if tails is not None:
                for a, b in zip(got, want):
                    assert_bitwise(a, b, f"isa {name}, n {n}")
            elif n % na.torch_tail_width() >= 5:  # (one or two elements may agree by chance)
                assert not same, "the tail elements agree without the tail arithmetic"


def test_run_table_refuses_what_it_cannot_run():
    p, m, v = torch.zeros(100), torch.zeros(100), torch.zeros(100)
    hp = hyper(weight_decay=0.0, decoupled_weight_decay=False, amsgrad=False)
    hp.pop("amsgrad")
    kw = dict(params=[p[:60]], exp_avgs=[m[:60]], exp_avg_sqs=[v[:60]], max_exp_avg_sqs=[],
              weights_out=[None], amsgrad=False)
    with pytest.raises(ValueError, match=r"grad_of\[0\]: elements 50..110 of gradient 0"):
        na.AdamRunTable(**kw, grad_of=[(0, 50)], grad_numels=[100])
    with pytest.raises(ValueError, match="exp_avgs: 2 entries for 1 params"):
        na.AdamRunTable(**{**kw, "exp_avgs": [m[:60], m[60:]]}, grad_of=[(0, 0)],
                        grad_numels=[100])
    table = na.AdamRunTable(**kw, grad_of=[(0, 40)], grad_numels=[100])
    with pytest.raises(ValueError, match="has 99 elements"):
        table.step(grads=[torch.zeros(99)], steps=[1.0], **hp)
    with pytest.raises(ValueError, match="must be contiguous"):
        table.step(grads=[torch.zeros(2, 50).t()], steps=[1.0], **hp)
    with pytest.raises(ValueError, match=r"step must be the count after"):
        table.step(grads=[torch.zeros(100)], steps=[0.0], **hp)
    with pytest.raises(ValueError, match="2 grads and 1 step counts for 1 gradient slots"):
        table.step(grads=[torch.zeros(100)] * 2, steps=[1.0], **hp)
    assert_bitwise(p, torch.zeros(100), "nothing updated")


def test_threaded_path_matches_torch():
    n = 600_001  # above the single-thread cut-off, ragged
    hp = hyper(weight_decay=0.1)
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(5))
    param, opt = reference(p0, hp)
    mine = State(p0, False, torch.bfloat16)
    for k, g in enumerate(grads_for(n, torch.bfloat16, 5, seed=6), start=1):
        param.grad = g.float()
        opt.step()
        mine.step(g, k, hp)
    torch.testing.assert_close(mine.p, param.detach(), rtol=RTOL, atol=ATOL)
    assert_bitwise(mine.out, mine.p.to(torch.bfloat16), "bf16 weight out")


# -- every ISA path gives the scalar path's bits ----------------------------------------------

def run_isa(name: str, n: int, hp: dict, gdt: torch.dtype, out: torch.dtype | None,
            steps: int = 3, seed: int = 0, threads: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mine = State(torch.randn(n, generator=g), hp["amsgrad"], out)
    grads = grads_for(n, gdt, steps, seed + 1)
    with isa(name):
        for k, grad in enumerate(grads, start=1):
            na.adam_fused_mixed(master=mine.p, grad=grad, exp_avg=mine.m, exp_avg_sq=mine.v,
                                max_exp_avg_sq=mine.vmax, weight_out=mine.out, step=k,
                                num_threads=threads, **hp)
    return mine.tensors()


ISA_CASES = [
    (hyper(), "fp32", None),
    (hyper(weight_decay=0.1, decoupled_weight_decay=False, amsgrad=True), "bf16", "bf16"),
    (hyper(weight_decay=0.1, maximize=True, beta1=0.3), "fp16", "fp16"),
    (hyper(weight_decay=0.01, amsgrad=True, maximize=True, beta2=0.95), "bf16", "fp16"),
    (hyper(beta1=0.0, eps=1e-6), "fp16", "bf16"),
]


@pytest.mark.skipif(not SIMD_ISAS, reason="this CPU has no SIMD path for the kernel")
@pytest.mark.parametrize("simd", SIMD_ISAS)
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 31, 33, 1000 + 13, 300_007,
                               2 * 1024 * 1024 + 5])  # the last: a weight out streams
@pytest.mark.parametrize("case", range(len(ISA_CASES)))
def test_simd_paths_match_scalar_bitwise(simd, n, case):
    hp, gdt, out = ISA_CASES[case]
    want = run_isa("scalar", n, hp, GRAD[gdt], LOW.get(out), seed=case)
    got = run_isa(simd, n, hp, GRAD[gdt], LOW.get(out), seed=case)
    for name, a, b in zip(("p", "m", "v", "vmax/out", "out"), got, want):
        assert_bitwise(a, b, f"{simd} vs scalar, {name}")


@pytest.mark.skipif("avx512" not in SIMD_ISAS, reason="only the AVX-512 loops prefetch")
@pytest.mark.parametrize("n", [1000 + 13, 300_007, 2 * 1024 * 1024 + 5])
@pytest.mark.parametrize("case", range(len(ISA_CASES)))
def test_software_prefetch_changes_no_bit(n, case):
    """The prefetch (on for Intel, off for AMD by default) only asks for lines early: both
    settings give the same bits, in the plain and the streaming-store loops (a weight out
    from a pass that moves 32 MiB or more) and at the ragged end where the prefetch stops."""
    hp, gdt, out = ISA_CASES[case]
    if n > 1_000_000 and out is None:
        pytest.skip("the streaming-store loop needs a weight out")
    got = {}
    try:
        for on in (False, True):
            na.set_prefetch(on)
            assert na.prefetch() is on
            got[on] = run_isa("avx512", n, hp, GRAD[gdt], LOW.get(out), steps=2, seed=case)
    finally:
        na.set_prefetch(None)
    for name, a, b in zip(("p", "m", "v", "vmax/out", "out"), got[True], got[False]):
        assert_bitwise(a, b, f"prefetch on vs off, {name}")


def test_software_prefetch_default_follows_the_cpu():
    na.set_prefetch(None)
    vendor = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("vendor_id")), "")
    if vendor not in ("AuthenticAMD", "GenuineIntel"):
        pytest.skip(f"no measured default for CPU vendor {vendor!r}")
    assert na.prefetch() is (vendor == "GenuineIntel")


def _specials() -> torch.Tensor:
    """Every bf16 and fp16 value as fp32, rounding ties and near-ties for both, the
    edges of fp16's range, subnormal fp32, infinities and NaNs with payloads."""
    allh = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    vals = [allh.view(torch.bfloat16).float(), allh.view(torch.float16).float()]
    r = torch.randint(-2**31, 2**31 - 1, (20000,), generator=torch.Generator().manual_seed(7),
                      dtype=torch.int64).to(torch.int32)
    vals.append(r.view(torch.float32))
    ties = (r & ~0xFFFF) | 0x8000  # exact bf16 halfway points, and one ulp either side
    vals += [ties.view(torch.float32), (ties + 1).view(torch.float32),
             (ties - 1).view(torch.float32)]
    h = (r & ~0x1FFF) | 0x1000  # exact fp16 halfway points (in fp16's normal range or not)
    vals += [h.view(torch.float32), (h + 1).view(torch.float32)]
    vals.append(torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 1e-8, 2.0**-25, 2.0**-24,
                              3 * 2.0**-26, 1e-45, -1e-40, float("inf"), -float("inf"),
                              0.0, -0.0]))
    vals.append(torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345 - 2**32, 0x7FFFFFFF],
                             dtype=torch.int32).view(torch.float32))
    return torch.cat(vals)


@pytest.mark.parametrize("out", ["bf16", "fp16"])
def test_weight_out_rounds_like_torch_on_special_values(out):
    """lr 0 leaves the master as it is, so the output is exactly the conversion."""
    p0 = _specials()
    n = p0.numel()
    hp = hyper(lr=0.0)
    results = {}
    for name in ISAS:
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        o = torch.empty(n, dtype=LOW[out])
        with isa(name):
            na.adam_fused_mixed(master=p, grad=torch.zeros(n), exp_avg=m, exp_avg_sq=v,
                                weight_out=o, step=1, **hp)
        finite = ~p0.isnan()
        assert_bitwise(p[finite], p0[finite], f"{name}: master moved with lr 0")
        results[name] = o
        assert_bitwise(o[finite], p0[finite].to(LOW[out]), f"{name}: {out} rounding")
        assert o[~finite].isnan().all()
    for name in SIMD_ISAS:
        assert_bitwise(results[name], results["scalar"], f"{name} vs scalar {out} output")


@pytest.mark.parametrize("gdt", ["bf16", "fp16"])
def test_low_precision_grads_upcast_exactly(gdt):
    """beta1 = 0 makes exp_avg the gradient itself: every bf16/fp16 bit pattern."""
    allh = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(GRAD[gdt])
    n = allh.numel()
    results = {}
    for name in ISAS:
        p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        with isa(name):
            na.adam_fused_mixed(master=p, grad=allh, exp_avg=m, exp_avg_sq=v, step=1,
                                **hyper(beta1=0.0))
        finite = allh.isfinite()
        assert_bitwise(m[finite], allh[finite].float(), f"{name}: {gdt} upcast")
        results[name] = (p, m, v)
    for name in SIMD_ISAS:
        for a, b in zip(results[name], results["scalar"]):
            assert_bitwise(a, b, f"{name} vs scalar with every {gdt} gradient")


# -- hypothesis: lengths and hyperparameters ----------------------------------------------------

@settings(max_examples=50)
@given(n=st.integers(1, 70000),
       lr=st.floats(1e-5, 1e-1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]), weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
       amsgrad=st.booleans(), maximize=st.booleans(), decoupled=st.booleans(),
       gdt=st.sampled_from(sorted(GRAD)), out=st.sampled_from([None, *sorted(LOW)]),
       seed=st.integers(0, 2**16))
def test_hypothesis_lengths_and_hyperparameters(n, lr, beta1, beta2, eps, weight_decay,
                                                amsgrad, maximize, decoupled, gdt, out, seed):
    hp = hyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
               amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled)
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    param, opt = reference(p0, hp)
    mine = State(p0, amsgrad, LOW.get(out))
    for k, g in enumerate(grads_for(n, GRAD[gdt], 4, seed + 1), start=1):
        param.grad = g.float()
        opt.step()
        mine.step(g, k, hp)
    torch.testing.assert_close(mine.p, param.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mine.v, opt.state[param]["exp_avg_sq"], rtol=RTOL, atol=ATOL)
    if mine.out is not None:
        assert_bitwise(mine.out, mine.p.to(mine.out.dtype), "weight out")
    if SIMD_ISAS:  # and the scalar path agrees bit for bit
        scalar = State(p0, amsgrad, LOW.get(out))
        with isa("scalar"):
            for k, g in enumerate(grads_for(n, GRAD[gdt], 4, seed + 1), start=1):
                scalar.step(g, k, hp)
        for a, b in zip(mine.tensors(), scalar.tensors()):
            assert_bitwise(a, b, "auto vs scalar")


# -- registration, checks, threads ----------------------------------------------------------

IN_PASS = ("weights_out", "checksums", "rounding", "seeds", "offsets")


def test_registered_with_the_same_signature():
    """Every kernel behind the dispatcher has the one keyword-only signature; the native
    binding takes its update part and the weights out (which it merges into runs with the
    rest; the other in-pass options are the dispatcher's)."""
    assert "native" in kernels.KERNELS
    assert kernels.KERNELS["fused"] is kernels.adam_fused
    want = inspect.signature(kernels.adam_fused).parameters
    for name, fn in kernels.KERNELS.items():
        got = inspect.signature(fn).parameters
        assert list(got) == list(want), name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in got.values()), name
    got = inspect.signature(na.adam_native).parameters
    assert list(got) == [k for k in want if k not in IN_PASS or k == "weights_out"]


@pytest.mark.parametrize("kernel", ["fused", "single_tensor", "multi_tensor"])
@pytest.mark.parametrize("option", [dict(checksums=("exp_avg",)), dict(rounding="nearest"),
                                    dict(weights_out=[None])])
def test_torch_kernels_refuse_in_pass_work(kernel, option):
    """Only the native kernel writes weights, CRCs or rounded state in its pass: the others
    refuse rather than drop it."""
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(ValueError, match="only the native kernel"):
        kernels.adam_update(kernel=kernel, params=[p], grads=[g], exp_avgs=[m],
                            exp_avg_sqs=[v], max_exp_avg_sqs=[], steps=[torch.tensor(1.0)],
                            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            amsgrad=False, maximize=False, decoupled_weight_decay=False,
                            **option)


def test_isa_selection():
    assert ISAS[0] == "scalar"
    with isa("scalar"):
        assert na.isa() == "scalar"
    assert na.isa() == ISAS[-1]
    with pytest.raises(ValueError, match="unknown ISA"):
        na.set_isa("sse9")
    for name in ("avx2", "avx512"):
        if name not in ISAS:
            with pytest.raises(ValueError, match="not supported"):
                na.set_isa(name)


def test_isa_from_environment(tmp_path):
    code = ("import tiermem.kernels.native_adam as na, torch\n"
            "p = torch.zeros(3); na.adam_fused_mixed(master=p, grad=torch.ones(3), "
            "exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3), step=1, lr=1e-3, beta1=0.9, "
            "beta2=0.999, eps=1e-8)\nprint(na.isa())\n")
    env = {**os.environ, na.ENV_ISA: "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"
    env[na.ENV_ISA] = "sse9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "TIERMEM_ADAM_ISA" in out.stderr


def _call(**over):
    n = 8
    kw = dict(master=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n),
              exp_avg_sq=torch.zeros(n), step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    kw.update(over)
    na.adam_fused_mixed(**kw)


@pytest.mark.parametrize("over,err,match", [
    (dict(master=torch.zeros(8, dtype=torch.float64)), TypeError, "master: dtype"),
    (dict(grad=torch.zeros(8, dtype=torch.int32)), TypeError, "grad: dtype"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.float16)), TypeError, "exp_avg: dtype"),
    # bf16 moments are allowed, but all of them or none
    (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "exp_avg_sq: dtype"),
    (dict(amsgrad=True, max_exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16)), TypeError,
     "max_exp_avg_sq: dtype"),
    (dict(rounding="stochastic"), ValueError, "rounds bf16 moments"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16),
          exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16), rounding="up"), ValueError,
     "rounding: 'up'"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16),
          exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16), rounding="stochastic", seed=-1),
     ValueError, "seed: expected an integer"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16),
          exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16), offset=2**64), ValueError,
     "offset: expected an integer"),
    (dict(weight_out=torch.zeros(8)), TypeError, "weight_out: dtype"),
    (dict(grad=torch.zeros(16)[::2]), ValueError, "grad: must be contiguous"),
    (dict(exp_avg_sq=torch.zeros(9)), ValueError, "exp_avg_sq: has 9 elements"),
    (dict(grad=torch.zeros(8, device="meta")), ValueError, "CPU tensors"),
    (dict(amsgrad=True), ValueError, "amsgrad needs max_exp_avg_sq"),
    (dict(step=0), ValueError, "step must be"),
    (dict(master=torch.zeros(8, requires_grad=True)), RuntimeError, "no_grad"),
    (dict(grad=[0.0] * 8), TypeError, "expected a tensor"),
])
def test_argument_checks(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


def test_kernel_entry_checks_list_lengths():
    t = [torch.zeros(4)]
    with pytest.raises(ValueError, match="exp_avgs: 0 tensors for 1 params"):
        na.adam_native(params=t, grads=t, exp_avgs=[], exp_avg_sqs=t, max_exp_avg_sqs=[],
                       steps=[torch.tensor(1.0)], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, amsgrad=False, maximize=False,
                       decoupled_weight_decay=True)


def test_thread_counts_and_concurrent_callers_agree():
    n, hp = 700_003, hyper(weight_decay=0.1, amsgrad=True)
    want = run_isa(ISAS[-1], n, hp, torch.bfloat16, torch.bfloat16, threads=1)
    for threads in (2, 5):
        got = run_isa(ISAS[-1], n, hp, torch.bfloat16, torch.bfloat16, threads=threads)
        for a, b in zip(got, want):
            assert_bitwise(a, b, f"{threads} threads vs 1")
    results = [None] * 3

    def worker(i):
        results[i] = run_isa(ISAS[-1], n, hp, torch.bfloat16, torch.bfloat16, threads=2)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for r in results:
        for a, b in zip(r, want):
            assert_bitwise(a, b, "concurrent callers")


FORK_N = 1 << 20
_FORK_BUFS: list[torch.Tensor] = []


def _child(q):
    # Only the kernel runs here: torch's own OpenMP pool does not survive fork, so the
    # buffers come from the parent. The kernel's threads are then its own pool, not
    # OpenMP's (whose team, used by the parent, would never answer).
    try:
        q.put((na.threads(), _hashed_step(*_FORK_BUFS)))
    except BaseException as exc:  # noqa: BLE001
        q.put(repr(exc))


def _hashed_step(p, g, m, v) -> dict[str, int]:
    """One threaded step over the fork tests' buffers, returning the CRCs it wrote."""
    return na.adam_fused_mixed(master=p, grad=g, exp_avg=m, exp_avg_sq=v, step=3, lr=1e-3,
                               beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                               num_threads=2, checksums=("master", "exp_avg", "exp_avg_sq"))


def _fork_buffers() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    n = FORK_N + 13  # ragged: the last chunk is short
    return [torch.randn(n, generator=gen), torch.randn(n, generator=gen),
            torch.randn(n, generator=gen), torch.rand(n, generator=gen)]


def test_pool_survives_fork():
    """A child forked after the kernel ran threaded (on OpenMP's team when built with it,
    or on the pool) runs it threaded again, on the pool, to the parent's bits."""
    _call(master=torch.zeros(FORK_N), grad=torch.ones(FORK_N), exp_avg=torch.zeros(FORK_N),
          exp_avg_sq=torch.zeros(FORK_N), num_threads=2)  # the threads exist before fork
    want = _hashed_step(*_fork_buffers())
    _FORK_BUFS[:] = _fork_buffers()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(q,))
    proc.start()
    try:
        result = q.get(timeout=60)
    finally:
        proc.join(5)
        if proc.exitcode is None:
            proc.kill()
        _FORK_BUFS.clear()
    assert not isinstance(result, str), result
    openmp, got = result
    assert openmp == "pool", "a forked child must not use the parent's OpenMP team"
    assert got == want, "the pool and the parent's threads wrote different bits"
    assert proc.exitcode == 0


def test_other_threads_run_on_the_pool_to_the_same_bits():
    """The main thread's calls may run on OpenMP's team; another thread's (the overlap
    worker's) run on the kernel's own pool. Both give the same bits, CRCs included."""
    def run() -> tuple[str, dict[str, int], list[torch.Tensor]]:
        p, g, m, v = _fork_buffers()
        return na.threads(), _hashed_step(p, g, m, v), [p, m, v]
    here, forced = on_team_and_pool(run)
    assert forced[0] == "pool" and forced[1] == here[1]
    with pytest.raises(ValueError, match="expected 'auto' or 'pool'"):
        na.set_threads("omp")
    there = on_another_thread(run)
    assert there[0] == "pool"
    assert there[1] == here[1]
    for a, b in zip(there[2], here[2]):
        assert_bitwise(a, b, "pool vs the main thread's threads")


def test_no_openmp_team_unless_it_is_torchs(monkeypatch):
    """A torch on its native thread pool (or any but OpenMP) would leave the module's team
    a second one: the kernel then keeps its own pool, and set_threads("auto") too."""
    monkeypatch.setattr(torch.__config__, "parallel_info",
                        lambda: "ATen parallel backend: native thread pool\n")
    assert na._shares_torchs_openmp() is False
    monkeypatch.setattr(na, "_OPENMP_OK", False)
    try:
        na.set_threads("auto")
        assert na.threads() == "pool"
    finally:
        monkeypatch.undo()
        na.set_threads("auto")


def test_one_openmp_runtime_shared_with_torch():
    """Built with OpenMP, the kernel runs on the libgomp torch loaded, not a second one
    (two runtimes would put two spinning teams on the same cores)."""
    code = (
        "import os, tiermem\n"
        "from tiermem.kernels import native_adam as na\n"
        "import tiermem._native as n\n"
        "maps = open(f'/proc/{os.getpid()}/maps').read().splitlines()\n"
        "gomp = {l.split()[-1] for l in maps if 'libgomp' in l}\n"
        "links = b'libgomp.so.1' in open(n.__file__, 'rb').read()\n"
        "print(len(gomp), int(links), int(na.threads() == 'openmp'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    runtimes, links, openmp = (int(x) for x in out.stdout.split())
    assert openmp == links, "the kernel uses OpenMP exactly when the module links it"
    if links:
        assert runtimes == 1, "a second libgomp was loaded beside torch's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_offload_with_the_native_kernel(tmp_path, dtype):
    """optimizer.kernel: native through the whole pipeline (host and NVMe partitions, a
    param cut across partitions) equals AdamW(fused=True) bit for bit where the kernel
    knows torch's scalar tail (torch_tail_width), else within 1e-6."""
    import tiermem

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(300, 517), torch.nn.Linear(517, 200))

    m2 = make().to(dtype)
    # the master starts from the model's (possibly rounded) weights, so does the reference
    ref = [p.detach().float().clone().requires_grad_() for p in m2.parameters()]
    o1 = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = {"swap": {"paths": [str(tmp_path)]}, "tiers": {"host": {"capacity": "300KiB"}},
           "pipeline": {"partition_size": "128KiB"}, "optimizer": {"kernel": "native"}}
    g = torch.Generator().manual_seed(1)
    with tiermem.offload(o2, cfg) as tm:
        for _ in range(5):
            m2(torch.randn(8, 300, generator=g).to(dtype)).float().square().mean().backward()
            for r, p in zip(ref, m2.parameters()):
                r.grad = p.grad.float()
            o1.step()
            o2.step()
            o2.zero_grad()
        sd = o2.state_dict()
        assert tm.plan()["state_bytes"]["nvme"] > 0
    for i, (r, p) in enumerate(zip(ref, m2.parameters())):
        master = sd["state"][i].get("master_param", None)
        got = master if master is not None else p.detach()
        if na.torch_tail_width() >= 0:
            assert_bitwise(got, r.detach(), f"param {i}")
        else:
            torch.testing.assert_close(got, r.detach(), rtol=1e-6, atol=1e-7)
        if master is not None:  # the model's weights are the master, rounded to nearest even
            assert torch.equal(p.detach(), master.to(dtype))


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 3000), min_size=1, max_size=7),
       adjacent=st.lists(st.booleans(), min_size=7, max_size=7),
       steps=st.lists(st.integers(1, 4), min_size=7, max_size=7),
       amsgrad=st.booleans(), gdt=st.sampled_from(sorted(GRAD)),
       out=st.sampled_from([None, *sorted(LOW)]), big=st.booleans(),
       seed=st.integers(0, 2**16))
def test_hypothesis_runs_in_one_call(cuts, adjacent, steps, amsgrad, gdt, out, big, seed):
    """Any segment list (empty segments, end to end in one buffer or apart, step counts
    changing along it, big enough for the threads or not) through kernels.adam_update in
    one call gives bitwise what one call per segment gives."""
    sizes = list(cuts)
    if big:
        sizes[0] += 300_000  # the threads share the pass
    n = sum(sizes)
    hp = hyper(weight_decay=0.05, amsgrad=amsgrad)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(GRAD[gdt])

    def segments(base: torch.Tensor) -> list[torch.Tensor]:
        out_, at = [], 0
        for i, size in enumerate(sizes):
            v = base[at: at + size]
            out_.append(v if adjacent[i] else v.clone())  # apart: a tensor of its own
            at += size
        return out_

    def run(together: bool):
        p = segments(p0.clone())
        moms = [segments(torch.zeros(n)) for _ in range(3)]
        w = segments(torch.zeros(n, dtype=LOW[out])) if out is not None else None
        gs = segments(g)
        st_ = [torch.tensor(float(steps[i])) for i in range(len(sizes))]
        update_segments(together, p, gs, moms, w, st_, hp)
        return [torch.cat(x) for x in (p, *moms[: 3 if amsgrad else 2], *([w] if w else []))]

    for a, b in zip(run(True), run(False), strict=True):
        assert_bitwise(a, b, "one call vs one call per segment")


@pytest.mark.parametrize("n", [(1 << 16) - 3, (1 << 19) + 5, 3 * (1 << 20) + 13])
@pytest.mark.parametrize("threads", [1, 2])
def test_checksums_in_the_pass_are_the_arrays_crcs(n, threads):
    """The CRCs the pass computes piece by piece (64K elements, inside chunks of up to 1M a
    thread takes) are the CRC32C of each array's bytes after the update, whatever the
    chunking: one piece, pieces of a chunk, several chunks a thread, a ragged end."""
    from tiermem.kernels.checksum import crc32c

    gen = torch.Generator().manual_seed(n)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen)
    got = na.adam_fused_mixed(master=p, grad=g, exp_avg=m, exp_avg_sq=v, step=2, lr=1e-3,
                              beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                              num_threads=threads,
                              checksums=("master", "exp_avg", "exp_avg_sq"))
    assert got == {"master": crc32c(p), "exp_avg": crc32c(m), "exp_avg_sq": crc32c(v)}
