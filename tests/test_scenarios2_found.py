"""What a second random scenario search found (GradScaler, parameters frozen and unfrozen,
grads None, weights edited between steps, tensor lr and betas, maximize,
zero_grad(set_to_none=False), foreach/fused flags, param groups with their own
hyperparameters), each held here by the smallest run that showed it."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from tiermem.device.lanes import DeferredBackend
from offload_helpers import (Synthetic, backend_params, compare_runs, config, loss_of,
                             make_batches)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_a_parameter_unfrozen_inside_the_block_with_the_weights_in_the_tier_trains(
        tmp_path, backend, overlap):
    """The parameter tier hooked the gradients of the parameters that required one when
    the block opened; one unfrozen since kept its gradient in p.grad, where the step never
    looked: it stayed as it was, without a word. The tier takes its gradients now, and
    Adam, which laid out no record for it, lays one out at its first step (with
    overlap_backward at the forward): it trains as torch's (refused before that)."""
    model = Synthetic(vocab=300, hidden=130, out=9)
    model.emb.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    batches = make_batches(model, 2)
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["parameters"] = {"offload": "nvme"}
    cfg["pipeline"]["overlap_backward"] = overlap
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    with tiermem.offload(opt, cfg, model=model):
        for m, o in ((ref, ref_opt), (model, opt)):
            m.emb.weight.requires_grad_(True)
            for (tokens, target), in batches:
                loss_of(m, tokens, target, False).backward()
                o.step()
                o.zero_grad()
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("weights", ["host", "nvme"])
def test_a_frozen_parameters_zeroed_gradient_updated_during_backward_equals_torch(
        tmp_path, backend, weights):
    """zero_grad(set_to_none=False), then a parameter frozen: torch steps it with its p.grad
    of zeros every step. With overlap_backward its partition, from the second step on,
    waits for no hook of it and is updated during backward; the parameter tier stored
    those zeros only at step(), so that update found no gradient and passed the segment
    over (counted, not updated)."""
    torch.manual_seed(0)
    model = Synthetic(vocab=300, hidden=130, out=9)
    ref = copy.deepcopy(model)
    batches = make_batches(model, 3)

    def run(m, opt):
        for i, ((tokens, target),) in enumerate(batches):
            if i == 1:
                m.fc1.weight.requires_grad_(False)
            loss_of(m, tokens, target, False).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

    _overlapped_against_plain(tmp_path, backend, weights, model, ref,
                              lambda m: torch.optim.Adam(m.parameters(), lr=0.01), run)


def _overlapped_against_plain(tmp_path, backend, weights, model, ref, make, run):
    """run(ref, make(ref)) plainly and run(model, make(model)) tiered with updates during
    backward (and the weights where `weights` says); both must end equal."""
    ref_opt = make(ref)
    run(ref, ref_opt)
    opt = make(model)
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["parameters"] = {"offload": weights}
    cfg["pipeline"]["overlap_backward"] = True
    with tiermem.offload(opt, cfg, model=model):
        run(model, opt)
    compare_runs(model, opt, ref, ref_opt)


def _three_groups(m):
    # fc1.bias shares a partition with fc2's parameters, whose gradients backward
    # finishes before fc1.bias's
    return [{"params": [m.emb.weight, m.fc1.weight]},
            {"params": [m.fc1.bias, m.fc2.weight, m.fc2.bias]},
            {"params": [m.side.weight, m.side.bias]}]


_ADAM = lambda gs: torch.optim.Adam(gs, lr=0.05)  # noqa: E731
_ADAGRAD = lambda gs: torch.optim.Adagrad(gs, lr=0.05)  # noqa: E731


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("make, weights, at_entry", [
    (_ADAM, "none", False), (_ADAM, "nvme", False),
    (_ADAGRAD, "none", False), (_ADAGRAD, "nvme", False),
    # Adagrad lays out a record for a parameter frozen at entry, which add() never hooked
    # (with the weights in the tier, the tier hooks it at its first forward unfrozen)
    (_ADAGRAD, "none", True), (_ADAGRAD, "nvme", True)],
    ids=["adam", "adam-nvme", "adagrad", "adagrad-nvme", "adagrad-frozen-at-entry",
         "adagrad-nvme-frozen-at-entry"])
def test_a_parameter_unfrozen_between_steps_is_waited_for_by_the_updates_during_backward(
        tmp_path, backend, weights, make, at_entry):
    """overlap_backward counted what each partition waits for at the end of the last step:
    a parameter frozen then, unfrozen before this step's forward, was waited for by none,
    so its partition was updated during backward before its gradient came, and step()
    passed it over (not updated at all that step)."""
    model = Synthetic(vocab=300, hidden=130, out=9, seed=445)
    if at_entry:
        model.fc1.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    batches = make_batches(model, 4, seed=445)

    def run(m, opt):
        for i, ((tokens, target),) in enumerate(batches):
            if i == 2 and not at_entry:
                m.fc1.bias.requires_grad_(False)
            if i == 3:
                m.fc1.bias.requires_grad_(True)
            loss_of(m, tokens, target, False).backward()
            opt.step()
            opt.zero_grad()

    _overlapped_against_plain(tmp_path, backend, weights, model, ref,
                              lambda m: make(_three_groups(m)), run)


@pytest.mark.parametrize("backend", backend_params())
def test_a_frozen_parameters_gradient_dropped_after_an_update_during_backward_is_refused(
        tmp_path, backend):
    """A frozen parameter's p.grad (the zeros zero_grad(set_to_none=False) left) is read by
    an update during backward that no hook of it waited for; set to None afterwards, the
    plain step would leave the parameter alone, but backward had already updated it, and
    step() checked only the gradients whose hooks had fired: wrong without a word (or right,
    as the worker's timing fell). Refused, as any gradient edited after backward is."""
    model = Synthetic(vocab=300, hidden=130, out=9, seed=2301)
    batches = make_batches(model, 2, seed=2301)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["pipeline"]["overlap_backward"] = True
    with tiermem.offload(opt, cfg, model=model) as tm:
        (tokens, target), = batches[0]
        loss_of(model, tokens, target, False).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        model.fc1.weight.requires_grad_(False)
        (tokens, target), = batches[1]
        loss_of(model, tokens, target, False).backward()
        tm.offloaded.wait_idle()  # the updates during backward are done
        model.fc1.weight.grad = None
        with pytest.raises(tiermem.TierMemError, match="fc1.weight' changed between backward"):
            opt.step()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("frozen", [True, False], ids=["still-frozen", "unfrozen"])
def test_a_resume_with_a_parameter_frozen_since_lays_out_its_kept_state(
        tmp_path, backend, monkeypatch, frozen):
    """A parameter frozen mid-run keeps its state; the state kept on disk at the block's
    end holds it. A resume with it still frozen laid out no record for it and was refused
    (after a first fix, naming it); it now lays out what the kept records hold, frozen
    now or not, and continues as the plain run does."""
    model = Synthetic(vocab=300, hidden=130, out=9)
    ref = copy.deepcopy(model)
    batches = make_batches(model, 3)
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["swap"]["durability"] = "crash_consistent"

    def run(m, opt, steps):
        for i in steps:
            (tokens, target), = batches[i]
            loss_of(m, tokens, target, False).backward()
            opt.step()
            opt.zero_grad()
            m.fc2.bias.requires_grad_(False)  # frozen after the first step

    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    run(ref, ref_opt, range(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, cfg, model=model):
            run(model, opt, range(2))
    monkeypatch.undo()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.fc2.bias.requires_grad_(not frozen)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.offloaded.late == []
        model.fc2.bias.requires_grad_(False)  # (frozen in the rest of the run either way)
        run(model, opt, range(2, 3))
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_an_update_during_backward_failed_by_an_edited_gradient_reports_the_edit(
        tmp_path, backend, monkeypatch):
    """p.grad set to None after backward while the worker was reading it failed the update
    with an AttributeError, which step() raised as it came. The edit is the cause, and
    step() now says so (TierMemError), whatever the failure was (here one of our own)."""
    model = Synthetic(vocab=300, hidden=130, out=9)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["pipeline"]["overlap_backward"] = True
    (tokens, target), = make_batches(model, 1)[0]
    with tiermem.offload(opt, cfg, model=model) as tm:
        def fail(*args, **kwargs):
            raise AttributeError("'NoneType' object has no attribute 'reshape'")

        monkeypatch.setattr(tm.offloaded, "update", fail)
        loss_of(model, tokens, target, False).backward()
        tm.offloaded.wait_idle()
        model.fc2.weight.grad = None
        with pytest.raises(tiermem.TierMemError, match="fc2.weight' changed between backward"):
            opt.step()
        monkeypatch.undo()


@pytest.mark.parametrize("backend", backend_params())
def test_a_weight_loaded_before_a_parameters_first_step_counts_whatever_the_layout(
        tmp_path, backend):
    """A bf16 model's fp32 master is made from the model's weights when its record is
    first written: under crash_consistent at the block's entry, under scratch at the first
    step of any parameter the record holds. side.weight takes its first step at step 1;
    a model.load_state_dict() after step 0 reached its master with scratch and its own
    param group (a record written at step 1), and not with crash_consistent or a record
    shared with parameters stepped at step 0: the numbers depended on the layout
    (docs/guide/numerics.md says they do not). A parameter's first step now starts from
    the model's weights wherever its record was written."""
    def build(seed):
        return Synthetic(vocab=300, hidden=130, out=9, seed=seed).to(torch.bfloat16)

    loaded = build(1).state_dict()
    batches = make_batches(build(0), 2)

    def run(crash: bool, own_group: bool, where: str, lanes: bool = False):
        model = build(0)
        side = [model.side.weight, model.side.bias]
        rest = [p for n, p in model.named_parameters() if not n.startswith("side.")]
        opt = torch.optim.AdamW([{"params": rest}, {"params": side}] if own_group
                                else list(model.parameters()), lr=0.01)
        cfg = config(tmp_path / where, backend=backend, host="64MiB", kernel="auto")
        cfg["swap"]["durability"] = "crash_consistent" if crash else "scratch"
        streams = {}
        if lanes:  # a device model (lanes emulated on the CPU): records staged ahead
            cfg["optimizer"]["step_device"] = "device"
            streams = {"streams": DeferredBackend()}
        with tiermem.offload(opt, cfg, model=model, **streams):
            for i, ((tokens, target),) in enumerate(batches):
                loss_of(model, tokens, target, i == 1).backward()
                opt.step()
                opt.zero_grad()
                if i == 0:
                    model.load_state_dict(loaded)
            sd = opt.state_dict()
        return model, sd

    want, want_sd = run(False, True, "a")
    for crash, own_group, where, lanes in [(True, True, "b", False), (False, False, "c", False),
                                           (True, False, "d", False), (False, False, "e", True)]:
        model, sd = run(crash, own_group, where, lanes)
        for (name, p), q in zip(model.named_parameters(), want.parameters()):
            assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)), (
                f"{name}: crash {crash}, own group {own_group}")
        for i, st in want_sd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim():
                    assert torch.equal(sd["state"][i][k], v), (i, k, crash, own_group)
