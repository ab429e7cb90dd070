"""Parameters frozen when the block opens (requires_grad=False, no state yet: a LoRA run
handing the whole model to its optimizer) get no record, as a plain optimizer keeps no
state for them; the rest trains bitwise as plain. One unfrozen inside the block (a
backbone trained after some epochs, its parameters in the optimizer from the start) gets
its records at its first step (with overlap_backward, at the forward before its first
backward), as torch makes its state then, and trains bitwise as plain; so does one a
loaded state_dict gives state. Crash-consistent commits keep such late lay-outs in the
manifest: resume (with the parameter frozen again at entry, or not) and `tiermem recover`
lay them out again. Each was refused before ("laid out no optimizer state")."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import tiermem
import tiermem.tools.cli
from offload_helpers import backend_params, compare_runs, config

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),  # whole-parameter layout
}


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                            torch.nn.Tanh(), torch.nn.Linear(256, 8))
    for p in list(m.parameters())[:4]:  # the first two layers: the "base model"
        p.requires_grad_(False)
    return m


X = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))


def _trained(model, opt, steps=3):
    for _ in range(steps):
        model(X).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_frozen_parameters_take_no_record_until_unfrozen(
        tmp_path, backend, durability, overlap, name):
    make = OPTIMIZERS[name]
    model = _model()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    _trained(ref, ref_opt, 2)
    ref[0].weight.requires_grad_(True)
    _trained(ref, ref_opt, 2)
    cfg = config(tmp_path, backend=backend, host="64KiB", kernel="match")
    cfg["swap"]["durability"] = durability
    cfg["pipeline"]["overlap_backward"] = overlap
    with tiermem.offload(opt, cfg, model=model) as tm:
        laid = {s.param for part in tm.offloaded.parts for s in part.segments}
        assert laid == {p for p in model.parameters() if p.requires_grad}
        _trained(model, opt, 2)
        model[0].weight.requires_grad_(True)
        _trained(model, opt, 2)
        laid = {s.param for part in tm.offloaded.parts for s in part.segments}
        assert laid == {p for p in model.parameters() if p.requires_grad}
        assert [lay["params"] for lay in tm.offloaded.late] == [[0]]
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_a_state_dict_with_state_for_a_frozen_parameter_lays_it_out(tmp_path, backend):
    model = _model()
    ref = copy.deepcopy(model)
    src = copy.deepcopy(model)
    for p in src.parameters():
        p.requires_grad_(True)
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    _trained(src, src_opt, 1)  # state for every parameter
    # (a copy each: torch's load keeps the loaded tensors, which its steps then change)
    sd = src_opt.state_dict()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(sd))
    _trained(ref, ref_opt, 1)  # (torch keeps the frozen ones' state as loaded)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = config(tmp_path, backend=backend, host=0, kernel="match")
    with tiermem.offload(opt, cfg, model=model) as tm:
        opt.load_state_dict(copy.deepcopy(sd))
        assert len({s.param for part in tm.offloaded.parts for s in part.segments}) == 6
        _trained(model, opt, 1)
    compare_runs(model, opt, ref, ref_opt)
    # loaded before the block, that state is laid out at entry, frozen or not
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(sd))
    with tiermem.offload(opt, config(tmp_path, backend=backend, host=0), model=model) as tm:
        assert len({s.param for part in tm.offloaded.parts for s in part.segments}) == 6
        assert tm.offloaded.late == []


@pytest.mark.parametrize("frozen_at_resume", [True, False], ids=["refrozen", "unfrozen"])
def test_a_late_lay_out_is_recovered_and_resumed(tmp_path, frozen_at_resume):
    """The records of a parameter laid out inside the block follow all the others; a
    resume, whose model may have it frozen again at entry (the script starts over) or not,
    lays it out after them again, and `tiermem recover` reads its state."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _trained(ref, ref_opt, 1)
    ref[2].weight.requires_grad_(True)  # the second layer's weight: in the middle
    _trained(ref, ref_opt, 1)
    cfg = config(tmp_path, host=0, kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, cfg, model=model) as tm:
        _trained(model, opt, 1)
        model[2].weight.requires_grad_(True)
        _trained(model, opt, 1)
        tm.offloaded.keep_on_disk()  # what a crash leaves: the committed records
        tm.discard()
    out = tmp_path / "ckpt.pt"
    assert tiermem.tools.cli.main(["recover", str(tmp_path / "tiermem-default"),
                                   "-o", str(out)]) == 0
    ckpt = torch.load(out, weights_only=True)
    want = ref_opt.state_dict()
    assert set(ckpt["optimizer"]["state"]) == set(want["state"]) == {2, 4, 5}
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(ckpt["optimizer"]["state"][i][k]),
                               torch.as_tensor(v)), (i, k)
    model = _model()
    model[2].weight.requires_grad_(not frozen_at_resume)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 2
        assert [lay["params"] for lay in tm.offloaded.late] == [[2]]
        model[2].weight.requires_grad_(True)
        _trained(model, opt, 1)
    _trained(ref, ref_opt, 1)
    compare_runs(model, opt, ref, ref_opt)


def test_a_crash_consistent_run_with_frozen_parameters_recovers_and_resumes(tmp_path):
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _trained(ref, ref_opt, 2)
    cfg = config(tmp_path, host=0, kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, cfg, model=model) as tm:
        _trained(model, opt, 2)
        tm.offloaded.keep_on_disk()  # what a crash leaves: the committed records
        tm.discard()
    run = tmp_path / "tiermem-default"
    out = tmp_path / "ckpt.pt"
    assert tiermem.tools.cli.main(["recover", str(run), "-o", str(out)]) == 0
    ckpt = torch.load(out, weights_only=True)
    trained = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert set(ckpt["model"]) == trained  # the frozen ones never changed: not kept
    for n, p in ref.named_parameters():
        if n in trained:
            assert torch.equal(ckpt["model"][n], p.detach()), n
    model, opt = _model(), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 2
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_a_skipped_first_step_of_an_unfrozen_parameter_makes_its_state(tmp_path, backend):
    """torch's fused Adam makes the state of a parameter with a gradient (step 0, zero
    moments) before GradScaler's skip: one unfrozen inside the block is laid out there,
    state_dict() holds its entry as torch's does, and a crash right after resumes to it
    (the lay-out was committed with it)."""
    model = _model()
    ref = copy.deepcopy(model)
    make = lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)  # noqa: E731
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    cfg = config(tmp_path, backend=backend, host=0, kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"

    def skip_then(m, o, scaler, infs):
        for inf in infs:
            scaler.scale(m(X).square().mean() * (float("inf") if inf else 1)).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()

    ref_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    _trained(ref, ref_opt, 1)
    ref[0].weight.requires_grad_(True)
    skip_then(ref, ref_opt, ref_scaler, [True])
    want = {i: float(st["step"]) for i, st in ref_opt.state_dict()["state"].items()}
    skip_then(ref, ref_opt, ref_scaler, [False])
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with tiermem.offload(opt, cfg, model=model) as tm:
        _trained(model, opt, 1)
        model[0].weight.requires_grad_(True)
        skip_then(model, opt, scaler, [True])
        got = {i: float(st["step"]) for i, st in opt.state_dict()["state"].items()}
        tm.offloaded.keep_on_disk()  # what a crash leaves: the committed records
        tm.discard()
    assert got == want == {0: 0.0, 4: 1.0, 5: 1.0}
    model = _model()
    model[0].weight.requires_grad_(True)
    opt = make(model.parameters())
    with tiermem.offload(opt, cfg, model=model, resume=True):
        skip_then(model, opt, scaler, [False])
    compare_runs(model, opt, ref, ref_opt)


def test_late_lay_outs_around_an_added_group_resume_in_their_order(tmp_path):
    """A parameter laid out inside the block, then a group added, then another parameter
    laid out: the kept partitions are in that order, and a resume with the optimizer made
    with both groups lays them out so again (a drawn scenario was refused at its resume)."""
    def run(m, o, steps, at_entry=0):
        for i in range(at_entry, steps):  # (unfrozen from epochs 1 and 3 on)
            m[0].weight.requires_grad_(i >= 1)
            m[2].weight.requires_grad_(i >= 3)
            m(X).square().mean().backward()
            o.step()
            o.zero_grad()
            if i == 1:
                o.add_param_group({"params": [m[4].bias], "lr": 5e-3})

    def optimizer(m, added):
        ps = list(m.parameters())
        groups = [{"params": ps[:5]}] + ([{"params": [ps[5]], "lr": 5e-3}] if added else [])
        return torch.optim.AdamW(groups, lr=1e-2)

    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = optimizer(ref, False)
    run(ref, ref_opt, 5)
    opt = optimizer(model, False)
    cfg = config(tmp_path, host=0, kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, cfg, model=model) as tm:
        run(model, opt, 4)
        late = tm.offloaded.late
        assert [lay["params"] for lay in late] == [[0], [2]] and late[0]["at"] < late[1]["at"]
        tm.offloaded.keep_on_disk()
        tm.discard()
    model[0].weight.requires_grad_(False)  # as a script started over has it
    opt = optimizer(model, True)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 4
        run(model, opt, 5, at_entry=4)
    compare_runs(model, opt, ref, ref_opt)


def test_a_resume_with_more_parameters_than_the_kept_run_is_refused(tmp_path):
    """A resume lays out the parameters the kept records hold; an optimizer given more
    (a group the kept run never had) is refused by the layout check, naming the
    partitions, not laid out late as if unfrozen (a first version of that crashed with an
    IndexError reading the kept step counts)."""
    model = _model()
    ps = list(model.parameters())
    cfg = config(tmp_path, host=0, kernel="match")
    cfg["swap"]["durability"] = "crash_consistent"
    opt = torch.optim.AdamW(ps[4:], lr=1e-2)
    with tiermem.offload(opt, cfg, model=model) as tm:
        _trained(model, opt, 1)
        tm.offloaded.keep_on_disk()
        tm.discard()
    for p in ps[:2]:
        p.requires_grad_(True)
    opt = torch.optim.AdamW([{"params": ps[4:]}, {"params": ps[:2]}], lr=1e-2)
    with pytest.raises(tiermem.TierMemError, match="cannot resume .* lays out"):
        with tiermem.offload(opt, cfg, model=model, resume=True):
            _trained(model, opt, 1)



@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("how", ["left", "by-hand"])
def test_a_frozen_parameter_holding_a_gradient_is_stepped_as_torch_does(
        tmp_path, how, overlap):
    """torch steps any parameter with a p.grad, frozen or not: a frozen one holding a
    gradient (left by a backward from before it was frozen, at the block's entry, or set
    by hand inside it before a forward) is laid out and stepped with the rest, bitwise as
    plain. With overlap_backward the step refused it only after backward had updated the
    other partitions (a partial step)."""
    model = _model()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    cfg = config(tmp_path, host="64KiB")
    cfg["pipeline"]["overlap_backward"] = overlap

    def give(m: torch.nn.Module) -> None:
        if how == "left":  # a backward, then the base frozen: its gradients stay
            for p in m.parameters():
                p.requires_grad_(True)
            m(X).square().mean().backward()
            for p in list(m.parameters())[:4]:
                p.requires_grad_(False)
        else:
            m[0].weight.grad = torch.full_like(m[0].weight, 1e-3)

    def steps(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        for _ in range(2):  # the frozen ones' gradients stay, and are stepped again
            m(X).square().mean().backward()
            o.step()
        o.zero_grad()
        _trained(m, o, 1)

    for m, o in ((ref, ref_opt), (model, opt)):
        if how == "left":
            give(m)
        with tiermem.offload(o, cfg, model=m) if m is model else contextlib.nullcontext():
            if how == "by-hand":
                give(m)
            steps(m, o)
    compare_runs(model, opt, ref, ref_opt)


def test_a_gradient_given_to_a_frozen_parameter_after_the_forward_is_refused_by_name(
        tmp_path):
    """overlap_backward lays a parameter out at the forward: one given a gradient after it
    has no record when backward has updated the others. Refused naming it and saying to
    give it before the forward (the message said to leave the block and enter a new one)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = config(tmp_path, host="64KiB")
    cfg["pipeline"]["overlap_backward"] = True
    cfg["swap"]["durability"] = "crash_consistent"  # (the step is rolled back)
    with tiermem.offload(opt, cfg, model=model):
        model(X).square().mean().backward()
        model[0].weight.grad = torch.ones_like(model[0].weight)
        with pytest.raises(tiermem.TierMemError,
                           match="0.weight has a gradient but no optimizer record.*before the "
                                 "forward"):
            opt.step()
