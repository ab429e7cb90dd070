"""The memory floor of a one-pass Adam update, for bench/adam.py's bound row.

A C loop moves exactly the bytes an update must move and does one multiply-add per array
and nothing else: fp32 reads p, g, m, v and writes p, m, v (28 B per element);
bf16-mixed reads a bf16 g and the fp32 p, m, v and writes p, m, v and a bf16 weight (also
28 B). Its threads take chunks in turn, as tiermem's native pass does, so what it measures
is what this machine's memory gives that access pattern, not a stand-in for it (a triad
`a += alpha * b`, the bound before, ran slower than the Adam rows on a 2-vCPU Zen 1: it
misses the mix of four read streams and three write streams).

Built once with cffi (the compiler tiermem's own build uses) into build/bench-floor/,
named by its source's digest; where it cannot be built, `load()` raises and the bench's
bound row says why.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import threading
from pathlib import Path

import torch

C_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>

typedef struct {
    float *p, *m, *v;
    const void *g;
    uint16_t *out;
    int g16;
    float step;
    int64_t n, chunk, next;
    pthread_mutex_t mu;
} floor_job;

static int64_t take(floor_job *j)
{
    pthread_mutex_lock(&j->mu);  /* once a chunk (a million elements): no contention */
    int64_t c = j->next++;
    pthread_mutex_unlock(&j->mu);
    return c;
}

/* The job's fields in restrict locals: stores through a float * could otherwise be
 * stores to the job itself, and the loop would reload every field each element instead of
 * running on vectors. One loop per gradient dtype, with no branch inside. */
static void span32(float *restrict p, const float *restrict g, float *restrict m,
                   float *restrict v, float step, int64_t b, int64_t e)
{
    for (int64_t i = b; i < e; i++) {
        float mi = m[i] * 0.9f + g[i], vi = v[i] * 0.999f + g[i] * g[i];
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] + step * mi;
    }
}

static void span16(float *restrict p, const uint16_t *restrict g16, float *restrict m,
                   float *restrict v, uint16_t *restrict out, float step, int64_t b,
                   int64_t e)
{
    for (int64_t i = b; i < e; i++) {
        uint32_t u = (uint32_t)g16[i] << 16;
        float g;
        __builtin_memcpy(&g, &u, 4);
        float mi = m[i] * 0.9f + g, vi = v[i] * 0.999f + g * g;
        float pi = p[i] + step * mi;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        __builtin_memcpy(&u, &pi, 4);
        out[i] = (uint16_t)(u >> 16);
    }
}

static void *work(void *arg)
{
    floor_job *j = arg;
    for (int64_t c = take(j); c * j->chunk < j->n; c = take(j)) {
        int64_t b = c * j->chunk, e = b + j->chunk < j->n ? b + j->chunk : j->n;
        if (j->g16)
            span16(j->p, j->g, j->m, j->v, j->out, j->step, b, e);
        else
            span32(j->p, j->g, j->m, j->v, j->step, b, e);
    }
    return 0;
}

void floor_pass(float *p, const void *g, int g16, float *m, float *v, uint16_t *out,
                int64_t n, int64_t chunk, int threads, float step)
{
    floor_job j = {p, m, v, g, out, g16, step, n, chunk, 0};
    pthread_mutex_init(&j.mu, 0);
    pthread_t tid[64];
    int started = 0;
    for (int k = 1; k < threads && k < 64; k++)
        if (pthread_create(&tid[started], 0, work, &j) == 0)
            started++;
    work(&j);
    for (int k = 0; k < started; k++)
        pthread_join(tid[k], 0);
    pthread_mutex_destroy(&j.mu);
}
"""

C_DECL = ("void floor_pass(float *p, const void *g, int g16, float *m, float *v, "
          "uint16_t *out, int64_t n, int64_t chunk, int threads, float step);")
CHUNK = 1 << 20  # elements a chunk: tiermem's native pass takes up to this many at a time
BUILD = Path(__file__).resolve().parent.parent / "build" / "bench-floor"
_lock = threading.Lock()


def load():
    """The built module (its `lib.floor_pass` and `ffi`), built here on first use."""
    digest = hashlib.sha256((C_SOURCE + C_DECL).encode()).hexdigest()[:12]
    name = f"_tm_bench_floor_{digest}"
    with _lock:
        if str(BUILD) not in sys.path:
            sys.path.insert(0, str(BUILD))
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
        from cffi import FFI

        ffi = FFI()
        ffi.cdef(C_DECL)
        # -march=native: the bench runs where it was built, and the compiler's vectors
        # keep the loop at the memory's pace rather than the core's
        ffi.set_source(name, C_SOURCE, extra_compile_args=["-O3", "-march=native"],
                       libraries=["pthread"])
        BUILD.mkdir(parents=True, exist_ok=True)
        ffi.compile(tmpdir=str(BUILD), verbose=False)
        importlib.invalidate_caches()
        return importlib.import_module(name)


class Floor:
    """One floor pass over a bench problem's own arrays: the weights (the fp32 master for
    bf16-mixed), the gradient as the update reads it (bf16 for bf16-mixed), the two
    moments, and the bf16 weights a bf16-mixed update writes. The values do not change
    the timing; the weights' step alternates in sign so they stay where they are."""

    def __init__(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, weight_out: torch.Tensor | None):
        self.mod = load()
        self.tensors = (master, grad, exp_avg, exp_avg_sq, weight_out)
        assert all(t is None or t.is_contiguous() for t in self.tensors)
        self.g16 = int(grad.dtype == torch.bfloat16)
        self.n = master.numel()
        self.step = 1e-4

    def _ptr(self, t: torch.Tensor | None, ctype: str):
        return self.mod.ffi.NULL if t is None else self.mod.ffi.cast(ctype, t.data_ptr())

    def __call__(self) -> None:
        p, g, m, v, out = self.tensors
        self.mod.lib.floor_pass(self._ptr(p, "float *"), self._ptr(g, "void *"), self.g16,
                                self._ptr(m, "float *"), self._ptr(v, "float *"),
                                self._ptr(out, "uint16_t *"), self.n, CHUNK,
                                max(1, torch.get_num_threads()), self.step)
        self.step = -self.step

