"""The native SGD and Adagrad kernels (native/rules.c) against the plain torch optimizers
on the same inputs: bitwise, and their in-pass CRCs against a CRC of what they wrote."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tiermem.kernels.adagrad import adagrad_update
from tiermem.kernels.checksum import crc32c
from tiermem.kernels.native_rules import set_isa
from tiermem.kernels.sgd import sgd_update
from adam_helpers import on_team_and_pool
from offload_helpers import (Synthetic, assert_same_tensor, backend_params, config,
                             make_batches, train)

import tiermem



@pytest.fixture(params=["scalar", "avx2", "avx512"])
def isa(request):
    """Each SIMD path of rules.c on its own (all must equal torch bitwise)."""
    if not set_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    set_isa("auto")


SIZES = st.sampled_from([1, 7, 15, 16, 17, 1023, 1024, 1037, 16 * 1024 + 5, 300_000 + 3])


def _data(n: int, seed: int, positive: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    return x.abs() if positive else x


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # isa is set per case
@given(n=SIZES, seed=st.integers(0, 2**16), momentum=st.sampled_from([0.0, 0.9, 0.5]),
       dampening=st.sampled_from([0.0, 0.1]), nesterov=st.booleans(),
       weight_decay=st.sampled_from([0.0, 1e-2]), maximize=st.booleans(),
       impl=st.sampled_from(["fused", "single", "foreach"]), steps=st.integers(1, 3))
def test_sgd_native_bitwise(isa, n, seed, momentum, dampening, nesterov, weight_decay, maximize,
                            impl, steps):
    if nesterov and (momentum == 0 or dampening != 0):
        nesterov = False  # torch refuses it
    flags = {"fused": dict(fused=True), "single": dict(foreach=False),
             "foreach": dict(foreach=True)}[impl]
    ref = _data(n, seed).requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.013, momentum=momentum, dampening=dampening,
                          nesterov=nesterov, weight_decay=weight_decay, maximize=maximize,
                          **flags)
    p = ref.detach().clone()
    buf = torch.zeros(n)
    for k in range(steps):
        grad = _data(n, seed + 1 + k)
        ref.grad = grad.clone()
        opt.step()
        crcs = sgd_update(kernel="native", params=[p], grads=[grad],
                          momentum_buffers=[buf] if momentum else [], first=[k == 0],
                          lr=0.013, momentum=momentum, dampening=dampening,
                          weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                          checksums=("momentum_buffer", "params") if momentum else ("params",),
                          match={"fused": "fused", "single": "single_tensor",
                                 "foreach": "multi_tensor"}[impl])
        assert torch.equal(p, ref.detach())
        assert crcs[0]["params"] == crc32c(p)
        if momentum:
            assert torch.equal(buf, opt.state[ref]["momentum_buffer"])
            assert crcs[0]["momentum_buffer"] == crc32c(buf)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # isa is set per case
@given(n=SIZES, seed=st.integers(0, 2**16), lr_decay=st.sampled_from([0.0, 0.01]),
       weight_decay=st.sampled_from([0.0, 1e-2]), eps=st.sampled_from([1e-10, 1e-3]),
       init=st.sampled_from([0.0, 0.1]), maximize=st.booleans(), steps=st.integers(1, 3))
def test_adagrad_native_bitwise_with_fused(isa, n, seed, lr_decay, weight_decay, eps, init,
                                           maximize, steps):
    ref = _data(n, seed).requires_grad_(True)
    opt = torch.optim.Adagrad([ref], lr=0.05, lr_decay=lr_decay, weight_decay=weight_decay,
                              eps=eps, initial_accumulator_value=init, maximize=maximize,
                              fused=True)
    p = ref.detach().clone()
    s = torch.full((n,), init)
    for k in range(steps):
        grad = _data(n, seed + 1 + k)
        ref.grad = grad.clone()
        opt.step()
        crcs = adagrad_update(kernel="native", params=[p], grads=[grad], state_sums=[s],
                              steps=[torch.tensor(float(k + 1))], lr=0.05, lr_decay=lr_decay,
                              weight_decay=weight_decay, eps=eps, maximize=maximize,
                              checksums=("sum",))
        assert torch.equal(s, opt.state[ref]["sum"])
        assert torch.equal(p, ref.detach())
        assert crcs[0] == {"sum": crc32c(s)}


def test_native_refuses_what_it_cannot_run():
    p, g = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32 CPU tensors"):
        sgd_update(kernel="native", params=[p], grads=[g], momentum_buffers=[], first=[True],
                   lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                   maximize=False)
    with pytest.raises(ValueError, match="unknown array 'sum'"):
        sgd_update(kernel="native", params=[p.float()], grads=[g.float()],
                   momentum_buffers=[], first=[True], lr=0.1, momentum=0.0, dampening=0.0,
                   weight_decay=0.0, nesterov=False, maximize=False, checksums=("sum",))
    with pytest.raises(ValueError, match="cannot compute checksums"):
        adagrad_update(kernel="fused", params=[p.float()], grads=[g.float()],
                       state_sums=[torch.zeros(8)], steps=[torch.tensor(1.0)], lr=0.1,
                       lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False,
                       checksums=("sum",))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", [
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=1e-2,
                               initial_accumulator_value=0.1, fused=True)),
    # (a plain fused SGD fails on this model's gradless parameter, inside torch)
    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-2,
                           foreach=True)),
    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, dampening=0.1, maximize=True)),
], ids=["adagrad-fused", "sgd-nesterov-foreach", "sgd-dampening-forloop"])
def test_tiered_native_step_equals_torch(tmp_path, monkeypatch, backend, cls, kw):
    """State on NVMe with checksums: the rule runs the native kernel, whose in-pass CRCs
    seal the records (a wrong CRC fails the next read), and the result equals torch's."""
    import tiermem.kernels.adagrad as adagrad_kernels
    import tiermem.kernels.sgd as sgd_kernels
    mod = adagrad_kernels if cls is torch.optim.Adagrad else sgd_kernels
    hashed = []
    native = mod.KERNELS["native"]

    def counting(**kwargs):
        hashed.append(bool(kwargs.get("checksums")))
        return native(**kwargs)
    monkeypatch.setitem(mod.KERNELS, "native", counting)
    model = Synthetic(vocab=300, hidden=130, out=9)
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, 4)
    with tiermem.offload(opt, config(tmp_path, backend=backend, host=0, kernel="match"),
                         model=model):
        train(model, opt, batches)
        sd = opt.state_dict()
    train(ref, ref_opt, batches)
    assert any(hashed)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), n)
    for i, state in ref_opt.state_dict()["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert_same_tensor(sd["state"][i][k], v, f"state[{i}][{k}]")


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_team_and_pool_give_the_same_bits(rule):
    """Threaded (above the cut-off), the pass runs on OpenMP's team for a main-thread call
    when built with it, else on threads of its own (`set_threads("pool")` forces them):
    the pieces are the same, so are the bits and CRCs."""
    n = (1 << 20) + 3 * 4096 + 5

    def run() -> tuple[list, torch.Tensor, torch.Tensor]:
        p, s = _data(n, 3), torch.full((n,), 0.1)
        crcs = []
        for k in range(2):
            grad = _data(n, 4 + k)
            if rule == "sgd":
                crcs = sgd_update(kernel="native", params=[p], grads=[grad],
                                  momentum_buffers=[s], first=[k == 0], lr=0.013,
                                  momentum=0.9, dampening=0.0, weight_decay=1e-2,
                                  nesterov=True, maximize=False,
                                  checksums=("momentum_buffer", "params"))
            else:
                crcs = adagrad_update(kernel="native", params=[p], grads=[grad],
                                      state_sums=[s], steps=[torch.tensor(float(k + 1))],
                                      lr=0.05, lr_decay=0.01, weight_decay=1e-2, eps=1e-10,
                                      maximize=False, checksums=("sum",))
        return crcs, p, s

    team, pool = on_team_and_pool(run)
    assert team[0] == pool[0]
    assert_same_tensor(team[1], pool[1], "params, team vs pool")
    assert_same_tensor(team[2], pool[2], "state, team vs pool")
