"""tiermem.offload gives the same numbers as the plain torch optimizer it wraps.

kernel "match" runs the implementation the wrapped optimizer would run: results are
bitwise equal. kernel "fused" runs torch's fused kernel: bitwise equal to a plain optimizer
created with fused=True, and close to an unfused one. kernel "auto" (the default) runs
tiermem's native kernel on these CPU models: close to both. Partitions are tiny (64 KiB) and the
pipeline has few buffers, so every step streams many partitions through reused buffers: a
missing wait or a stale buffer shows up as a bitwise difference.
"""

from __future__ import annotations

import io
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.kernels.native_adam import torch_tail_width
from tiermem.partition import build_partitions

from offload_helpers import (Synthetic, assert_same_tensor, available_backends,
                             backend_params, compare_runs, compare_state_dicts, config,
                             listdir, lowp_step, make_batches, train, twin)

STEPS = 6

# -- the table --------------------------------------------------------------------------

# placement rows: config keywords, and how param groups are built from the model
PLACEMENTS = {
    "all-host": dict(cfg=dict(host="64MiB")),
    "all-nvme": dict(cfg=dict(host=0, buffer_count=3, prefetch_depth=2)),
    # a host budget of ~1/3 of the state: the first partitions stay resident, the rest stream
    "mixed": dict(cfg=dict(host="256KiB", buffer_count=4, prefetch_depth=2)),
    # minimum pipeline (2 buffers, read 1 ahead), no zig-zag: every buffer is reused
    # right after its write-back was issued
    "tiny-split": dict(cfg=dict(host=0, buffer_count=2, prefetch_depth=1, zigzag=False)),
    "groups": dict(cfg=dict(host="192KiB", buffer_count=3, prefetch_depth=1), groups=True),
    "rules": dict(cfg=dict(host="512KiB", buffer_count=3, prefetch_depth=2,
                           placement=[{"match": "emb.*", "tier": "host"},
                                      {"match": "fc1.weight", "tier": "nvme"},
                                      {"match": "side.*", "tier": "host"}]),
                  named=True),
}

# optimizer rows: (class, kwargs, kernel, reference kwargs, bitwise?)
OPTIMIZERS = {
    "adamw-loop-match": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05, foreach=False),
                         "match", {}, True),
    "adam-default-match": (torch.optim.Adam, dict(lr=1e-2), "match", {}, True),
    "adam-l2-loop-match": (torch.optim.Adam, dict(lr=5e-3, weight_decay=0.1, foreach=False),
                           "match", {}, True),
    "adam-foreach-amsgrad-match": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01,
                                                          amsgrad=True, foreach=True),
                                   "match", {}, True),
    "adamw-fusedflag-maximize-match": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1,
                                                               maximize=True, fused=True),
                                       "match", {}, True),
    "adam-wd0-fused": (torch.optim.Adam, dict(lr=3e-3, weight_decay=0.0), "fused",
                       dict(fused=True), True),
    "adamw-amsgrad-maximize-fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.02,
                                                             amsgrad=True, maximize=True),
                                     "fused", dict(fused=True), True),
    # fused kernel against an unfused reference: close, not bitwise
    "adamw-loop-fused-vs-unfused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01,
                                                            foreach=False),
                                    "fused", {}, False),
    # auto (the default) runs the native kernel on these CPU models: bitwise fused where
    # the native kernel knows torch's scalar tail (kernels.native_adam.torch_tail_width),
    # else within 1e-6
    "adamw-auto-vs-fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01), "auto",
                            dict(fused=True), torch_tail_width() >= 0),
    "adam-amsgrad-maximize-auto-vs-fused": (torch.optim.Adam,
                                            dict(lr=1e-2, weight_decay=0.02, amsgrad=True,
                                                 maximize=True), "auto", dict(fused=True),
                                            torch_tail_width() >= 0),
    "adam-amsgrad-maximize-auto-vs-unfused": (torch.optim.Adam,
                                              dict(lr=1e-2, weight_decay=0.02, amsgrad=True,
                                                   maximize=True), "auto", {}, False),
}


def param_groups(model: Synthetic, groups: bool):
    if not groups:
        return model.parameters()
    return [
        {"params": [model.emb.weight], "lr": 3e-3, "weight_decay": 0.0},
        {"params": [model.fc1.weight, model.fc1.bias], "weight_decay": 0.2,
         "betas": (0.8, 0.95)},
        {"params": [*model.fc2.parameters(), *model.side.parameters()], "lr": 2e-2,
         "eps": 1e-6},
    ]


def run_pair(tmp_path, backend, placement, optimizer, *, steps=STEPS, **train_kw):
    row = PLACEMENTS[placement]
    cls, kw, kernel, ref_kw, exact = OPTIMIZERS[optimizer]
    model, ref_model = twin(Synthetic)
    groups = row.get("groups", False)
    opt = cls(param_groups(model, groups), **kw)
    ref_opt = cls(param_groups(ref_model, groups), **{**kw, **ref_kw})
    batches = make_batches(model, steps, micro=train_kw.pop("micro", 1))
    cfg = config(tmp_path, backend=backend, kernel=kernel, **row["cfg"])
    with tiermem.offload(opt, cfg, model=model if row.get("named") else None) as tm:
        losses = train(model, opt, batches, **train_kw)
        plan = tm.plan()
        stats = tm.stats()
    ref_losses = train(ref_model, ref_opt, batches, **train_kw)
    return model, opt, ref_model, ref_opt, exact, losses, ref_losses, plan, stats


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("backend", backend_params())
def test_parity_table(tmp_path, backend, placement, optimizer):
    model, opt, ref_model, ref_opt, exact, losses, ref_losses, plan, stats = run_pair(
        tmp_path, backend, placement, optimizer)
    # the row really exercises what it says
    tiers = plan["state_bytes"]
    if placement == "all-host":
        assert tiers["nvme"] == 0 and tiers["host"] > 0
    elif placement in ("mixed", "groups", "rules"):
        assert tiers["nvme"] > 0 and tiers["host"] > 0
    else:
        assert tiers["host"] == 0 and tiers["nvme"] > 0
    assert plan["partitions"] >= 12
    assert len(stats) == STEPS
    if exact:
        assert losses == ref_losses
    compare_runs(model, opt, ref_model, ref_opt, exact=exact)
    assert listdir(tmp_path) == []


def test_rules_row_places_by_name(tmp_path):
    """The placement rules of the 'rules' row put each parameter's state where they say."""
    model = Synthetic()
    row = PLACEMENTS["rules"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tiermem.offload(opt, config(tmp_path, **row["cfg"]), model=model) as tm:
        parts = tm.offloaded.parts
        for part in parts:
            names = {n for s in part.segments for n, p in model.named_parameters()
                     if p is s.param}
            if names & {"emb.weight", "side.weight", "side.bias"}:
                assert part.tier == "host", (names, part.tier)
            if "fc1.weight" in names:
                assert part.tier == "nvme", (names, part.tier)
        assert tm.plan()["state_bytes"]["nvme"] > 0


# -- training-loop features ---------------------------------------------------------------


FEATURES = {
    "cosine-before": dict(sched="cosine", when="before"),
    "cosine-inside": dict(sched="cosine", when="inside"),
    "lambda-before": dict(sched="lambda", when="before"),
    "clip": dict(clip=0.05),
    "accumulate": dict(micro=3),
    "closure": dict(closure=True),
    "everything": dict(sched="lambda", when="inside", clip=0.1, micro=2, closure=True),
}


def make_sched(kind, opt):
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-4)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", backend_params())
def test_parity_training_features(tmp_path, backend, feature):
    f = dict(FEATURES[feature])
    sched_kind, when = f.pop("sched", None), f.pop("when", None)
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.05, amsgrad=True)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=2e-2, weight_decay=0.05,
                                amsgrad=True)
    batches = make_batches(model, STEPS, micro=f.pop("micro", 1))
    sched = make_sched(sched_kind, opt) if sched_kind and when == "before" else None
    lrs = []
    with tiermem.offload(opt, config(tmp_path, backend=backend, host="128KiB")):
        if sched_kind and when == "inside":
            sched = make_sched(sched_kind, opt)
        train(model, opt, batches, sched=sched,
              after_step=lambda i: lrs.append(opt.param_groups[0]["lr"]), **f)
    ref_sched = make_sched(sched_kind, ref_opt) if sched_kind else None
    ref_lrs = []
    train(ref_model, ref_opt, batches, sched=ref_sched,
          after_step=lambda i: ref_lrs.append(ref_opt.param_groups[0]["lr"]), **f)
    assert lrs == ref_lrs
    compare_runs(model, opt, ref_model, ref_opt)


def test_lr_edited_between_steps(tmp_path):
    """Writing param_groups[...]['lr'] by hand between steps takes effect at the next step."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    batches = make_batches(model, STEPS)

    def edit(o):
        return lambda i: [g.__setitem__("lr", 1e-2 * (0.5 ** (i + 1))) for g in o.param_groups]

    with tiermem.offload(opt, config(tmp_path, host=0)):
        train(model, opt, batches, after_step=edit(opt))
    train(ref_model, ref_opt, batches, after_step=edit(ref_opt))
    compare_runs(model, opt, ref_model, ref_opt)


# -- property test -----------------------------------------------------------------------


@st.composite
def scenarios(draw):
    n_params = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.integers(1, 5000), min_size=n_params, max_size=n_params))
    n_groups = draw(st.integers(1, min(3, n_params)))
    # group g gets a contiguous, non-empty run of the params
    cuts = sorted(draw(st.sets(st.integers(1, n_params - 1), min_size=n_groups - 1,
                               max_size=n_groups - 1))) if n_groups > 1 else []
    bounds = [0, *cuts, n_params]
    groups = []
    for g in range(n_groups):
        groups.append(dict(
            idx=list(range(bounds[g], bounds[g + 1])),
            lr=draw(st.sampled_from([1e-3, 1e-2, 3e-2])),
            weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
            amsgrad=draw(st.booleans())))
    adamw = draw(st.booleans())
    impl = draw(st.sampled_from(["loop", "foreach", "fused", "default"]))
    maximize = draw(st.booleans())
    partition_size = draw(st.one_of(st.just(64 << 10),
                                    st.integers(16, 256).map(lambda x: x * 4096)))
    prefetch = draw(st.integers(1, 4))
    buffers = draw(st.integers(prefetch + 1, prefetch + 3))
    return dict(sizes=sizes, groups=groups, adamw=adamw, impl=impl, maximize=maximize,
                partition_size=partition_size, prefetch=prefetch, buffers=buffers,
                zigzag=draw(st.booleans()), host_fraction=draw(st.floats(0, 1)),
                steps=draw(st.integers(1, 6)), backend=draw(st.sampled_from(available_backends())),
                grad_seed=draw(st.integers(0, 2**16)),
                drop=draw(st.lists(st.booleans(), min_size=n_params * 6,
                                   max_size=n_params * 6)))


def build_opt(sc, params):
    cls = torch.optim.AdamW if sc["adamw"] else torch.optim.Adam
    flags = {"loop": dict(foreach=False), "foreach": dict(foreach=True),
             "fused": dict(fused=True), "default": {}}[sc["impl"]]
    groups = [{"params": [params[i] for i in g["idx"]], "lr": g["lr"],
               "weight_decay": g["weight_decay"], "amsgrad": g["amsgrad"]}
              for g in sc["groups"]]
    return cls(groups, maximize=sc["maximize"], **flags)


# ~20 ms an example: 40 examples stay around a second
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(sc=scenarios())
def test_property_bitwise_match(tmp_path, sc):
    torch.manual_seed(sc["grad_seed"])
    init = [torch.randn(n) for n in sc["sizes"]]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    ref_params = [torch.nn.Parameter(t.clone()) for t in init]
    opt, ref_opt = build_opt(sc, params), build_opt(sc, ref_params)
    state_bytes = sum(p.record_bytes for p in build_partitions(
        opt.param_groups, {}, sc["partition_size"]))
    host = int(sc["host_fraction"] * state_bytes)
    swap = tempfile.mkdtemp(dir=tmp_path)
    cfg = config(swap, backend=sc["backend"], host=host, partition_size=sc["partition_size"],
                 buffer_count=sc["buffers"], prefetch_depth=sc["prefetch"],
                 zigzag=sc["zigzag"], kernel="match")
    g = torch.Generator().manual_seed(sc["grad_seed"])
    grads = [[None if sc["drop"][s * len(params) + i] and s % 2 else
              torch.randn(n, generator=g) for i, n in enumerate(sc["sizes"])]
             for s in range(sc["steps"])]

    def run(ps, o):
        for step_grads in grads:
            for p, gr in zip(ps, step_grads):
                p.grad = None if gr is None else gr.clone()
            o.step()
            o.zero_grad()

    with tiermem.offload(opt, cfg):
        run(params, opt)
    run(ref_params, ref_opt)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_same_tensor(p.detach(), q.detach(), f"param {i}")
        assert bool(opt.state.get(p)) == bool(ref_opt.state.get(q)), f"param {i} state"
        for k, v in ref_opt.state.get(q, {}).items():
            if k == "step":
                assert float(opt.state[p][k]) == float(v), f"param {i} step"
            else:
                assert_same_tensor(opt.state[p][k], v, f"param {i} {k}")
    assert listdir(swap) == []


# -- low-precision models -----------------------------------------------------------------


LOWP = {
    "fused": ("fused", {}, dict(fused=True)),
    "match-loop": ("match", dict(foreach=False), dict(foreach=False)),
    "match-foreach": ("match", dict(foreach=True), dict(foreach=True)),
}


def lowp_run(tmp_path, backend, dtype, variant, *, steps=5, check_each_step=True):
    kernel, flags, ref_flags = LOWP[variant]
    model = Synthetic().to(dtype)
    ref_params = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    kw = dict(lr=1e-2, weight_decay=0.05, amsgrad=True)
    opt = torch.optim.AdamW(model.parameters(), **kw, **flags)
    ref = torch.optim.AdamW(ref_params, **kw, **ref_flags)
    batches = make_batches(model, steps)
    names = [n for n, _ in model.named_parameters()]
    return model, opt, ref_params, ref, batches, names, config(
        tmp_path, backend=backend, host="192KiB", kernel=kernel)


@pytest.mark.parametrize("variant", list(LOWP))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", backend_params())
def test_low_precision_weights_and_exported_state(tmp_path, backend, dtype, variant):
    """Model weights after every step are the fp32 reference rounded to the model dtype;
    after the block the moments are the reference's in the model dtype."""
    model, opt, ref_params, ref, batches, names, cfg = lowp_run(tmp_path, backend, dtype,
                                                                variant)
    with tiermem.offload(opt, cfg):
        for i, micro in enumerate(batches):
            lowp_step(model, opt, ref_params, ref, micro, i, names)
    for n, p, r in zip(names, model.parameters(), ref_params):
        assert bool(opt.state.get(p)) == bool(ref.state.get(r)), n
        for k, v in ref.state.get(r, {}).items():
            if k == "step":
                assert float(opt.state[p][k]) == float(v)
            else:
                assert_same_tensor(opt.state[p][k], v.to(dtype), f"{n} {k}")
    assert listdir(tmp_path) == []


@pytest.mark.parametrize("variant", ["fused", "match-loop"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_master_in_state_dict(tmp_path, dtype, variant):
    """state_dict() under tiermem carries fp32 master weights and fp32 moments, bitwise the
    fp32 reference's."""
    model, opt, ref_params, ref, batches, names, cfg = lowp_run(tmp_path, "threads", dtype,
                                                                variant)
    with tiermem.offload(opt, cfg):
        for i, micro in enumerate(batches):
            lowp_step(model, opt, ref_params, ref, micro, i, names, check=False)
        sd = opt.state_dict()
    for i, (n, r) in enumerate(zip(names, ref_params)):
        if not ref.state.get(r):
            assert i not in sd["state"]
            continue
        st = sd["state"][i]
        assert_same_tensor(st["master_param"], r.detach(), f"{n} master_param")
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_same_tensor(st[k], ref.state[r][k], f"{n} {k}")
        assert float(st["step"]) == float(ref.state[r]["step"])


# -- checkpoints ---------------------------------------------------------------------------


def roundtrip(sd):
    """What torch.save + torch.load makes of a state_dict (a checkpoint on disk)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def clone_model(src: Synthetic) -> Synthetic:
    m = Synthetic(seed=123)
    m.load_state_dict(src.state_dict())
    return m


OPT_KW = dict(lr=1e-2, weight_decay=0.05, amsgrad=True)


@pytest.mark.parametrize("backend", backend_params())
def test_state_dict_under_tiermem_equals_plain(tmp_path, backend):
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    batches = make_batches(model, 3)
    with tiermem.offload(opt, config(tmp_path, backend=backend, host="128KiB")):
        train(model, opt, batches)
        sd = opt.state_dict()
    train(ref_model, ref_opt, batches)
    compare_state_dicts(sd, ref_opt.state_dict())
    # and the plain torch state_dict after the block is the same too
    compare_state_dicts(opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("backend", backend_params())
def test_checkpoint_tiermem_to_plain(tmp_path, backend):
    """A checkpoint written under tiermem, loaded into a plain AdamW, continues exactly like
    uninterrupted plain training."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    batches = make_batches(model, 6)
    with tiermem.offload(opt, config(tmp_path, backend=backend, host=0)):
        train(model, opt, batches[:3])
        ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
        train(model, opt, batches[3:4], start=3)  # training goes on after the checkpoint
    resumed = Synthetic(seed=99)
    resumed.load_state_dict(ckpt["model"])
    plain = torch.optim.AdamW(resumed.parameters(), **OPT_KW)
    plain.load_state_dict(ckpt["opt"])
    train(resumed, plain, batches[3:], start=3)
    train(ref_model, ref_opt, batches)
    compare_runs(resumed, plain, ref_model, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_checkpoint_plain_to_tiermem(tmp_path, backend):
    """A plain torch checkpoint loaded under tiermem continues exactly like uninterrupted
    plain training."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    batches = make_batches(model, 6)
    train(model, opt, batches[:3])
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed = Synthetic(seed=99)
    resumed.load_state_dict(ckpt["model"])
    # lr and weight_decay come from the checkpoint (amsgrad decides the record layout, so it
    # is set when the optimizer is made)
    new_opt = torch.optim.AdamW(resumed.parameters(), lr=0.5, weight_decay=0.0, amsgrad=True)
    with tiermem.offload(new_opt, config(tmp_path, backend=backend, host="128KiB")):
        new_opt.load_state_dict(ckpt["opt"])
        assert new_opt.param_groups[0]["lr"] == OPT_KW["lr"]
        assert new_opt.param_groups[0]["weight_decay"] == OPT_KW["weight_decay"]
        train(resumed, new_opt, batches[3:], start=3)
    train(ref_model, ref_opt, batches)
    compare_runs(resumed, new_opt, ref_model, ref_opt)


def test_load_state_dict_mid_training_under_tiermem(tmp_path):
    """load_state_dict inside the block, after steps that filled the buffers, replaces all
    state (including partitions whose records are in the pipeline's buffers)."""
    model, ref_model = twin(Synthetic)
    batches = make_batches(model, 6)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    train(ref_model, ref_opt, batches[:3])
    ckpt = roundtrip({"model": ref_model.state_dict(), "opt": ref_opt.state_dict()})
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    with tiermem.offload(opt, config(tmp_path, host=0, buffer_count=4, prefetch_depth=2)):
        train(model, opt, make_batches(model, 2, seed=7))  # different history, then replaced
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train(model, opt, batches[3:], start=3)
    train(ref_model, ref_opt, batches[3:], start=3)
    compare_runs(model, opt, ref_model, ref_opt)


def test_low_precision_checkpoint_roundtrip_keeps_master(tmp_path):
    """A bf16 model's checkpoint under tiermem keeps the fp32 master weights: loading it
    (under tiermem) continues exactly like uninterrupted tiermem training."""
    dtype = torch.bfloat16
    model = Synthetic().to(dtype)
    twin_model = Synthetic().to(dtype)
    batches = make_batches(model, 5)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    with tiermem.offload(opt, config(tmp_path, host=0, kernel="fused"), name="a"):
        train(model, opt, batches)
    opt2 = torch.optim.AdamW(twin_model.parameters(), **OPT_KW)
    with tiermem.offload(opt2, config(tmp_path, host=0, kernel="fused"), name="b"):
        train(twin_model, opt2, batches[:2])
        ckpt = roundtrip({"model": twin_model.state_dict(), "opt": opt2.state_dict()})
    resumed = Synthetic().to(dtype)
    resumed.load_state_dict(ckpt["model"])
    opt3 = torch.optim.AdamW(resumed.parameters(), **OPT_KW)
    with tiermem.offload(opt3, config(tmp_path, host=0, kernel="fused"), name="c"):
        opt3.load_state_dict(ckpt["opt"])
        train(resumed, opt3, batches[2:], start=2)
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert_same_tensor(q.detach(), p.detach(), n)


@pytest.mark.parametrize("backend", backend_params())
def test_reentering_and_continuing_outside(tmp_path, backend):
    """Two offload blocks in a row (the second imports opt.state), then plain steps after
    the block: the same as uninterrupted plain training."""
    model, ref_model = twin(Synthetic)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPT_KW)
    batches = make_batches(model, 7)
    with tiermem.offload(opt, config(tmp_path, backend=backend, host=0)):
        train(model, opt, batches[:3])
    with tiermem.offload(opt, config(tmp_path, backend=backend, host="128KiB")):
        train(model, opt, batches[3:5], start=3)
    train(model, opt, batches[5:], start=5)
    train(ref_model, ref_opt, batches)
    compare_runs(model, opt, ref_model, ref_opt)
    assert "step" not in opt.__dict__ and not hasattr(opt, "_tiermem")
