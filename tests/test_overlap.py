"""pipeline.overlap_backward: updates that start during backward give the same numbers as
the plain torch optimizer, and every way to misuse them is a clear error, not a wrong step.

The reference is a plain torch optimizer on a deep copy of the model, fed the same
batches (see offload_helpers). Partitions are tiny (64 KiB) so each step streams many of
them through few buffers while backward runs: a missing wait or a partition updated
twice, too early or not at all shows up as a bitwise difference.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch

import tiermem
from faults import inject
from offload_helpers import (Synthetic, backend_params, compare_runs, config, listdir,
                             loss_of, make_batches, side_used, twin)
from tiermem.optim.offloaded import OffloadedOptimizer
from zygote import run_python

STEPS = 6


def overlap_config(swap, **kw):
    cfg = config(swap, **kw)
    cfg["pipeline"]["overlap_backward"] = True
    return cfg


def run(model, opt, batches, tm=None, *, sched=None, clip=None, after_step=None):
    """The loop both sides run. With `tm`, every micro-batch's backward but the last runs
    inside tm.accumulating(); the reference (tm None) just accumulates."""
    for i, micro in enumerate(batches):
        for j, (tokens, target) in enumerate(micro):
            last = j == len(micro) - 1
            with tm.accumulating() if tm is not None and not last else contextlib.nullcontext():
                (loss_of(model, tokens, target, side_used(i)) / len(micro)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if after_step is not None:
            after_step(i)


def groups_of(model, groups):
    if not groups:
        return model.parameters()
    # fc1.weight is cut over several partitions; fc2's and side's parameters share some
    return [{"params": [model.emb.weight], "lr": 3e-3, "weight_decay": 0.0},
            {"params": [model.fc1.weight, model.fc1.bias], "betas": (0.8, 0.95)},
            {"params": [*model.fc2.parameters(), *model.side.parameters()], "lr": 2e-2}]


PLACEMENTS = {
    "host": dict(host="64MiB"),
    "nvme": dict(host=0, buffer_count=3, prefetch_depth=2),
    "mixed": dict(host="256KiB", buffer_count=4, prefetch_depth=2),
    # the smallest pipeline: every buffer is reused right after its write-back was issued
    "tiny": dict(host=0, buffer_count=2, prefetch_depth=1),
    "wide": dict(host=0, buffer_count=6, prefetch_depth=2),
}

OPTIMIZERS = {  # (class, kwargs, kernel, reference kwargs)
    "adamw-loop-match": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05, foreach=False),
                         "match", {}),
    "adam-foreach-amsgrad-maximize-match": (
        torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01, amsgrad=True, maximize=True,
                               foreach=True), "match", {}),
    "adamw-fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.02), "fused",
                    dict(fused=True)),
}


def parity(tmp_path, backend, placement, optimizer, *, micro=1, groups=False, steps=STEPS,
           sched=None):
    cls, kw, kernel, ref_kw = OPTIMIZERS[optimizer]
    model, ref_model = twin(Synthetic)
    opt = cls(groups_of(model, groups), **kw)
    ref_opt = cls(groups_of(ref_model, groups), **{**kw, **ref_kw})
    batches = make_batches(model, steps, micro=micro)
    cfg = overlap_config(tmp_path, backend=backend, kernel=kernel, **PLACEMENTS[placement])
    lrs, ref_lrs = [], []
    with tiermem.offload(opt, cfg) as tm:
        run(model, opt, batches, tm, sched=sched(opt) if sched else None,
            after_step=lambda i: lrs.append(opt.param_groups[0]["lr"]))
        stats, parts = tm.stats(), tm.offloaded.parts
    run(ref_model, ref_opt, batches, sched=sched(ref_opt) if sched else None,
        after_step=lambda i: ref_lrs.append(ref_opt.param_groups[0]["lr"]))
    compare_runs(model, opt, ref_model, ref_opt)
    assert lrs == ref_lrs
    assert listdir(tmp_path) == []
    return model, stats, parts


def expected_early(model, parts, step):
    """Partitions every parameter of which gets a gradient in `step`: the hooks make them
    ready, so the worker updates them during backward."""
    unused = set() if side_used(step) else {id(p) for p in model.side.parameters()}
    return sum(all(id(s.param) not in unused for s in p.segments) for p in parts)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("backend", backend_params())
def test_parity(tmp_path, backend, placement, optimizer):
    """Bitwise equal to the plain optimizer; the side branch's parameters have no grad in
    most steps, so partitions holding them wait for step() while the others ran early."""
    model, stats, parts = parity(tmp_path, backend, placement, optimizer)
    assert len(parts) >= 12 and len(stats) == STEPS
    for i, s in enumerate(stats):
        assert s["early_partitions"] == expected_early(model, parts, i) > 0
        assert sum(s["partitions"].values()) == len(parts)  # each updated once, none skipped


@pytest.mark.parametrize("backend", backend_params())
def test_accumulating_micro_batches(tmp_path, backend):
    """Backward inside tm.accumulating() only accumulates; the last micro-batch's starts the
    update."""
    model, stats, parts = parity(tmp_path, backend, "nvme", "adamw-loop-match", micro=3)
    assert [s["early_partitions"] for s in stats] == [
        expected_early(model, parts, i) for i in range(STEPS)]


@pytest.mark.parametrize("backend", backend_params())
def test_groups_with_shared_and_cut_partitions(tmp_path, backend):
    model, stats, parts = parity(tmp_path, backend, "mixed", "adamw-loop-match", groups=True)
    segments_per_param = {}
    for p in parts:
        for s in p.segments:
            segments_per_param[id(s.param)] = segments_per_param.get(id(s.param), 0) + 1
    assert segments_per_param[id(model.fc1.weight)] > 1  # a parameter cut over partitions
    assert any(len(p.segments) > 1 for p in parts)  # partitions of several parameters


@pytest.mark.parametrize("sched", ["cosine", "lambda"])
def test_lr_scheduler_between_steps(tmp_path, sched):
    """The scheduler steps after optimizer.step(), so each backward's updates read the lr it
    set."""
    def make(opt):
        if sched == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-4)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    parity(tmp_path, "threads", "mixed", "adamw-loop-match", sched=make)


def test_bf16_model_native_kernel_same_as_without_overlap(tmp_path):
    """A bf16 model (fp32 master weights in the records, one native pass per segment): the
    same bits with and without overlap."""
    results = []
    for overlap in (False, True):
        model = Synthetic().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        cfg = config(tmp_path / str(overlap), host=0, kernel="native")
        cfg["pipeline"]["overlap_backward"] = overlap
        with tiermem.offload(opt, cfg) as tm:
            run(model, opt, make_batches(model, 4), tm)
            early = [s["early_partitions"] for s in tm.stats()]
        assert any(early) == overlap
        results.append(([p.detach().clone() for p in model.parameters()],
                        opt.state_dict()["state"]))
    (params, state), (params2, state2) = results
    for a, b in zip(params, params2):
        assert torch.equal(a, b)
    for i in state:
        for k in state[i]:
            assert torch.equal(torch.as_tensor(state[i][k]), torch.as_tensor(state2[i][k])), k


def test_slow_worker_is_waited_for(tmp_path, monkeypatch):
    """Every update sleeps first, so backward ends long before the worker does: step()
    must wait for it before anything else, and zero_grad() right after the step must not
    pull gradients from under it."""
    original = OffloadedOptimizer._update

    def slow(self, part, views, stats):
        time.sleep(0.003)
        original(self, part, views, stats)

    monkeypatch.setattr(OffloadedOptimizer, "_update", slow)
    parity(tmp_path, "threads", "tiny", "adamw-loop-match", steps=4)


# -- what needs every gradient first -------------------------------------------------------


def _model_opt(tmp_path, **cfg):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, overlap_config(tmp_path, **cfg)


def _backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 128, generator=g)).square().mean().backward()


def test_closure_is_refused(tmp_path):
    model, opt, cfg = _model_opt(tmp_path, host=0)
    before = [p.detach().clone() for p in model.parameters()]
    with tiermem.offload(opt, cfg):
        def closure():
            opt.zero_grad()
            _backward(model)
        with pytest.raises(tiermem.TierMemError, match=r"step\(closure\).*overlap_backward"):
            opt.step(closure)
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a.detach(), b)


def test_clipping_after_backward_is_refused(tmp_path):
    """clip_grad_norm_ edits gradients after the update started: the step says so."""
    model, opt, cfg = _model_opt(tmp_path, host=0)
    with tiermem.offload(opt, cfg):
        _backward(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with pytest.raises(tiermem.TierMemError,
                           match=r"gradient of parameter .* changed .*overlap_backward: false"):
            opt.step()


def test_next_micro_batch_outside_accumulating_is_refused(tmp_path):
    """Knowing the model, its next forward before step() is refused at once: the weights
    are being updated."""
    model, opt, cfg = _model_opt(tmp_path, host=0)
    with tiermem.offload(opt, cfg, model=model):
        _backward(model, 0)
        with pytest.raises(tiermem.TierMemError, match=r"forward ran between.*accumulating"):
            _backward(model, 1)
        opt.step()  # the first backward's step can still be completed
        opt.zero_grad()
        _backward(model, 2)
        opt.step()


def test_second_backward_outside_accumulating_is_refused(tmp_path):
    """Without model=, a second gradient is what gives it away. (Both forwards first, and
    one Linear layer on inputs without grad, whose backward reads no weight, so that
    autograd's own check on modified weights cannot answer first.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 300)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, overlap_config(tmp_path, host=0)):
        x = torch.randn(2, 4, 128)
        first, second = (model(x[i]).square().mean() for i in range(2))
        first.backward()
        second.backward()
        with pytest.raises(tiermem.TierMemError, match=r"second gradient.*tm.accumulating"):
            opt.step()


def test_state_dict_between_backward_and_step_is_refused(tmp_path):
    model, opt, cfg = _model_opt(tmp_path, host=0)
    with tiermem.offload(opt, cfg) as tm:
        _backward(model)
        assert tm.stats() == []  # waits for the worker, touches nothing
        with pytest.raises(tiermem.TierMemError, match=r"state_dict\(\) was called between"):
            opt.state_dict()
        opt.step()
        assert opt.state_dict()["state"]


# -- errors in the worker --------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params())
def test_worker_io_error_surfaces_in_step(tmp_path, backend):
    """A read that fails while backward runs does not disturb backward; the next step()
    raises it, and the block still hands the state back (the disk recovered)."""
    model, opt, cfg = _model_opt(tmp_path, host=0, backend=backend)
    cfg["io"]["retries"] = 0
    with tiermem.offload(opt, cfg) as tm:
        _backward(model, 0)
        opt.step()
        opt.zero_grad()
        faulty = inject(tm, "read", 0)  # the first read the worker issues
        _backward(model, 1)
        with pytest.raises(tiermem.TierMemIOError) as info:
            opt.step()
        assert info.value.op == "read" and faulty.injected == 1
    assert len(opt.state) == 4 and listdir(tmp_path) == []


def test_worker_error_without_step_surfaces_at_exit(tmp_path):
    model, opt, cfg = _model_opt(tmp_path, host=0)
    cfg["io"]["retries"] = 0
    with pytest.warns(tiermem.TierMemWarning, match=r"optimizer.step\(\) was not called"):
        with pytest.raises(tiermem.TierMemIOError):
            with tiermem.offload(opt, cfg) as tm:
                _backward(model, 0)
                opt.step()
                opt.zero_grad()
                tm.stats()  # the worker's run-ahead is done: the fault hits a read of backward
                faulty = inject(tm, "read", 0)
                _backward(model, 1)
                tm.stats()  # waits for the worker, which hits the fault; raises nothing
                assert faulty.injected == 1
    assert len(opt.state) == 4 and listdir(tmp_path) == []


def test_worker_integrity_error_surfaces_in_step(tmp_path):
    """A record damaged on disk is caught by the worker's read; step() raises it."""
    from tiermem.swap.integrity import IntegrityError

    model, opt, cfg = _model_opt(tmp_path, host=0, buffer_count=2, prefetch_depth=1)
    with pytest.raises(tiermem.TierMemError, match="kept on disk"):
        with tiermem.offload(opt, cfg) as tm:
            _backward(model, 0)
            opt.step()
            opt.zero_grad()
            tm.offloaded.tiers.flush()
            store, pipeline = tm.offloaded.tiers.store, tm.offloaded.tiers.pipeline
            # a partition the end of the step did not read ahead into a buffer
            part = next(p for p in reversed(pipeline.planned) if p.id not in pipeline.where)
            slot = store.slots[part.id]
            with open(store.files[slot.file].path, "r+b") as f:
                f.seek(slot.offset + 10)
                byte = f.read(1)
                f.seek(slot.offset + 10)
                f.write(bytes([byte[0] ^ 0x40]))
            _backward(model, 1)
            with pytest.raises(IntegrityError, match=f"partition {part.id} "):
                opt.step()


# -- hooks, order, config ------------------------------------------------------------------


def test_hooks_only_while_overlap_is_on(tmp_path):
    def hooks(model):
        return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())

    model, opt, cfg = _model_opt(tmp_path, host=0)
    with tiermem.offload(opt, cfg):
        assert hooks(model) == 4
    assert hooks(model) == 0
    cfg["pipeline"]["overlap_backward"] = False
    with tiermem.offload(opt, cfg) as tm:
        assert hooks(model) == 0
        with tm.accumulating():  # a no-op without overlap, so loops can always use it
            _backward(model)
        opt.step()


def test_nvme_order_follows_the_gradients(tmp_path):
    """After a step the planned order is the order partitions became ready: the output
    layer's first, the embedding's last, and the worker has the next step's first reads in
    flight, one per buffer (step() leaves them to it)."""
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tiermem.offload(opt, overlap_config(tmp_path, host=0, buffer_count=4,
                                             prefetch_depth=2)) as tm:
        batches = make_batches(model, 2)
        for tokens, target in batches[1]:  # step 1 uses the side branch: all params
            loss_of(model, tokens, target, True).backward()
        opt.step()
        pipeline = tm.offloaded.tiers.pipeline
        planned = pipeline.planned
        names = {id(p): n for n, p in model.named_parameters()}

        def params_of(part):
            return {names[id(s.param)].split(".")[0] for s in part.segments}

        assert sorted(p.id for p in planned) == [p.id for p in tm.offloaded.parts]
        assert params_of(planned[0]) <= {"fc2", "side"}
        assert "emb" in params_of(planned[-1])
        tm.offloaded.overlap.wait_idle()
        assert [p.id for p in planned[:4]] == sorted(pipeline.where, key=[
            p.id for p in planned].index)  # read ahead already, all four buffers
        opt.zero_grad()


def test_config_key_is_a_bool():
    with pytest.raises(tiermem.ConfigError, match="pipeline.overlap_backward"):
        tiermem.load_config({"pipeline": {"overlap_backward": "yes"}})
    assert tiermem.load_config(None).pipeline.overlap_backward is False


@pytest.mark.parametrize("backend", backend_params())
def test_crash_consistent_commits_every_step(tmp_path, backend):
    """With commits, updates during backward stay bitwise and every step() commits."""
    from tiermem.swap.manifest import read_manifest

    cls, kw, kernel, ref_kw = OPTIMIZERS["adamw-loop-match"]
    model, ref_model = twin(Synthetic)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref_model.parameters(), **kw)
    batches = make_batches(model, STEPS)
    cfg = overlap_config(tmp_path, backend=backend, kernel=kernel, **PLACEMENTS["mixed"])
    cfg["swap"]["durability"] = "crash_consistent"
    steps = []
    with tiermem.offload(opt, cfg) as tm:
        run(model, opt, batches, tm, after_step=lambda i: steps.append(
            (tm.committed_step, read_manifest(str(tmp_path / "tiermem-default"), None).step)))
        assert tm.stats()[-1]["early_partitions"] > 0
    run(ref_model, ref_opt, batches)
    compare_runs(model, opt, ref_model, ref_opt)
    assert steps == [(i + 1, i + 1) for i in range(STEPS)]


def test_crash_consistent_failed_step_rolls_back(tmp_path):
    """A read failing in the worker during backward: step() raises, the optimizer and the
    model are back at the last commit, and the same batch trains on from there."""
    cls, kw, kernel, ref_kw = OPTIMIZERS["adamw-loop-match"]
    model, ref_model = twin(Synthetic)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref_model.parameters(), **kw)
    batches = make_batches(model, 3)
    cfg = overlap_config(tmp_path, kernel=kernel, **PLACEMENTS["nvme"])
    cfg["swap"]["durability"] = "crash_consistent"
    cfg["io"]["retries"] = 0
    with tiermem.offload(opt, cfg) as tm:
        run(model, opt, batches[:1], tm)
        inject(tm, "read", 0)
        with pytest.raises(tiermem.TierMemIOError) as info:
            run(model, opt, batches[1:2], tm)
        assert "rolled back to committed step 1" in "".join(info.value.__notes__)
        opt.zero_grad()
        run(model, opt, batches[1:], tm)  # the new engine has no fault
    run(ref_model, ref_opt, batches[:1])  # the same calls: run() numbers batches per call
    run(ref_model, ref_opt, batches[1:])
    compare_runs(model, opt, ref_model, ref_opt)


class _Cut(Exception):
    pass


# The first layer's input needs no grad: torch says its full backward hook fires early.
@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
def test_backward_cut_short_after_updates(tmp_path, durability):
    """An exception leaves backward after the worker updated part of step 3, and the block
    ends. Crash-consistent: the optimizer and the model are rolled back to committed step 2,
    bitwise; scratch: the part of step 3 stays, and a warning says so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 256),
                                torch.nn.Linear(256, 8))
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    cfg = overlap_config(tmp_path, kernel="fused")
    cfg["pipeline"].update(partition_size="64KiB", buffer_count=3, prefetch_depth=1)
    cfg["swap"]["durability"] = durability
    cut = [False]

    def first_layer_backward(module, grad_in, grad_out):
        if cut[0]:  # backward reaches the first layer last: the later ones are queued
            opt._tiermem.overlap.wait_idle()  # ... and updated by the worker
            raise _Cut()
    model[0].register_full_backward_hook(first_layer_backward)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    with pytest.warns(tiermem.TierMemWarning, match="optimizer.step.. was not called") as rec:
        with pytest.raises(_Cut):
            with tiermem.offload(opt, cfg, model=model):
                for step in range(3):
                    cut[0] = step == 2
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
    for _ in range(2):
        ref_model(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    steps = [float(opt.state[p]["step"]) for p in model.parameters()]
    said = " ".join(str(w.message) for w in rec if issubclass(w.category, tiermem.TierMemWarning))
    if durability == "crash_consistent":
        assert "rolled back to committed step 2" in said
        assert steps == [2.0] * len(steps)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p.detach(), q.detach())
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k], ref.state[q][k])
    else:
        assert "the state holds that part of a step" in said
        assert 3.0 in steps and 2.0 in steps


@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
def test_zero_grad_after_a_cut_backward_is_no_update(tmp_path, monkeypatch):
    """zero_grad() after backward failed, with partitions already queued: the worker then
    finds no gradient and updates nothing (no kernel error at the exit); the next forward
    is refused."""
    from tiermem.optim.overlap import BackwardOverlap

    go = threading.Event()
    go.set()
    process = BackwardOverlap._process

    def held_back(self, part, upcoming):
        go.wait(30)  # the worker takes its partitions only once the test lets it
        return process(self, part, upcoming)
    monkeypatch.setattr(BackwardOverlap, "_process", held_back)
    model, opt, cfg = _model_opt(tmp_path, kernel="fused")  # torch's fused: no empty lists
    cfg["pipeline"]["partition_size"] = "64KiB"  # the last layer's partitions come first
    cut = [False]

    def hook(module, grad_in, grad_out):
        if cut[0]:
            raise _Cut()
    model[0].register_full_backward_hook(hook)
    with pytest.warns(tiermem.TierMemWarning, match="was not called"):
        with tiermem.offload(opt, cfg, model=model):
            _backward(model)
            opt.step()
            opt.zero_grad()
            cut[0] = True
            go.clear()
            with pytest.raises(_Cut):
                _backward(model, 1)
            opt.zero_grad()
            go.set()
            opt._tiermem.overlap.wait_idle()  # the queued partitions ran without grads
            with pytest.raises(tiermem.TierMemError, match="forward ran between a backward"):
                _backward(model, 2)


def test_refused_under_a_process_group(tmp_path):
    """A rank's share is updated through views backward's hooks never see: refused before
    the group is used."""
    cfg = config(tmp_path)
    cfg["pipeline"]["overlap_backward"] = True
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(tiermem.TierMemError, match="not supported under torch.distributed"):
        with tiermem.offload(opt, cfg, process_group=object()):
            pass


def test_dcp_checkpoint_waits_for_the_worker(tmp_path):
    """A DCP save right after step() (the worker still reading the next step ahead) sees
    the step's state; one between backward and step() is refused, as state_dict() is."""
    from tiermem.dist import dcp

    model, opt, cfg = _model_opt(tmp_path / "swap", host=0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.Linear(200, 128))
    ref_model.load_state_dict(model.state_dict())
    reference = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg) as tm:
        for seed in range(2):
            _backward(model, seed)
            opt.step()
            opt.zero_grad()
            _backward(ref_model, seed)
            reference.step()
            reference.zero_grad()
        dcp.save(tm, str(tmp_path / "ckpt"))
        _backward(model, 2)
        with pytest.raises(tiermem.TierMemError, match="tiermem.dist.dcp checkpoint"):
            dcp.save(tm, str(tmp_path / "ckpt2"))
        opt.step()
    model2, opt2, cfg2 = _model_opt(tmp_path / "swap2", host=0)
    with tiermem.offload(opt2, cfg2) as tm2:
        dcp.load(tm2, str(tmp_path / "ckpt"))
        sd = opt2.state_dict()
    for i, p in enumerate(ref_model.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][k], reference.state[p][k])


@pytest.mark.long  # a bench script at a toy size: the full tier (docs/dev/testing.md)
def test_train_loop_bench_smoke(tmp_path):
    """bench/train_loop.py at a tiny size: the batch is sized automatically, every variant
    runs, each overlapped iteration is paired with a fwd+bwd alone, the swap directory is
    left empty."""
    import json
    import shutil
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "train_loop.json"
    proc = run_python(
        *[str(repo / "bench" / "train_loop.py"), "--dim", "64", "--heads", "2",
         "--layers", "1", "--vocab", "128", "--seq", "16", "--iters", "2", "--rounds", "2",
         "--warmup", "1", "--partition-size", "64KiB", "--buffers", "3", "--prefetch", "1",
         "--batch", "auto", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        cwd=repo, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    # fwd_bwd_io (fwd+bwd beside fio at the overlap's rates) runs where fio is installed.
    fio = shutil.which("fio") is not None
    assert set(result["median_seconds"]) == {"fwd_bwd", "plain", "step_only", "no_overlap",
                                             "overlap", "overlap_host"} | (
        {"fwd_bwd_io"} if fio else set())
    for v in ("overlap", "overlap_host") + (("fwd_bwd_io",) if fio else ()):
        assert all(len(r["alone"]) == len(r["seconds"]) == 2 for r in result["runs"][v])
    if fio:
        assert all(m["read_bytes"] > 0 and m["write_bytes"] > 0
                   for r in result["runs"]["fwd_bwd_io"] for m in r["fio"])
        assert result["io_slowdown"] > 0 and result["ratio_beside_io"] > 0
    assert len(result["ratio_per_round"]) == 2 and result["ratio"] > 0
    # --batch auto: the first batch, doubling from 1, whose fwd+bwd took as long as the step.
    sizing = result["batch_sizing"]
    tried = {int(b): t for b, t in sizing["fwd_bwd_seconds"].items()}
    assert result["batch"] == sizing["batch"] == max(tried)
    assert sorted(tried) == [2**i for i in range(len(tried))]
    assert tried[result["batch"]] >= sizing["step_seconds"] or result["batch"] == 4096
    assert all(tried[b] < sizing["step_seconds"] for b in tried if b < result["batch"])
    # bench/run_all.py's report reads these figures from the JSON.
    sys.path.insert(0, str(repo / "bench"))
    try:
        import run_all
    finally:
        sys.path.remove(str(repo / "bench"))
    rows = run_all.overlap_figures(result)
    assert len(rows) == (5 if fio else 4)
    assert rows[0][-1] == f"{result['ratio']:.3f}" and all(float(r[-1]) > 0 for r in rows)
    assert result["runs"]["overlap"][0]["early"] > 0  # updates did start during backward
    assert listdir(tmp_path / "swap") == []
