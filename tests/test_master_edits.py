"""A change made to the model's weights between steps counts where the step starts from a
master: low-precision models (fp32 master in the record) and device models updated on the
host (step_device cpu), as it does for the plain optimizer, which steps the weights it is
given.

The reference is torch's fused AdamW: on an fp32 twin with the same edits (a device model
updated on the host: bitwise torch's), or on fp32 master copies whose elements take the
edited weights' elements that are not what the master rounds to (a low-precision model:
tiermem.kernels.edits.take_edits, the rule its docs state; its native pass is held to
the same rule in torch ops by a property test). Edits cover in-place ops
through the parameter, a copy into a view, model.load_state_dict(), a mask, and a write of
the same values, which must leave the masters as they were (no precision lost)."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.device.lanes import DeferredBackend
from tiermem.kernels.edits import keep_kahan_terms, take_edits
from tiermem.optim.edits import moved, weights_mark

from offload_helpers import (Synthetic, assert_same_tensor, backend_params, config,
                             compare_runs, loss_of, make_batches, side_used, train, twin)

STEPS = 5
EDIT_AT = (1, 3)  # after these steps


def _clamp(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.fc1.weight.clamp_(-0.02, 0.02)


def _mask(model: torch.nn.Module) -> None:
    with torch.no_grad():
        w = model.fc2.weight  # (a parameter cut over several partitions)
        w.mul_((torch.arange(w.numel()).reshape(w.shape) % 3 != 0).to(w.dtype))


def _copy_into_view(model: torch.nn.Module) -> None:
    w = model.emb.weight.detach()
    gen = torch.Generator().manual_seed(7)
    w[5:9].copy_(torch.randn(w[5:9].shape, generator=gen))


def _load(model: torch.nn.Module) -> None:
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["fc1.bias"] = sd["fc1.bias"] * 0.5
    sd["side.weight"] = -sd["side.weight"]  # (a parameter without a gradient some steps)
    model.load_state_dict(sd)


def _same(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.detach().copy_(p.detach().clone())


def _assign(model: torch.nn.Module) -> None:
    w = model.fc2.weight  # new weights, as an init assigns them (no version counter moves)
    w.data = (w.detach().float() * 0.5 + 0.01).to(w.dtype)


def _through_data(model: torch.nn.Module) -> None:
    model.fc1.weight.data.clamp_(-0.02, 0.02)  # (p.data's version counter is its own)


EDITS = {"clamp": _clamp, "mask": _mask, "view": _copy_into_view, "load": _load,
         "same": _same, "assign": _assign, "data": _through_data}


def _cfg(tmp_path, backend, **kw):
    cfg = config(tmp_path, backend=backend, host="192KiB",
                 kernel=kw.pop("kernel", "match"))
    for section, values in kw.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _lowp_reference(dtype, edit, steps):
    """fp32 masters under fused AdamW with the spec's edit rule; returns the masters."""
    shadow = Synthetic().to(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in shadow.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.05, fused=True)
    with torch.no_grad():
        for q, m in zip(shadow.parameters(), masters):
            q.copy_(m)
    for i, micro in enumerate(make_batches(shadow, steps)):
        tokens, target = micro[0]
        loss_of(shadow, tokens, target, side_used(i)).backward()
        stepped = [(q, m) for q, m in zip(shadow.parameters(), masters) if q.grad is not None]
        with torch.no_grad():
            for q, m in stepped:  # the rule, at the parameter's next step
                w = q.detach()
                m.copy_(torch.where(w != m.to(dtype), w.float(), m))
                m.grad = q.grad.float()
        ref.step()
        ref.zero_grad()
        shadow.zero_grad()
        with torch.no_grad():
            for q, m in stepped:
                q.copy_(m)
        if i in EDIT_AT and edit is not None:
            EDITS[edit](shadow)
    return masters


def _lowp_run(tmp_path, backend, dtype, edit, *, streams=None, steps=STEPS, **cfg_kw):
    model = Synthetic().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    batches = make_batches(model, steps)

    def after(i):
        if i in EDIT_AT and edit is not None:
            EDITS[edit](model)

    with tiermem.offload(opt, _cfg(tmp_path, backend, **cfg_kw), model=model,
                         streams=streams) as tm:
        train(model, opt, batches, after_step=after)
        taken = tm.offloaded.edits_taken
        masters = [opt.state_dict()["state"][i]["master_param"].clone()
                   for i in range(len(list(model.parameters())))]
    return model, masters, taken


LOWP = {  # where a low-precision model's update runs
    "host-native": dict(kernel="native"),
    "host-torch": dict(kernel="fused"),
    "lanes-host": dict(streams=True, kernel="fused", optimizer={"step_device": "cpu"}),
    "lanes-device": dict(streams=True, kernel="fused", optimizer={"step_device": "device"}),
    "overlap": dict(kernel="fused", pipeline={"overlap_backward": True}),
    # the weights in the parameter tier, which sees changes made through p.data too
    "params": dict(kernel="fused", parameters={"offload": "nvme", "window": "512KiB"}),
}
SEEN = {where: [e for e in EDITS if e != "data" or where == "params"] for where in LOWP}


@pytest.mark.parametrize("dtype, where, edit", [
    (dtype, w, e) for w in LOWP for e in SEEN[w]
    for dtype in ([torch.bfloat16, torch.float16] if e in ("clamp", "same", "assign")
                  else [torch.bfloat16])],  # (fp16 rounds by the same rule: a few of them)
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_low_precision_edit_is_taken(tmp_path, dtype, where, edit):
    """The weights after every later step are the reference masters rounded, and the
    masters are the reference's: the edit counted, elements not edited kept their fp32
    masters. A write of the same values takes nothing."""
    kw = dict(LOWP[where])
    streams = DeferredBackend() if kw.pop("streams", False) else None
    model, masters, taken = _lowp_run(tmp_path, "threads", dtype, edit, streams=streams, **kw)
    ref = _lowp_reference(dtype, edit, STEPS)
    names = [n for n, _ in model.named_parameters()]
    for n, p, m, r in zip(names, model.parameters(), masters, ref):
        assert_same_tensor(m, r.detach(), f"{n} master")
        assert_same_tensor(p.detach(), r.detach().to(dtype), f"{n} weight")
    assert taken > 0  # ("same" too: an in-place write, which the rule finds unchanged)


@pytest.mark.parametrize("where", list(LOWP))
def test_no_edit_takes_nothing(tmp_path, where):
    """Without an edit no parameter is taken for edited: tiermem's own writes of the
    weights (on the emulated streams too, whose copies run later) are not edits."""
    kw = dict(LOWP[where])
    streams = DeferredBackend() if kw.pop("streams", False) else None
    _, _, taken = _lowp_run(tmp_path, "threads", torch.bfloat16, None, streams=streams, **kw)
    assert taken == 0


@pytest.mark.parametrize("edit", ["clamp", "mask", "load", "assign"])
@pytest.mark.parametrize("backend", backend_params())
def test_device_model_updated_on_host_keeps_edits(tmp_path, backend, edit):
    """An fp32 device model (emulated lanes) updated on the host: bitwise torch's fused
    AdamW on an fp32 twin given the same edits."""
    model, ref_model = twin(Synthetic)
    kw = dict(lr=1e-2, weight_decay=0.05)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
    batches = make_batches(model, STEPS)
    cfg = _cfg(tmp_path, backend, kernel="fused", optimizer={"step_device": "cpu"})
    with tiermem.offload(opt, cfg, streams=DeferredBackend()) as tm:
        train(model, opt, batches,
              after_step=lambda i: EDITS[edit](model) if i in EDIT_AT else None)
        assert tm.offloaded.edits_taken > 0
    train(ref_model, ref, batches,
          after_step=lambda i: EDITS[edit](ref_model) if i in EDIT_AT else None)
    compare_runs(model, opt, ref_model, ref)


@pytest.mark.parametrize("backend", backend_params())
def test_edit_of_a_parameter_without_a_step_survives_a_resume(tmp_path, backend):
    """crash_consistent, a bf16 model: `side` takes no step in some steps; its weights
    edited then are committed with that step (its master takes them), so a resume from
    that commit starts from them. side.weight is cut over several partitions: each piece
    takes them."""
    model = Synthetic(out=300).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = make_batches(model, 4)
    cfg = _cfg(tmp_path, backend)
    cfg["swap"]["durability"] = "crash_consistent"
    odd = next(i for i in range(1, 4) if not side_used(i))
    with tiermem.offload(opt, cfg, model=model) as tm:
        train(model, opt, batches[:odd])
        with torch.no_grad():
            model.side.weight.mul_(-1)  # before a step `side` takes no part in
        train(model, opt, batches[odd: odd + 1], start=odd)
        edited = model.side.weight.detach().clone()
        tm.offloaded.keep_on_disk()  # what a crash leaves: the committed records
        tm.discard()
    assert len({part.id for part in tm.offloaded.parts for sg in part.segments
                if sg.param is model.side.weight}) > 1
    fresh = Synthetic(out=300).to(torch.bfloat16)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with tiermem.offload(opt2, cfg, model=fresh, resume=True):
        assert_same_tensor(fresh.side.weight.detach(), edited, "side.weight resumed")


SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-8, 65504.0,
           65519.0, 65520.0, 7e4, 1.0, -2.5]


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       n=st.integers(0, 2100), seed=st.integers(0, 2**31 - 1),
       special=st.floats(0, 0.3), edited=st.floats(0, 1), threads=st.sampled_from([1, 2]))
def test_take_edits_native_is_the_rule(dtype, n, seed, special, edited, threads):
    """The native pass (a vector body and a scalar tail, on one or two threads) gives the
    rule written in torch ops, bit for bit but for NaN payloads: special values (NaNs,
    signed zeros, infinities, subnormals, fp16's overflow edge) on either side, weights
    rounded from the masters, then some edited."""
    rng = np.random.default_rng(seed)
    master = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 4)
    pick = torch.from_numpy(rng.random(n) < special)
    master[pick] = torch.tensor(rng.choice(SPECIAL, int(pick.sum())), dtype=torch.float32)
    weights = master.to(dtype)
    change = torch.from_numpy(rng.random(n) < edited)
    weights[change] = torch.tensor(rng.choice(SPECIAL + [0.5, -7.0], int(change.sum())),
                                   dtype=torch.float32).to(dtype)
    want = master.clone()
    differs = weights != want.to(dtype)
    want.copy_(torch.where(differs, weights.float(), want))
    got = master.clone()
    assert take_edits(got, weights, threads=threads) == int(differs.sum())
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(got[keep].view(torch.int32), want[keep].view(torch.int32))


# -- found by review: loads, failures, shared buffers, state methods, resumes, Kahan terms --


def _masters(opt, model):
    sd = opt.state_dict()["state"]
    return [sd[i]["master_param"].clone() for i in range(len(list(model.parameters())))]


@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
def test_a_load_supersedes_an_edit_made_before_it(tmp_path, durability):
    """An edit, then opt.load_state_dict() and model.load_state_dict() of a checkpoint:
    the masters are the checkpoint's. The load's commit (crash_consistent) took the edit
    made before it into the masters it had just loaded."""
    model = Synthetic().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = _cfg(tmp_path, "threads", kernel="fused")
    cfg["swap"]["durability"] = durability
    with tiermem.offload(opt, cfg, model=model):
        train(model, opt, make_batches(model, 2))
        osd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        train(model, opt, make_batches(model, 2, seed=3), start=2)
        _clamp(model)
        opt.load_state_dict(osd)
        model.load_state_dict(msd)
        for i, m in enumerate(_masters(opt, model)):
            assert_same_tensor(m, osd["state"][i]["master_param"], f"master {i}")


def test_a_step_failing_part_way_leaves_the_rest_of_an_edit_for_the_next(tmp_path, monkeypatch):
    """scratch: a mask, then a step that fails at the second of fc2.weight's pieces; the
    retry's pieces the failed step had not reached take the mask too (lr 0: the masters
    are the masked weights). The failed step's first piece marked the whole parameter
    taken."""
    model = Synthetic().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    batches = make_batches(model, 3)
    original = tiermem.optim.offloaded.OffloadedOptimizer._update
    seen = []

    def failing(self, part, views, stats):
        if any(s.param is model.fc2.weight for s in part.segments):
            seen.append(part.id)
            if len(seen) == 2:
                raise RuntimeError("injected")
        return original(self, part, views, stats)

    with tiermem.offload(opt, _cfg(tmp_path, "threads", kernel="fused"), model=model) as tm:
        assert len({p.id for p in tm.offloaded.parts for s in p.segments
                    if s.param is model.fc2.weight}) > 2
        train(model, opt, batches[:1])
        _mask(model)
        masked = model.fc2.weight.detach().clone()
        tokens, target = batches[1][0]
        loss_of(model, tokens, target, side_used(1)).backward()
        with monkeypatch.context() as m:
            m.setattr(tiermem.optim.offloaded.OffloadedOptimizer, "_update", failing)
            with pytest.raises(RuntimeError, match="injected"):
                opt.step()
        opt.zero_grad()
        loss_of(model, tokens, target, side_used(1)).backward()
        opt.step()
        fc2 = [n for n, _ in model.named_parameters()].index("fc2.weight")
        # (as values: lr 0's update adds +0 to a masked -0)
        assert torch.equal(_masters(opt, model)[fc2], masked.float())


def test_a_mark_tells_new_weights_at_a_freed_address():
    """New weights assigned to p.data at the address of storage freed since the mark was
    kept (no version counter moved) are an edit: the mark holds the storage weakly."""
    p = torch.nn.Parameter(torch.zeros(8))
    mark = weights_mark(p)
    assert not moved(mark, p)
    other = torch.zeros(8)
    stale = (p._version, p.data_ptr(), weakref.ref(other.untyped_storage()))
    del other  # a storage that lived at that address, gone
    assert moved(stale, p)
    p.data = torch.ones(8)
    assert moved(mark, p)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_tensor_without_storage_has_a_mark_of_its_version_only():
    """A parameter without a storage of its own (a sparse one, frozen in a group) is
    marked by its version counter: taking its address raised at set-up."""
    p = torch.nn.Parameter(torch.sparse_coo_tensor(torch.tensor([[0, 2]]),
                                                   torch.tensor([1.0, 2.0]), (4,)),
                           requires_grad=False)
    mark = weights_mark(p)
    assert not moved(mark, p)
    with torch.no_grad():
        p.mul_(2)
    assert moved(mark, p)


class _Views(torch.nn.Module):
    """Parameters that are views of one buffer: one version counter for all of them."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        buf = (torch.randn(4 * 3000, generator=g) * 0.1).to(torch.bfloat16)
        self.ws = torch.nn.ParameterList(
            [torch.nn.Parameter(buf[i * 3000:(i + 1) * 3000].view(60, 50)) for i in range(4)])

    def forward(self, x):
        for w in self.ws:
            x = torch.tanh(x @ w.t() @ w)
        return x


@pytest.mark.parametrize("kernel", ["fused", "native"])
def test_views_of_one_buffer_are_not_taken_for_edited(tmp_path, kernel):
    """An update of one moves the version counter of all: none is an edit (each step
    took them all, a pass over every weight, a D2H copy of each on a GPU)."""
    model = _Views()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with tiermem.offload(opt, _cfg(tmp_path, "threads", kernel=kernel), model=model) as tm:
        for _ in range(4):
            model(torch.randn(8, 50, generator=g).to(torch.bfloat16)).float().square().mean() \
                .backward()
            opt.step()
            opt.zero_grad()
        assert tm.offloaded.edits_taken == 0


@pytest.mark.parametrize("what", ["resume", "state-methods"])
def test_the_parameter_tier_takes_no_edit_of_its_own(tmp_path, what):
    """With parameters.offload, the tier's own writes of the weights (a resume's restore,
    schedule-free's train()/eval() through the records) are no edits."""
    cls = torch.optim.AdamW
    if what == "state-methods":
        schedulefree = pytest.importorskip("schedulefree")
        cls = schedulefree.AdamWScheduleFree
    cfg = _cfg(tmp_path, "threads", kernel="auto",
               parameters={"offload": "nvme", "window": "4MiB"})
    cfg["swap"]["durability"] = "crash_consistent" if what == "resume" else "scratch"
    batches = make_batches(Synthetic(), 4)
    model = Synthetic().to(torch.bfloat16)
    opt = cls(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg, model=model) as tm:
        if what == "state-methods":
            opt.train()
            train(model, opt, batches[:2], after_step=lambda i: (opt.eval(), opt.train()))
            assert tm.offloaded.edits_taken == 0
            return
        train(model, opt, batches[:2])
        tm.offloaded.keep_on_disk()
        tm.discard()
    model = Synthetic().to(torch.bfloat16)
    opt = cls(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        train(model, opt, batches[2:], start=2)
        assert tm.offloaded.edits_taken == 0


@pytest.mark.parametrize("master_weights", ["kahan", "none"])
def test_an_edit_without_a_step_survives_a_resume_without_masters(tmp_path, master_weights):
    """master_weights kahan/none keep a copy of the weights in the records
    (crash_consistent): the commit after an edit of a parameter that took no step takes
    it there, so a resume has it."""
    model = Synthetic().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = _cfg(tmp_path, "threads", kernel="auto", optimizer={"master_weights": master_weights})
    cfg["swap"]["durability"] = "crash_consistent"
    batches = make_batches(model, 4)
    odd = next(i for i in range(1, 4) if not side_used(i))
    with tiermem.offload(opt, cfg, model=model) as tm:
        train(model, opt, batches[:odd])
        with torch.no_grad():
            model.side.weight.mul_(-1)
        train(model, opt, batches[odd: odd + 1], start=odd)
        edited = model.side.weight.detach().clone()
        tm.offloaded.keep_on_disk()
        tm.discard()
    fresh = Synthetic().to(torch.bfloat16)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with tiermem.offload(opt2, cfg, model=fresh, resume=True):
        assert_same_tensor(fresh.side.weight.detach(), edited, "side.weight resumed")


def test_kahan_terms_that_no_longer_fit_an_edited_weight_are_dropped(tmp_path):
    """master_weights kahan: opt.load_state_dict() computes each Kahan term against the
    weights of the moment; model.load_state_dict() after it moves the weights, and the
    terms (0.04 off) no longer fit them: dropped, a step with lr 0 leaves the loaded
    weights as they are (they were 0.04 off). Terms that fit are kept: a write of the
    same weights changes no weight, a step with lr 0 neither."""
    model = Synthetic().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    batches = make_batches(model, 6)
    cfg = _cfg(tmp_path, "threads", kernel="auto", optimizer={"master_weights": "kahan"})
    with tiermem.offload(opt, cfg, model=model):
        train(model, opt, batches[:2])
        osd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        train(model, opt, batches[2:4], start=2)
        opt.load_state_dict(osd)
        model.load_state_dict(msd)
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        train(model, opt, batches[4:5], start=4)
        for n, p in model.named_parameters():
            assert_same_tensor(p.detach(), msd[n], n)
        _same(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train(model, opt, batches[5:6], start=5)
        for n, p in model.named_parameters():
            assert_same_tensor(p.detach(), before[n], n)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), n=st.integers(1, 500),
       seed=st.integers(0, 2**31 - 1))
def test_kahan_terms_a_step_writes_are_kept_but_at_ties(dtype, n, seed):
    """keep_kahan_terms keeps the terms of weights rounded from fp32 values (what a step
    writes: near ties and at powers of two included) but the exact ties (a term of half a
    spacing beside an odd weight, which the weight plus it rounds away from), and drops
    those of weights moved off (a mask to 0)."""
    from tiermem.kernels.lowbit import kahan_term
    rng = np.random.default_rng(seed)
    p = torch.from_numpy((rng.standard_normal(n) * 4).astype(np.float32))
    near = torch.from_numpy(rng.random(n) < 0.3)
    p[near] = p[near].to(dtype).float() * (1 + 2.0 ** -9)  # near ties and powers of two
    w = p.to(dtype)
    comp = kahan_term(p, w)
    kept = comp.clone()
    keep_kahan_terms(kept, w)
    dropped = kept != comp
    up = torch.nextafter(w, torch.full_like(w, float("inf"))).float() - w.float()
    down = w.float() - torch.nextafter(w, torch.full_like(w, float("-inf"))).float()
    half = torch.where(comp > 0, up, down) / 2
    assert torch.equal(dropped, dropped & (comp.float().abs() == half))  # ties only
    assert (kept[dropped] == 0).all()
    masked = w.clone()
    masked[::2] = 0
    keep_kahan_terms(kept, masked)
    assert (kept[::2] == 0).all()
