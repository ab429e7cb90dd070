"""torch.amp.GradScaler (fp16 mixed precision) through a tiered optimizer, and a step
retried on the gradients a failed one already applied.

GradScaler hands an optimizer that declares `_step_supports_amp_scaling` (torch's fused
Adam, AdamW, SGD, Adagrad) its scale and inf flag instead of unscaling the gradients
itself (tiermem/optim/amp.py). The reference is the same plain fused optimizer under the
same GradScaler, fed the same batches: equal bitwise, skipped steps included, with every
kernel tiermem may run. Where tiermem cannot honour the hand-over (overlap_backward,
parameters.offload) the step is refused, skipped steps too, at step() itself.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from tiermem.errors import WeightsLost
from tiermem.dist import dcp
from tiermem.swap import recover as rec
from faults import inject
from offload_helpers import (Synthetic, backend_params, compare_runs, config, loss_of,
                             make_batches, swap_dir)
from test_optimizer_rules import state_equal
from test_recover_gaps import crash_cfg, kept, main_params, side_group, small

STEPS = 6

# (name, optimizer factory, kernels tiermem may run for it)
FUSED = [
    ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), ("match", "native")),
    ("adamw_amsgrad", lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
     ("match", "native")),
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True,
                                       fused=True), ("match",)),
    ("adagrad", lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True), ("match",)),
]
CASES = [pytest.param(name, make, kernel, id=f"{name}-{kernel}")
         for name, make, kernels in FUSED for kernel in kernels]


def _scaled_run(model, opt, batches, *, infs, unscale, init_scale):
    """fp16-style steps through a GradScaler (on the CPU); the losses of steps in `infs`
    are made inf, so GradScaler skips them. unscale: the user unscales first (to clip)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    for i, micro in enumerate(batches):
        tokens, target = micro[0]
        loss = loss_of(model, tokens, target, True)  # every parameter gets a gradient
        if i in infs:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler.get_scale()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name, make, kernel", CASES)
@pytest.mark.parametrize("infs, unscale", [((0, 3), False), ((2,), True)],
                         ids=["skips-first", "unscaled-by-user"])
def test_a_fused_optimizer_under_gradscaler_equals_the_plain_one(tmp_path, backend, name,
                                                                  make, kernel, infs, unscale):
    """The scale comes in: gradients divided by it (1000 is no power of two, so a product
    with its reciprocal would differ), steps with inf/NaN gradients skipped, state and
    weights bitwise the plain fused optimizer's, placements mixed (host and NVMe)."""
    if name == "sgd" and 0 in infs:
        # torch's fused SGD skipping its first step keeps a momentum buffer from
        # torch.empty_like: the reference itself would run on uninitialised memory
        infs = tuple(i + 1 for i in infs)
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    batches = make_batches(model, STEPS)
    ref_scale = _scaled_run(ref, ref_opt, batches, infs=infs, unscale=unscale,
                            init_scale=1000.0)
    cfg = config(tmp_path, backend=backend, host="96KiB", kernel=kernel)
    with tiermem.offload(opt, cfg, model=model):
        scale = _scaled_run(model, opt, batches, infs=infs, unscale=unscale,
                            init_scale=1000.0)
        assert opt._step_supports_amp_scaling is True  # the fused optimizer's own
    assert scale == ref_scale
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("setting", ["overlap", "params", "overlap+params"])
@pytest.mark.parametrize("first_inf", [False, True])
def test_gradscaler_where_tiermem_cannot_honour_it_is_refused_at_step(
        tmp_path, backend, fused, setting, first_inf):
    """With overlap_backward the updates ran before GradScaler could unscale or skip; with
    parameters.offload GradScaler cannot see the gradients. Either way step() itself says
    so, a step GradScaler skips too (tiermem claims the hand-over for the optimizer), and
    leaving the block afterwards raises nothing else (no gradient reported lost)."""
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    cfg = config(tmp_path, backend=backend)
    cfg["pipeline"]["overlap_backward"] = "overlap" in setting
    if "params" in setting:
        cfg["parameters"] = {"offload": "nvme"}
    (tokens, target), = make_batches(model, 1)[0]
    with pytest.raises(tiermem.TierMemError, match="GradScaler") as info:
        with tiermem.offload(opt, cfg, model=model):
            assert opt._step_supports_amp_scaling is True
            scaler = torch.amp.GradScaler("cpu")
            loss = loss_of(model, tokens, target, True)
            scaler.scale(loss * float("inf") if first_inf else loss).backward()
            scaler.step(opt)
    assert "GradScaler" in str(info.value) and "cannot honour" in str(info.value)
    assert not isinstance(info.value, WeightsLost)
    # the hand-over was claimed for the block only
    assert ("_step_supports_amp_scaling" in opt.__dict__) == fused


def test_an_optimizer_with_its_own_step_that_takes_the_hand_over_is_refused(tmp_path):
    """The generic path with an optimizer that sets _step_supports_amp_scaling (its own
    step unscales and skips): tiermem honoured the hand-over, then each partition's copy of
    the optimizer, given the same grad_scale, unscaled again (wrong from the first change
    of scale on). Refused at step(), before anything moves, naming the flag to clear; with
    it cleared GradScaler unscales and skips itself and the run equals the plain one."""
    from dist_generic import ScaledSGD

    model = Synthetic()
    ref = copy.deepcopy(model)
    opt = ScaledSGD(model.parameters(), lr=1e-2, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    (tokens, target), = make_batches(model, 1)[0]
    with pytest.raises(tiermem.TierMemError, match="_step_supports_amp_scaling = False"):
        with tiermem.offload(opt, config(tmp_path / "a", backend="threads"), model=model):
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(loss_of(model, tokens, target, True)).backward()
            scaler.step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    model.zero_grad()
    opt = ScaledSGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = ScaledSGD(ref.parameters(), lr=1e-2, momentum=0.9)
    opt._step_supports_amp_scaling = ref_opt._step_supports_amp_scaling = False
    batches = make_batches(model, STEPS)
    with tiermem.offload(opt, config(tmp_path / "b", backend="threads"), model=model):
        scale = _scaled_run(model, opt, batches, infs=(0, 3), unscale=False,
                            init_scale=1000.0)
    assert scale == _scaled_run(ref, ref_opt, batches, infs=(0, 3), unscale=False,
                                init_scale=1000.0) < 1000.0
    compare_runs(model, opt, ref, ref_opt, exact=True)


@pytest.mark.parametrize("backend", backend_params())
def test_a_failed_step_during_backward_leaves_no_gradient_reported_lost(tmp_path, backend):
    """overlap_backward + parameters.offload: a step that fails after backward's updates
    took gradients that were never written to a record (they are kept in memory) must not
    make the block's end look for them on disk and report them lost."""
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = config(tmp_path, backend=backend)
    cfg["pipeline"]["overlap_backward"] = True
    cfg["parameters"] = {"offload": "nvme"}
    (tokens, target), = make_batches(model, 1)[0]

    def refuse(*_):
        raise KeyError("a pre-hook refusing the step")

    with pytest.raises(KeyError):
        with tiermem.offload(opt, cfg, model=model):
            opt.register_step_pre_hook(refuse)
            loss_of(model, tokens, target, True).backward()
            opt.step()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("how", ["io-fault", "overlap-refusal"])
def test_a_step_on_the_gradients_a_failed_step_applied_is_refused(tmp_path, backend, how):
    """scratch: a step that failed part-way leaves the parameters before the failure
    updated (documented). step() again on the same gradients would update them twice:
    refused, naming why; with new gradients the run goes on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {"swap": {"paths": [str(tmp_path / "swap")]},  # as tests/test_faults.py's
           "io": {"backend": backend, "retries": 1},
           "tiers": {"host": {"capacity": 0}},
           "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 1,
                        "overlap_backward": how == "overlap-refusal"}}
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    with tiermem.offload(opt, cfg) as tm:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        model(x).square().mean().backward()
        if how == "io-fault":
            inject(tm, "read", 3, times=2)  # both attempts of the 4th read fail
            with pytest.raises(tiermem.TierMemIOError):
                opt.step()
        else:  # an edit after backward's updates began: the step is refused part-way
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            with pytest.raises(tiermem.TierMemError, match="changed between backward"):
                opt.step()
            tm.offloaded.wait_idle()
        with pytest.raises(tiermem.TierMemError, match="update them twice"):
            opt.step()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()  # new gradients: no refusal


@pytest.mark.parametrize("backend", backend_params())
def test_a_skipped_step_makes_adagrads_state_for_an_added_group(tmp_path, backend):
    """torch's fused Adagrad makes the state of every parameter with a gradient before it
    skips an inf step: a group added inside the block whose first gradients are skipped
    holds state afterwards (state_dict()), as the plain optimizer's does. (Found by
    test_scenarios' random draw.)"""
    model = Synthetic()
    ref = copy.deepcopy(model)
    side = lambda m: [m.side.weight, m.side.bias]  # noqa: E731

    def make(m):
        return torch.optim.Adagrad([p for p in m.parameters()
                                    if all(p is not q for q in side(m))], lr=1e-2, fused=True)

    opt, ref_opt = make(model), make(ref)
    batch = make_batches(model, 1)[0][0]
    sds = []
    with tiermem.offload(opt, config(tmp_path, backend=backend)):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.add_param_group({"params": side(m), "lr": 2e-3})
            scaler = torch.amp.GradScaler("cpu", init_scale=1000.0)
            loss = loss_of(m, *batch, True)
            scaler.scale(loss * float("inf")).backward()
            scaler.step(o)  # skipped: every gradient is inf
            scaler.update()
            sds.append(o.state_dict())
    got, want = sds
    assert set(got["state"]) == set(want["state"]) == set(range(7))
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)


# (name, fused optimizer whose skipped step makes state, as torch's does in _init_group)
SKIP_MAKES_STATE = [
    ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)),
    ("adamw_amsgrad", lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True)),
]


def _skipped_step(model, opt, batch, scaler):
    """One step GradScaler skips (the loss made inf); the side branch gets no gradients."""
    scaler.scale(loss_of(model, *batch, False) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name, make", SKIP_MAKES_STATE, ids=[n for n, _ in SKIP_MAKES_STATE])
def test_a_skipped_first_step_keeps_the_state_torchs_fused_step_made(tmp_path, monkeypatch,
                                                                       backend, name, make):
    """torch's fused Adam makes the state of every parameter with a gradient (step 0, zero
    moments) before it skips a step GradScaler found inf in; the side branch, without
    gradients, has none. tiermem's state_dict inside the block, opt.state's truth, recover
    of the crash-consistent manifest, a resume from it, a state_dict loaded into another
    tiered optimizer and the state handed back at exit all say the same; the next step
    starts from it as torch's does. (Found by test_scenarios' random draw: an added group
    whose first gradients were skipped.)"""
    model = small()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(main_params(model)), make(main_params(ref))
    opt.add_param_group(side_group(model, lr=2e-3))
    ref_opt.add_param_group(side_group(ref, lr=2e-3))
    batches = make_batches(model, 2)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=1000.0) for _ in range(2))
    seen = {}

    def body():
        _skipped_step(model, opt, batches[0][0], scaler)
        seen["sd"], seen["held"] = opt.state_dict(), bool(opt.state)

    kept(tmp_path, monkeypatch, opt, model, body, backend)
    _skipped_step(ref, ref_opt, batches[0][0], ref_scaler)
    want = ref_opt.state_dict()
    assert sorted(want["state"]) == [0, 1, 2, 3, 4]
    assert all(float(st["step"]) == 0 for st in want["state"].values())
    state_equal(seen["sd"], want, "state_dict after the skipped step")
    assert seen["held"]
    state_equal(rec.gather(str(swap_dir(tmp_path)))["optimizer"], want, "recovered")
    other = make(main_params(copy.deepcopy(model)))
    other.add_param_group(side_group(model, lr=2e-3))
    with tiermem.offload(other, config(tmp_path / "other", backend=backend)) as tm:
        other.load_state_dict(want)
        state_equal(other.state_dict(), want, "loaded into another tiered optimizer")
        dcp.save(tm, str(tmp_path / "ckpt"))
    third = make(main_params(copy.deepcopy(model)))
    third.add_param_group(side_group(model, lr=2e-3))
    with tiermem.offload(third, config(tmp_path / "third", backend=backend)) as tm:
        dcp.load(tm, str(tmp_path / "ckpt"))
        state_equal(third.state_dict(), want, "through tiermem.dist.dcp")
    opt2 = make(main_params(model))
    opt2.add_param_group(side_group(model, lr=2e-3))
    with tiermem.offload(opt2, crash_cfg(tmp_path, backend), model=model, resume=True):
        state_equal(opt2.state_dict(), want, "state_dict after resume")
        loss = loss_of(model, *batches[1][0], True)
        scaler.scale(loss).backward()
        scaler.step(opt2)
        scaler.update()
    loss = loss_of(ref, *batches[1][0], True)
    ref_scaler.scale(loss).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    compare_runs(model, opt2, ref, ref_opt)  # the state handed back at exit, and weights


@pytest.mark.parametrize("backend", backend_params())
def test_a_skipped_first_step_of_fused_sgd_leaves_no_state(tmp_path, backend):
    """torch's fused SGD keeps the momentum buffer of a parameter whose first step
    GradScaler skipped from torch.empty_like (uninitialised memory) and steps on from it.
    tiermem keeps what GradScaler means and gives the unfused SGD, which it never calls on
    such a step: no state, and the next step is the first (the buffer starts from the
    gradient): bitwise the fused SGD's that the skipped step never reached."""
    model = small()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9,  # noqa: E731
                                     dampening=0.5, fused=True)
    opt, ref_opt = make(model), make(ref)
    batches = make_batches(model, 2)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=1000.0) for _ in range(2))
    with tiermem.offload(opt, config(tmp_path, backend=backend)):
        _skipped_step(model, opt, batches[0][0], scaler)
        assert opt.state_dict()["state"] == {} and not opt.state
        scaler.scale(loss_of(model, *batches[1][0], True)).backward()
        scaler.step(opt)
        scaler.update()
    ref_scaler.scale(torch.ones(()))  # the skip, as GradScaler does it for unfused SGD
    ref_scaler.update(scaler.get_scale())
    ref_scaler.scale(loss_of(ref, *batches[1][0], True)).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    compare_runs(model, opt, ref, ref_opt)
