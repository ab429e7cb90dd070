"""Parameters frozen when the block opens (requires_grad=False, no state yet: a LoRA run
handing the whole model to its optimizer) get no record, as a plain optimizer keeps no
state for them; the rest trains bitwise as plain. A frozen parameter unfrozen inside the
block is refused before anything of its step is applied (with overlap_backward, at the
forward), and so is a state_dict giving it state; crash-consistent commits, resume and
`tiermem recover` work on the records there are."""

from __future__ import annotations

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
def test_frozen_parameters_take_no_record_and_an_unfrozen_one_is_refused(
        tmp_path, backend, durability, overlap, name):
    make = OPTIMIZERS[name]
    model = _model()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    _trained(ref, ref_opt)
    cfg = config(tmp_path, backend=backend, host="64KiB", kernel="match")
    cfg["swap"]["durability"] = durability
    cfg["pipeline"]["overlap_backward"] = overlap
    with tiermem.offload(opt, cfg, model=model) as tm:
        laid = {s.param for part in tm.offloaded.parts for s in part.segments}
        assert laid == {p for p in model.parameters() if p.requires_grad}
        _trained(model, opt)
        model[0].weight.requires_grad_(True)
        with pytest.raises(tiermem.TierMemError, match="0.weight .*requires_grad=False"):
            model(X).square().mean().backward()  # with overlap_backward: at the forward
            opt.step()
        opt.zero_grad()
        model[0].weight.requires_grad_(False)
    # nothing of the refused step was applied, crash-consistent or not
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_a_state_dict_with_state_for_a_frozen_parameter_is_refused(tmp_path, backend):
    model = _model()
    src = copy.deepcopy(model)
    for p in src.parameters():
        p.requires_grad_(True)
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    _trained(src, src_opt, 1)  # state for every parameter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tiermem.offload(opt, config(tmp_path, backend=backend, host=0), model=model):
        with pytest.raises(tiermem.TierMemError, match="has state in the state_dict loaded"):
            opt.load_state_dict(src_opt.state_dict())
    # loaded before the block, that state is laid out, frozen or not
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(src_opt.state_dict())
    with tiermem.offload(opt, config(tmp_path, backend=backend, host=0), model=model) as tm:
        assert len({s.param for part in tm.offloaded.parts for s in part.segments}) == 6


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
