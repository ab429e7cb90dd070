"""User code between steps reads and edits weights the parameter tier has released, or
edits live ones through p.data: each read sees the real weights and each edit is kept,
bitwise as the plain run doing the same (losses, logged values, final weights).

Between uses a released parameter's p.data is an empty tensor. A weight norm logged
between steps was 0 (or a shape error), and `p.data.mul_()` on a live weight moved no
version counter, so the window let the change go when it released the weight. The
window here is smaller than the model (releases happen), the optimizer state is on
NVMe, and both I/O backends run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tiermem
from tiermem.device.lanes import DeferredBackend
from tiermem.errors import TierMemError
from offload_helpers import backend_params

from test_params_parity import Net, assert_same_model, batches, cfg, loss_of, make_opt, twins

STEPS = 3


def _config(tmp_path, backend: str, *, overlap: bool = False, device: bool = False) -> dict:
    # (overlap: the window holds a partition's weights and grads next to the largest
    # module's; device: records with an fp32 master, a device model's or a crash-consistent
    # run's, hold more parameters a partition). Below the model's weights either way.
    c = cfg(tmp_path, offload="nvme", backend=backend, state_host=False,
            window="256KiB" if overlap or device else "176KiB")
    c["pipeline"]["overlap_backward"] = overlap
    return c


def _released(model: nn.Module) -> list[str]:
    with torch._C.DisableTorchFunction():  # as the tier left them (p.shape says the record's)
        return [n for n, p in model.named_parameters() if p.numel() == 0]


def _reads(model: nn.Module, other: nn.Module) -> list:
    """What a training script logs between steps."""
    ps = list(model.parameters())
    fc = model.b1.fc1.weight
    with torch.no_grad():
        out = [fc.norm(), torch.norm(model.b2.fc2.weight), fc.detach().clone(), fc.sum(),
               model.ln.bias.tolist(), repr(model.b2.ln.weight), f"{model.ln.weight}",
               # a metric over the whole model, more weights than the window holds
               torch.stack([p.pow(2).sum() for p in ps]).sum(),
               # two models' weights compared (the other one is not tiered)
               [torch.equal(p, q) for p, q in zip(ps, other.parameters())],
               model.emb.weight[3].clone(), model.head.weight.float().mean()]
    return [o.clone() if isinstance(o, torch.Tensor) else o for o in out]


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and torch.equal(x, y), k
        else:
            assert x == y, k


def _train(model: nn.Module, opt: torch.optim.Optimizer, between) -> list:
    log = []
    for t, y in batches(STEPS):
        loss = loss_of(model, t, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append(loss.item())
        log.extend(between(model))
    return log


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("backend", backend_params())
def test_reads_between_steps_see_the_weights(tmp_path, backend, overlap):
    ref, model = twins()
    other = copy.deepcopy(ref)
    want = _train(ref, make_opt(ref), lambda m: _reads(m, other))
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, backend, overlap=overlap), model=model) as tm:
        got = _train(model, opt, lambda m: [_released(m) != []] + _reads(m, other))
        stats = tm.param_stats()
    assert all(got[k] for k in range(1, len(got), len(got) // STEPS))  # some were released
    _same([g for k, g in enumerate(got) if k % (len(got) // STEPS) != 1], want)
    assert stats["outside_forward"] > 0 and stats["evictions"] > 0
    assert_same_model(ref, model)


def test_shape_reads_need_no_weights(tmp_path):
    # A parameter count or a logged shape is the model's, not (0,); answered from the
    # record, nothing is read for it.
    ref, model = twins()
    want = [(tuple(p.shape), p.numel(), p.size(0), p.size(-1), len(p), p.dim(), p.ndim,
             p.nelement(), p.nbytes) for p in ref.parameters()]
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, _config(tmp_path, "threads"), model=model) as tm:
        _train(model, opt, lambda m: [])
        assert _released(model)
        before = tm.param_stats()
        got = [(tuple(p.shape), p.numel(), p.size(0), p.size(-1), len(p), p.dim(), p.ndim,
                p.nelement(), p.nbytes) for p in model.parameters()]
        after = tm.param_stats()
    assert got == want
    assert after["fetches"] == before["fetches"] and after["outside_forward"] == 0


def test_state_dict_outside_the_forward_reads_each_weight_once(tmp_path):
    # Module.state_dict() detaches each parameter before the tier's hook puts a copy of the
    # current weights in its place: the detach is not a read of its own.
    ref, model = twins()
    _train(ref, make_opt(ref), lambda m: [])
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, "threads"), model=model) as tm:
        _train(model, opt, lambda m: [])
        sd = model.state_dict()
        assert tm.param_stats()["outside_forward"] == 0
    want = ref.state_dict()
    assert list(sd) == list(want)
    assert all(torch.equal(sd[k], want[k]) for k in want)


def _edit_through_data(model: nn.Module, step: list[int]) -> list:
    """What older code, weight-tying and EMA helpers do with p.data after a step."""
    step[0] += 1
    g = torch.Generator().manual_seed(step[0])
    for k, p in enumerate(model.parameters()):
        if k % 3 == 0:
            p.data.mul_(0.5)
        elif k % 3 == 1:
            p.data.copy_(torch.randn(p.data.shape, generator=g) * 0.1)
        else:
            p.data[:1] = 0.25
    return []


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("backend", backend_params())
def test_edits_through_p_data_are_kept(tmp_path, backend, overlap):
    # A live weight changed through p.data (no version counter moves) was released later
    # with its record's old weights; a released one's p.data was the empty placeholder.
    ref, model = twins()
    want = _train(ref, make_opt(ref), lambda m: _edit_through_data(m, [0]))
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, backend, overlap=overlap), model=model) as tm:
        got = _train(model, opt, lambda m: _edit_through_data(m, [0]))
        stats = tm.param_stats()
    assert stats["data_taken"] > 0 and stats["evictions"] > 0
    assert got == want
    assert_same_model(ref, model)


def test_an_ema_helper_through_p_data(tmp_path):
    # the EMA of many codebases: a plain copy of the model, updated from p.data every step
    def ema(model: nn.Module, avg: nn.Module) -> list:
        for a, p in zip(avg.parameters(), model.parameters()):
            a.data.mul_(0.9).add_(p.data, alpha=0.1)
        return []

    ref, model = twins()
    avg_ref, avg = copy.deepcopy(ref), copy.deepcopy(ref)
    want = _train(ref, make_opt(ref), lambda m: ema(m, avg_ref))
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, "threads"), model=model):
        got = _train(model, opt, lambda m: ema(m, avg))
    assert got == want
    assert_same_model(avg_ref, avg)
    assert_same_model(ref, model)


def test_reads_of_a_device_model_between_steps(tmp_path):
    # a device model (the emulated streams): weights read on the device they train on
    ref, model = twins()
    other = copy.deepcopy(ref)
    want = _train(ref, make_opt(ref), lambda m: _reads(m, other))
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, "threads", device=True), model=model,
                         streams=DeferredBackend()) as tm:
        got = _train(model, opt, lambda m: _reads(m, other))
        assert tm.param_stats()["outside_forward"] > 0
    _same(got, want)
    assert_same_model(ref, model)


def test_edits_through_p_data_with_crash_consistent_commits(tmp_path):
    # the commit keeps the weights of its step (the records' fp32 masters): the next step
    # starts from the edited weights all the same
    ref, model = twins()
    want = _train(ref, make_opt(ref), lambda m: _edit_through_data(m, [0]))
    opt = make_opt(model)
    c = _config(tmp_path, "threads", device=True)  # (the masters: more bytes a partition)
    c["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, c, model=model):
        got = _train(model, opt, lambda m: _edit_through_data(m, [0]))
    assert got == want
    assert_same_model(ref, model)


def _round_trip(model: nn.Module) -> list:
    # torch's flat-vector helpers (a weight perturbation, a merge): vector_to_parameters
    # gives every parameter a view of one new vector through p.data
    v = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(v * 0.9, model.parameters())
    return [v.sum().item()]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_parameters_to_vector_and_back_between_steps(tmp_path, overlap):
    # The vector read the empty placeholders; and the parameters viewing one storage were
    # taken for each other by the tier (backward rebuilt a saved weight at another's
    # offset: an invalid storage offset under overlap)
    ref, model = twins()
    want = _train(ref, make_opt(ref), _round_trip)
    opt = make_opt(model)
    c = _config(tmp_path, "threads", overlap=True)  # (a window of 256 KiB either way)
    c["pipeline"]["overlap_backward"] = overlap
    with tiermem.offload(opt, c, model=model) as tm:
        got = _train(model, opt, _round_trip)
        assert tm.param_stats()["evictions"] > 0
    assert got == want
    assert_same_model(ref, model)


def test_a_conversion_to_what_the_model_is_reads_nothing(tmp_path):
    # model.to(its device), .float() of an fp32 model: torch gives each parameter itself
    # back; the released ones are not read for it (a whole model's read each time)
    ref, model = twins()
    want = _train(ref, make_opt(ref), lambda m: [m.to("cpu").float() is m])
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, "threads"), model=model) as tm:
        got = _train(model, opt, lambda m: [m.to("cpu").float() is m])
        before = tm.param_stats()["outside_forward"]
        model.to(torch.float32)
        model.cpu()
        assert tm.param_stats()["outside_forward"] == before == 0
    assert got == want
    assert_same_model(ref, model)


def test_tensors_like_a_released_weight_read_nothing(tmp_path):
    # an EMA shadow or torch.distributed.checkpoint's zeros: shape, dtype and device only
    ref, model = twins()
    want = [torch.zeros_like(p) for p in ref.parameters()]
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, "threads"), model=model) as tm:
        _train(model, opt, lambda m: [])
        assert _released(model)
        got = [torch.zeros_like(p) for p in model.parameters()]
        got += [p.new_zeros(3) for p in model.parameters()]
        assert torch.zeros_like(input=model.b1.fc1.weight).shape == model.b1.fc1.weight.shape
        assert tm.param_stats()["outside_forward"] == 0
    assert [g.shape for g in got[:len(want)]] == [w.shape for w in want]


def test_a_gradient_set_by_hand_is_refused(tmp_path):
    # the step takes the tier's gradients: one set on p.grad after backward was passed over
    # without a word where the parameter was live (a released one's is refused as set)
    model = Net()
    opt = make_opt(model)
    (t, y), (t2, y2) = batches(2)
    with tiermem.offload(opt, _config(tmp_path, "threads"), model=model):
        _train(model, opt, lambda m: [])
        loss_of(model, t, y).backward()
        with torch._C.DisableTorchFunction():
            live = next(p for p in model.parameters() if p.numel() > 0)
            released = next(p for p in model.parameters() if p.numel() == 0)
        live.grad = torch.ones_like(live)
        with pytest.raises(TierMemError, match="set by hand inside the block"):
            opt.step()
        live.grad = None
        with pytest.raises(TierMemError, match="set by hand inside the block"):
            released.grad = torch.ones_like(released)
        opt.step()
        opt.zero_grad()


def test_one_call_over_more_weights_than_the_window_is_refused(tmp_path):
    # a foreach op over the whole model: its weights cannot all be in the window at once
    ref, model = twins()
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, _config(tmp_path, "threads"), model=model):
        _train(model, opt, lambda m: [])
        with pytest.raises(TierMemError, match="given 15 weights of the parameter tier at once"):
            torch._foreach_norm(list(model.parameters()))
        # one at a time, the same norms as the plain model's; the loop goes on
        got = [torch.linalg.vector_norm(p) for p in model.parameters()]
        _train(ref, make_opt(ref), lambda m: [])
        assert got == [torch.linalg.vector_norm(p) for p in ref.parameters()]
        _train(model, opt, lambda m: [])


def _edit_through_param(model: nn.Module, step: list[int]) -> list:
    """In-place changes through the parameter itself (its version counter moves)."""
    step[0] += 1
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            if k % 2 == step[0] % 2:
                p.mul_(0.75).add_(0.01 * step[0])
    return []


def _edit_queued(streams: DeferredBackend | None):
    """p.data.mul_() as a GPU runs it: a kernel queued on the compute stream, run when
    something waits for that stream (at once on the plain model)."""
    def edit(model: nn.Module, step: list[int]) -> list:
        for k, p in enumerate(model.parameters()):
            if k % 2 == 0:
                d = p.data
                if streams is None:
                    d.mul_(0.5)
                else:
                    streams.run(streams.compute, lambda d=d: d.mul_(0.5))
        return []
    return edit


@pytest.mark.parametrize("edit", ["p.data", "p", "queued"])
def test_edits_of_a_device_model_are_kept(tmp_path, edit):
    # A device buffer changed in place between steps was released with its record's old
    # weights: the change was lost without a word. The release now copies it back, after
    # the kernels queued to change it (red without that wait: "queued").
    streams = DeferredBackend()
    edits = {"p.data": (_edit_through_data,) * 2, "p": (_edit_through_param,) * 2,
             "queued": (_edit_queued(None), _edit_queued(streams))}[edit]
    ref, model = twins()
    want = _train(ref, make_opt(ref), lambda m: edits[0](m, [0]))
    opt = make_opt(model)
    with tiermem.offload(opt, _config(tmp_path, "threads", device=True), model=model,
                         streams=streams) as tm:
        got = _train(model, opt, lambda m: edits[1](m, [0]))
        stats = tm.param_stats()
    assert stats["evictions"] > 0 and stats["d2h_bytes"] > 0
    assert got == want
    assert_same_model(ref, model)
