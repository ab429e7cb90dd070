"""Checkpoints in and out of a tiered optimizer, against what the plain torch optimizer
does with the same calls: torch.distributed.checkpoint's state_dict helpers in one process
(get_optimizer_state_dict, set_optimizer_state_dict, get_state_dict, as torchtitan and
Accelerate's FSDP path call them, flattened too, and with parameters.offload),
state_dicts keyed otherwise than by torch's numbering, and checkpoints of other groups
(refused as torch refuses them). The reference is always a plain optimizer on a deep copy of the model, fed the
same batches and the same checkpoint calls; state on NVMe in 64 KiB partitions (every
parameter but the biases cut across several), both I/O backends."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     get_state_dict, set_optimizer_state_dict)

import tiermem
from tiermem.errors import TierMemError

from offload_helpers import (Synthetic, backend_params, compare_runs, compare_state_dicts,
                             config, make_batches, train)


def _cfg(path, backend):
    return config(path, backend=backend, host=0, partition_size="64KiB")


def _same_fqn_state(sd: dict, ref_sd: dict) -> None:
    """Two optimizer state_dicts keyed by parameter names (torch.distributed.checkpoint's
    layout) hold the same state, step counts included."""
    assert set(sd["state"]) == set(ref_sd["state"])
    for name, ref_st in ref_sd["state"].items():
        assert set(sd["state"][name]) == set(ref_st), name
        for k, v in ref_st.items():
            assert torch.equal(sd["state"][name][k], v), f"{name}[{k!r}]"
    assert [g["params"] for g in sd["param_groups"]] == [
        g["params"] for g in ref_sd["param_groups"]]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", [(torch.optim.AdamW, dict(lr=0.01)),
                                     (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.1))],
                         ids=["AdamW", "Adagrad"])
def test_dcp_get_state_dict_takes_no_step(tmp_path, backend, cls, kw):
    # get_optimizer_state_dict / get_state_dict find opt.state empty (the tiers hold the
    # state) and, as for a never-stepped optimizer, ran a step with zero gradients and lr 0
    # to make some: every count went one up and every moment decayed (Adagrad, whose
    # plain state is made at construction, took that step even before the first real one)
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, 4)
    train(ref, ref_opt, batches[:2])
    ref_sd = copy.deepcopy(get_optimizer_state_dict(ref, ref_opt))
    _, ref_both = get_state_dict(ref, ref_opt)
    train(ref, ref_opt, batches[2:], start=2)
    state = opt.state
    with tiermem.offload(opt, _cfg(tmp_path, backend), model=model):
        train(model, opt, batches[:2])
        sd = get_optimizer_state_dict(model, opt)
        _same_fqn_state(sd, ref_sd)
        _, both = get_state_dict(model, opt)
        _same_fqn_state(both, ref_sd)
        train(model, opt, batches[2:], start=2)
    assert opt.state is state  # handed back into the object a reference taken before holds
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_dcp_get_state_dict_of_a_fresh_optimizer(tmp_path, backend):
    # never stepped: torch makes the state with a step of lr 0, tiered or not, and the
    # two go on alike
    model = Synthetic()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    batches = make_batches(model, 2)
    ref_sd = copy.deepcopy(get_optimizer_state_dict(ref, ref_opt))
    train(ref, ref_opt, batches)
    with tiermem.offload(opt, _cfg(tmp_path, backend), model=model):
        _same_fqn_state(get_optimizer_state_dict(model, opt), ref_sd)
        train(model, opt, batches)
    compare_runs(model, opt, ref, ref_opt)


def _trained_checkpoint(model, cls, kw, batches):
    """(model's weights, optimizer state_dict keyed by parameter names) after `batches`
    on a plain optimizer over a copy of `model`."""
    m = copy.deepcopy(model)
    o = cls(m.parameters(), **kw)
    train(m, o, batches)
    return copy.deepcopy(m.state_dict()), copy.deepcopy(get_optimizer_state_dict(m, o))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("via", ["set_optimizer_state_dict", "load_state_dict"])
def test_state_keyed_by_parameter_names_loads(tmp_path, backend, via):
    # set_optimizer_state_dict hands load_state_dict the state under parameter names, as
    # the groups list them; torch maps the n-th listed key to the n-th parameter. The
    # tiered load took only numbered keys for parameters' entries: nothing was loaded and
    # the run started over from step 1
    model = Synthetic()
    batches = make_batches(model, 4)
    kw = dict(lr=0.01, amsgrad=True)
    weights, sd = _trained_checkpoint(model, torch.optim.AdamW, kw, batches[:2])
    model.load_state_dict(weights)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    load = ((lambda m, o, s: set_optimizer_state_dict(m, o, s))
            if via == "set_optimizer_state_dict" else (lambda m, o, s: o.load_state_dict(s)))
    load(ref, ref_opt, copy.deepcopy(sd))
    train(ref, ref_opt, batches[2:], start=2)
    with tiermem.offload(opt, _cfg(tmp_path, backend), model=model):
        load(model, opt, copy.deepcopy(sd))
        # (the side branch, parameters 5 and 6, ran in the second step only)
        assert {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()} == {
            k: 2.0 if k < 5 else 1.0 for k in range(7)}
        train(model, opt, batches[2:], start=2)
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_flattened_dcp_state_dict_refused_inside_and_loads_before_the_block(tmp_path, backend):
    # flatten_optimizer_state_dict=True (torchtitan's choice): set_optimizer_state_dict
    # takes each parameter's state names from opt.state[p], {} inside the block, and
    # handed load_state_dict an empty state for every parameter: the run started over
    # from step 1, silently. Refused, saying why; loaded before the block it is exact.
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model = Synthetic()
    batches = make_batches(model, 4)
    kw = dict(lr=0.01)
    m = copy.deepcopy(model)
    o = torch.optim.AdamW(m.parameters(), **kw)
    with tiermem.offload(o, _cfg(tmp_path / "saved", backend), model=m):
        train(m, o, batches[:2])
        sd = copy.deepcopy(get_optimizer_state_dict(m, o, options=flat))  # saving works
    model.load_state_dict(m.state_dict())
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    set_optimizer_state_dict(ref, ref_opt, copy.deepcopy(sd), options=flat)
    train(ref, ref_opt, batches[2:], start=2)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    with tiermem.offload(opt, _cfg(tmp_path / "inside", backend), model=model):
        with pytest.raises(TierMemError, match="flatten_optimizer_state_dict"):
            set_optimizer_state_dict(model, opt, copy.deepcopy(sd), options=flat)
    set_optimizer_state_dict(model, opt, copy.deepcopy(sd), options=flat)
    with tiermem.offload(opt, _cfg(tmp_path / "before", backend), model=model):
        train(model, opt, batches[2:], start=2)
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cls, kw", [(torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
                                     (torch.optim.RMSprop, dict(lr=0.01, centered=True))],
                         ids=["SGD", "RMSprop"])
def test_checkpoint_of_other_groups_refused_as_torch_refuses_it(tmp_path, backend, cls, kw):
    # a checkpoint of one group into an optimizer of two: torch's ValueError, not a
    # KeyError: 'momentum' from the check of the records' layout against a missing group
    model = Synthetic()
    params = list(model.parameters())
    saved = cls(params, **kw)
    train(model, saved, make_batches(model, 2))
    sd = saved.state_dict()
    plain = cls([{"params": params[:3]}, {"params": params[3:]}], **kw)
    with pytest.raises(ValueError) as torch_said:
        plain.load_state_dict(copy.deepcopy(sd))
    opt = cls([{"params": params[:3]}, {"params": params[3:]}], **kw)
    with tiermem.offload(opt, _cfg(tmp_path, backend), model=model):
        with pytest.raises(ValueError) as tiered_said:
            opt.load_state_dict(copy.deepcopy(sd))
    assert str(tiered_said.value) == str(torch_said.value)


@pytest.mark.parametrize("backend", backend_params())
def test_dcp_state_dict_helpers_with_parameters_offload(tmp_path, backend):
    # Never stepped, torch's helpers set p.grad = zeros_like(p) and step with lr 0 to make
    # the state; with parameters.offload p is an empty stand-in, the step never saw those
    # gradients and the state stayed empty (a checkpoint loaded through that template was
    # dropped). Refused, naming the way round; after a step the helpers match plain torch.
    model = Synthetic()
    ref = copy.deepcopy(model)
    kw = dict(lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    batches = make_batches(model, 3)
    train(ref, ref_opt, batches[:2])
    ref_sd = copy.deepcopy(get_optimizer_state_dict(ref, ref_opt))
    train(ref, ref_opt, batches[2:], start=2)
    cfg = _cfg(tmp_path, backend)
    cfg["parameters"] = {"offload": "nvme", "window": "4MiB"}
    with tiermem.offload(opt, cfg, model=model):
        with pytest.raises(TierMemError, match="before entering the block"):
            get_state_dict(model, opt)
        for g in opt.param_groups:  # what torch's helper left behind when it failed
            g["lr"] = kw["lr"]
        opt.zero_grad()
        train(model, opt, batches[:2])
        _same_fqn_state(get_optimizer_state_dict(model, opt), ref_sd)
        train(model, opt, batches[2:], start=2)
    compare_runs(model, opt, ref, ref_opt)
