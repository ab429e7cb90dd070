"""optimizer.update_threads: while the steps wait on NVMe longer than their updates run,
the native update pass is measured on every thread and on one fewer and the faster is
kept; a step whose update has become the bound goes back to every thread
(tiermem/optim/threads.py).

The policy is checked against a table of step figures; end to end, a drive whose reads
are slower while the update runs on one of the counts makes real steps decide, and the
native kernels (SGD, Adagrad, Adam, int8 Adam) must run on the count the step figures
report, with results that do not move: bitwise the plain optimizer, or what the same
kernel gives on every thread."""

from __future__ import annotations

import time

import pytest
import torch

import tiermem
from tiermem.config import ConfigError, load_config
from tiermem.kernels import adagrad as k_adagrad
from tiermem.kernels import lowbit as k_lowbit
from tiermem.kernels import native_adam as k_adam
from tiermem.kernels import sgd as k_sgd
from tiermem.optim.threads import PAIRS, REVISIT, UpdateThreads
from tiermem.telemetry.stats import StepStats

from offload_helpers import (Synthetic, assert_same_tensor, backend_params, config,
                             make_batches, train, twin)

STEPS = 4
DELAY = 0.02  # seconds a slowed read takes at least


@pytest.fixture
def two_threads():
    """torch's thread count 2 (the policy's n - 1 is then 1), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


W, F, B = (3.0, 1.0), (0.5, 1.0), (0.1, 1.0)  # (stall, update): waiting, unbound, bound
P, R = PAIRS, REVISIT


def steps(figure, seconds, n):
    return [(*figure, seconds)] * n


def pairs(full, fewer, n=P, figure=W):
    """n measured pairs: a step on every thread taking `full` seconds, then one on a
    thread fewer taking `fewer`."""
    return [(*figure, full), (*figure, fewer)] * n


def measured(winner):
    """The counts after each step of a measurement of P pairs that `winner` wins."""
    return [1, None] * (P - 1) + [1, winner]


# (name, setting, [(stall, update, step seconds[, NVMe bytes read: 64 MiB unless said]) of
# each finished step], the count the steps after them run on); torch has 2 threads: None
# is every thread, 1 one fewer
POLICY = [
    ("a step that read nothing is not measured", 0,
     [(*W, 0.01, 0)] + pairs(1.0, 0.9), [None] + measured(1)),
    ("update-bound never tries", 0, steps((0.0, 1.0), 1, 3) + steps((1.0, 1.0), 1, 5),
     [None] * 8),
    ("no update: no figure", 0, steps((9.0, 0.0), 1, 8), [None] * 8),
    ("fewer wins", 0, pairs(1.0, 0.9), measured(1)),
    ("every thread wins", 0, pairs(1.0, 1.1), measured(None)),
    ("a tie keeps every thread", 0, pairs(1.0, 1.0), measured(None)),
    ("pairs, not blocks: the disk drifts between them", 0,
     [(*W, t) for k in range(P) for t in (1.0 + k, 0.95 + k)], measured(1)),
    ("waiting on a thread fewer still counts", 0,
     [(*W, 1.0), (0.3, 1.0, 0.9)] * P, measured(1)),
    ("an unbound step on every thread opens no pair", 0,
     [(*W, 1.0), (*W, 0.9), (*F, 5.0), (*W, 1.0), (*W, 0.9)] + pairs(1.0, 0.9, P - 2),
     [1, None, None, 1, None] + measured(1)[4:]),
    ("update-bound on a thread fewer: every thread a while", 0,
     [(*W, 1.0), (*B, 0.5)] + steps(W, 1.0, R), [1] + [None] * (R + 1)),
    ("kept, then measured again", 0,
     pairs(1.0, 0.9) + steps(W, 0.9, R) + pairs(1.0, 0.9),
     measured(1) + [1] * (R - 1) + [None] + measured(1)),
    ("the evidence adds up", 0,
     pairs(1.0, 0.5) + steps(W, 0.5, R) + pairs(1.0, 1.1),
     measured(1) + [1] * (R - 1) + [None] + measured(1)),
    ("and fades", 0,
     pairs(1.0, 0.98) + steps(W, 0.9, R) + pairs(1.0, 1.1),
     measured(1) + [1] * (R - 1) + [None] + measured(None)),
    ("fixed", 1, steps((0.0, 1.0), 1, 2) + pairs(1.0, 2.0), [1] * (2 + 2 * P)),
    ("fixed above torch's", 3, pairs(1.0, 0.5), [3] * (2 * P)),
]


@pytest.mark.parametrize("name,setting,figures,expected", POLICY,
                         ids=[p[0] for p in POLICY])
def test_policy(two_threads, name, setting, figures, expected):
    assert len(figures) == len(expected)
    policy = UpdateThreads(setting)
    assert policy.current() == (setting or None)
    got = []
    for stall, update, seconds, *read in figures:
        policy.observe(StepStats(stall_seconds=stall, update_seconds=update,
                                 step_seconds=seconds,
                                 read_bytes={"nvme": read[0] if read else 1 << 26}))
        got.append(policy.current())
    assert got == expected
    assert policy.count() == (expected[-1] or 2)


def test_one_thread_never_reduces():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = UpdateThreads(0)
        policy.observe(StepStats(stall_seconds=10.0, update_seconds=1.0))
        assert policy.current() is None and policy.count() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", [-1, 1025, "two"])
def test_config_refuses(value):
    with pytest.raises(ConfigError, match="optimizer.update_threads"):
        load_config({"optimizer": {"update_threads": value}})


class SlowTransfer:
    """A read that completes no earlier than `delay` seconds after its submission."""

    def __init__(self, inner, delay: float):
        self.inner, self.ready = inner, time.monotonic() + delay

    def done(self) -> bool:
        return time.monotonic() >= self.ready and self.inner.done()

    def wait(self, timeout):
        left = self.ready - time.monotonic()
        if timeout is not None and left > timeout:
            time.sleep(max(0.0, timeout))
            return False
        time.sleep(max(0.0, left))
        return self.inner.wait(None if timeout is None else max(0.0, timeout - left))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ThreadsSeen:
    """The thread counts the native kernels were handed, per call."""

    def __init__(self, monkeypatch):
        self.seen: list[int] = []
        real = k_sgd.native_threads

        def spy(num_threads=None):
            got = real(num_threads)
            self.seen.append(got)
            return got
        for mod in (k_sgd, k_adagrad, k_adam, k_lowbit):
            monkeypatch.setattr(mod, "native_threads", spy)


class ContendedReads:
    """The engine's backend on a drive slower than the update, whose reads take longer
    while the native updates beside them run on `slow_on` threads (as the I/O engine's do
    on a small machine while the update holds every core): the count that is faster is
    known. `policy.count()` is the count of the updates beside transfers."""

    def __init__(self, inner, policy: UpdateThreads, slow_on: int):
        self.inner, self.policy, self.slow_on = inner, policy, slow_on

    def submit(self, *, op, **kw):
        got = self.inner.submit(op=op, **kw)
        if op != "read":
            return got
        return SlowTransfer(got, 3 * DELAY if self.policy.count() == self.slow_on else DELAY)

    def __getattr__(self, name):
        return getattr(self.inner, name)


OPTIMIZERS = {
    # (not fused: torch's fused SGD refuses a step where some momentum buffers exist and
    # others do not yet, as the model's side branch makes; the native pass equals both)
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-4), {}),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=1e-4, fused=True),
                {}),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05), {}),
    "adamw-int8": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
                   {"state_dtype": "int8"}),
}


def offloaded_run(tmp_path, monkeypatch, backend, name, *, steps=4, update_threads=0,
                  slow_on=None, host=0):
    """`steps` steps of `name` under tiermem; the model, tm.stats() and the set of thread
    counts the native kernels were handed in each step."""
    make, optimizer = OPTIMIZERS[name]
    model, _ = twin(Synthetic)
    opt = make(model.parameters())
    cfg = config(tmp_path, backend=backend, kernel="auto", block_size="64KiB", host=host)
    cfg["optimizer"].update(optimizer, update_threads=update_threads)
    seen = ThreadsSeen(monkeypatch)
    per_step = []
    with tiermem.offload(opt, cfg) as tm:
        if slow_on is not None:
            engine = tm.offloaded.tiers.engine
            engine._backend = ContendedReads(engine._backend, tm.offloaded.threads, slow_on)

        def note(i):
            per_step.append(set(seen.seen))
            seen.seen.clear()
        train(model, opt, make_batches(model, steps), after_step=note)
        stats = tm.stats()
        tm.discard()
    return model, stats, per_step


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("slow_on,winner", [(2, 1), (1, 2)],
                         ids=["fewer-faster", "every-faster"])
def test_auto_keeps_the_faster_count(tmp_path, monkeypatch, two_threads, backend, slow_on,
                                     winner):
    """Transfer-bound steps on every thread and on one fewer in turns, then the faster
    count for the steps after: the figures of the real steps decide."""
    n = 2 + 2 * PAIRS + 3
    _, stats, per_step = offloaded_run(tmp_path, monkeypatch, backend, "sgd", steps=n,
                                       slow_on=slow_on)
    counts = [s["update_threads"] for s in stats]
    # what the kernels ran on, as the stats say; an update with no transfer under way
    # beside it takes every thread (test_an_update_alone_with_the_disk_takes_every_thread)
    assert all(c in seen and seen <= {c, 2} for c, seen in zip(counts, per_step)), \
        (counts, per_step)
    assert 1 in counts, [(s["stall_seconds"], s["update_seconds"]) for s in stats]
    figures = [(round(s["step_seconds"], 3), round(s["stall_seconds"], 3)) for s in stats]
    assert counts[-3:] == [winner] * 3, (counts, figures)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_native_pass_takes_the_count(tmp_path, monkeypatch, two_threads, backend,
                                           name):
    """optimizer.update_threads reaches every native kernel (SGD, Adagrad, Adam, int8
    Adam), and moves no bit of the result."""
    model, stats, per_step = offloaded_run(tmp_path, monkeypatch, backend, name,
                                           update_threads=1)
    assert [s["update_threads"] for s in stats] == [1] * 4
    assert per_step == [{1}] * 4
    monkeypatch.undo()
    torch.set_num_threads(2)
    same, stats, per_step = offloaded_run(tmp_path / "all", monkeypatch, backend, name,
                                          update_threads=2)
    assert per_step == [{2}] * 4
    for (n, a), b in zip(model.named_parameters(), same.parameters()):
        assert_same_tensor(a, b, n)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_one_thread_equals_the_plain_optimizer(tmp_path, monkeypatch, two_threads, name):
    """The native SGD and Adagrad passes equal torch's kernels bitwise, on one thread as
    on two."""
    make, _ = OPTIMIZERS[name]
    _, ref = twin(Synthetic)
    ref_opt = make(ref.parameters())
    model, stats, _ = offloaded_run(tmp_path, monkeypatch, "threads", name, update_threads=1)
    train(ref, ref_opt, make_batches(ref, 4))
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert_same_tensor(a, b, n)


class SlowWrites:
    """The engine's backend with every write completing no earlier than `delay` seconds
    after its submission."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def submit(self, *, op, **kw):
        got = self.inner.submit(op=op, **kw)
        return SlowTransfer(got, self.delay) if op == "write" else got

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("backend", backend_params())
def test_an_update_alone_with_the_disk_takes_every_thread(tmp_path, monkeypatch, two_threads,
                                                          backend):
    """On a step that runs on one thread fewer, an update with no transfer under way beside
    it (the first after flush(): every record is in a buffer, nothing is read) takes every
    thread, and the updates after it, beside the first one's slow write-back, one fewer."""
    model, _ = twin(Synthetic)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    cfg = config(tmp_path, backend=backend, kernel="auto", partition_size="128KiB",
                 buffer_count=8, write_back="immediate")
    seen = ThreadsSeen(monkeypatch)
    batches = make_batches(model, 3)
    with tiermem.offload(opt, cfg) as tm:
        parts = len(tm.offloaded.tiers.pipeline.parts)
        assert 2 <= parts <= 8  # several records, all of them kept in the buffers
        train(model, opt, batches[:2])
        policy = tm.offloaded.threads
        monkeypatch.setattr(policy, "observe", lambda stats: None)
        policy.reduced = True
        engine = tm.offloaded.tiers.engine
        engine._backend = SlowWrites(engine._backend, delay=1.0)
        tm.offloaded.tiers.flush()
        seen.seen.clear()
        train(model, opt, batches[2:])
        ran, stats = list(seen.seen), tm.stats()[-1]
        tm.discard()
    assert stats["update_threads"] == 1
    assert ran[0] == 2 and ran[1:] == [1] * (len(ran) - 1) and len(ran) >= 2, ran


def test_nothing_waits_every_thread(tmp_path, monkeypatch, two_threads):
    """With the state in host memory no step waits: all run on every thread."""
    _, stats, per_step = offloaded_run(tmp_path, monkeypatch, "threads", "sgd", steps=8,
                                       host="64MiB")
    assert [s["update_threads"] for s in stats] == [2] * 8
    assert per_step == [{2}] * 8
