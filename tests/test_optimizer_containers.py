"""State kept as lists, tuples and dicts of tensors, on the generic path.

SOAP and SPlus keep a preconditioner matrix per side of a 2-D parameter in a list, AggMo a
momentum per beta in a dict. tiermem keeps each tensor inside as a record kind of its own
and rebuilds the container around the record's views for the optimizer's step and for
state_dict(). The eigenbases torch.linalg returns are column-major, and matmul's rounding
follows the memory order, so the record keeps each tensor's bytes in the order the
optimizer left them and hands them back in it: without that the run ends different in the
last bits (test_memory_order_is_what_keeps_it_exact goes red).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer

from offload_helpers import backend_params, make_batches, train
from test_optimizer_rules import (Stepped, cfg, kept_on_disk, params_equal, resumed, small,
                                  state_equal)

STEPS = 3


class SidePreconditioned(Stepped):
    """Momenta in a dict keyed by beta (updated in place); for a 2-D parameter a list of one
    statistics matrix per side (replaced by new tensors every step) and a tuple of their
    eigenbases (torch.linalg.eigh's: column-major), made again every other step (as SOAP's
    precondition_frequency), which rotate and shift the update."""

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, st in self.with_grads():
            g = p.grad
            if not st:
                st["step"] = 0
                st["m"] = {0.5: torch.zeros_like(p), 0.9: torch.zeros_like(p)}
                if p.dim() == 2:
                    st["sides"] = [torch.zeros(n, n) for n in p.shape]
            st["step"] += 1
            for beta, m in st["m"].items():
                m.mul_(beta).add_(g, alpha=1 - beta)
            u = st["m"][0.5] + st["m"][0.9]
            if p.dim() == 2:
                left, right = st["sides"]
                st["sides"] = [0.9 * left + g @ g.T, 0.9 * right + g.T @ g]
                if st["step"] % 2:
                    st["bases"] = tuple(torch.linalg.eigh(s + torch.eye(len(s)))[1]
                                        for s in st["sides"])
                ql, qr = st["bases"]
                # a sum follows the memory order whatever the threads (a matmul's rounding
                # does only on some thread counts)
                u = ql @ (ql.T @ u @ qr) @ qr.T + 1e-3 * (ql.sum() + qr.sum())
            p.sub_(u, alpha=group["lr"])


class MixedContainer(Stepped):
    """Keeps a list holding a tensor and a string: nothing tiermem can put in a record."""

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, st in self.with_grads():
            if not st:
                st["pair"] = [torch.zeros_like(p), "momentum"]
            st["pair"][0].mul_(0.9).add_(p.grad)
            p.sub_(st["pair"][0], alpha=group["lr"])


class Queued(Stepped):
    """Keeps its last gradients in a deque (as AdaShift does)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, st in self.with_grads():
            if not st:
                st["queue"] = collections.deque(maxlen=2)
            st["queue"].append(p.grad.clone())
            p.sub_(sum(st["queue"]), alpha=group["lr"])


class Growing(Stepped):
    """Keeps its gradients in a list that grows by one every step: no fixed layout."""

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, st in self.with_grads():
            st.setdefault("history", []).append(p.grad.clone())
            p.sub_(sum(st["history"]), alpha=group["lr"])


def strides(sd):
    """Every state tensor's strides, by parameter, key and place in its container."""
    out = {}

    def walk(where, v):
        if isinstance(v, torch.Tensor):
            out[where] = v.stride()
        elif isinstance(v, (list, tuple)):
            for n, x in enumerate(v):
                walk(f"{where}[{n}]", x)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{where}[{k!r}]", x)
    for i, st in sd["state"].items():
        for k, v in st.items():
            walk(f"{i}.{k}", v)
    return out


def pair(cls=SidePreconditioned):
    model = small()
    ref = copy.deepcopy(model)
    return model, cls(model.parameters()), ref, cls(ref.parameters())


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("placement", ["nvme", "mixed"])
def test_container_state_equal(tmp_path, backend, placement):
    model, opt, ref, ref_opt = pair()
    batches = make_batches(model, STEPS + 2)
    with tiermem.offload(opt, cfg(tmp_path, backend, placement), model=model):
        train(model, opt, batches[:STEPS])
        sd = opt.state_dict()
    train(ref, ref_opt, batches[:STEPS])
    params_equal(model, ref, "after the run")
    ref_sd = ref_opt.state_dict()
    state_equal(sd, ref_sd, "state_dict()")
    state_equal(opt.state_dict(), ref_sd, "state handed back")
    # the containers' types and the column-major bases come back as the optimizer made them
    assert strides(sd) == strides(ref_sd) == strides(opt.state_dict())
    assert any(s[0] == 1 for s in strides(ref_sd).values()), "no column-major state to keep"
    # state_dict both ways
    plain = SidePreconditioned(model.parameters())
    plain.load_state_dict(sd)
    state_equal(plain.state_dict(), sd, "plain optimizer loaded from tiermem")
    opt.load_state_dict(ref_sd)
    with tiermem.offload(opt, cfg(tmp_path, backend, placement), model=model):
        train(model, opt, batches[STEPS:], start=STEPS)
    train(ref, ref_opt, batches[STEPS:], start=STEPS)
    params_equal(model, ref, "after loading the plain state_dict")
    state_equal(opt.state_dict(), ref_opt.state_dict(), "after loading")
    assert strides(opt.state_dict()) == strides(ref_opt.state_dict())


def test_memory_order_is_what_keeps_it_exact(tmp_path, monkeypatch):
    """With every tensor handed back row-major, the run ends different: the safety the
    kept memory order gives."""
    monkeypatch.setattr("tiermem.optim.rules.generic.dim_order", lambda t: None)
    model, opt, ref, ref_opt = pair()
    batches = make_batches(model, STEPS)
    with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme"), model=model):
        train(model, opt, batches)
    train(ref, ref_opt, batches)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_crash_consistent_resume(tmp_path, monkeypatch):
    """The memory order of each state tensor comes back from the manifest with the scalars:
    a resumed run continues exactly as an uninterrupted one."""
    model, opt, ref, ref_opt = pair()
    batches = make_batches(model, 5)
    c = kept_on_disk(tmp_path, monkeypatch, model, opt, batches[:3])
    model2, opt2 = resumed(c, model, lambda m: SidePreconditioned(m.parameters()),
                           batches[3:], 3)
    train(ref, ref_opt, batches)
    params_equal(model2, ref, "resumed")
    state_equal(opt2.state_dict(), ref_opt.state_dict(), "resumed")
    assert strides(opt2.state_dict()) == strides(ref_opt.state_dict())


@pytest.mark.parametrize("cls, why", [
    (MixedContainer, "'pair' as a list holding tensors and a str at pair[1]"),
    (Queued, "'queue' as a deque"),
    (Growing, "changes its layout after the first step (['history']")])
def test_containers_it_cannot_lay_out_refused(tmp_path, cls, why):
    model, opt, _, _ = pair(cls)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedOptimizer, match=cls.__name__) as err:
        with tiermem.offload(opt, cfg(tmp_path, "threads", "nvme"), model=model):
            pass
    assert why in str(err.value)
    assert not opt.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
