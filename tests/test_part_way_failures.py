"""Operations inside the block that fail part-way: optimizer.load_state_dict() and the
optimizer's own state methods (schedule-free's train()/eval()).

Each runs partition by partition, so a failure in the middle (an I/O error on a record)
leaves some partitions changed and the rest not. Nothing may step or read that state as
either (never silently wrong).

- A load replaces the groups, the step counts and every record. The step, state_dict() and
  the exit refuse the mix, naming the failed load, until a load succeeds, which replaces
  all of it. The model here has a parameter frozen when the block opened, so the load also
  lays records out late (the case where a failed load followed by a failed step used to
  leave the optimizer broken).
- A state method swaps weights and state. crash_consistent rolls back to the last commit
  as a failed step does; scratch keeps no copy to go back to, so the state is unusable
  from then on, and says so."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import tiermem
import tiermem.optim.offloaded
from offload_helpers import backend_params, compare_runs, config

X = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
DURABILITY = ["scratch", "crash_consistent"]


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    m[0].weight.requires_grad_(False)  # frozen when the block opens: no record
    return m


def _train(model, opt, steps=1):
    for _ in range(steps):
        model(X).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _source() -> dict:
    """A state dict with state for every parameter (the frozen one's too)."""
    src = _model()
    src[0].weight.requires_grad_(True)
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    _train(src, opt, 3)
    return opt.state_dict()


def _pair():
    """A source state dict, and the model and AdamW to offload beside their plain copies."""
    model = _model()
    ref = copy.deepcopy(model)
    return (_source(), model, torch.optim.AdamW(model.parameters(), lr=1e-2), ref,
            torch.optim.AdamW(ref.parameters(), lr=1e-2))


def _half_scatter(monkeypatch):
    """The load's write of the records fails after the first half of the partitions."""
    real = tiermem.optim.offloaded.scatter

    def half(tiers, parts, keys, state):
        real(tiers, parts[: len(parts) // 2], keys, state)
        raise OSError("injected: writing a record failed")

    monkeypatch.setattr(tiermem.optim.offloaded, "scatter", half)


def _cfg(tmp_path, backend, durability):
    cfg = config(tmp_path, backend=backend, host=0, kernel="match")
    cfg["swap"]["durability"] = durability
    return cfg


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("durability", DURABILITY)
def test_a_load_failing_part_way_is_refused_until_a_load_succeeds(tmp_path, monkeypatch,
                                                                  backend, durability):
    """The step and state_dict() refuse the half-loaded state, naming the load; a load that
    then succeeds goes on as the plain optimizer that loaded once, and a step failing after
    it (crash_consistent) rolls back to that load's commit, late records included."""
    sd, model, opt, ref, ref_opt = _pair()
    _train(ref, ref_opt, 2)
    ref_opt.load_state_dict(copy.deepcopy(sd))  # (torch's load steps sd's own tensors)
    ref[0].weight.requires_grad_(True)
    _train(ref, ref_opt, 2)
    with tiermem.offload(opt, _cfg(tmp_path, backend, durability), model=model) as tm:
        _train(model, opt, 2)
        with monkeypatch.context() as m:
            _half_scatter(m)
            with pytest.raises(OSError, match="injected") as raised:
                opt.load_state_dict(sd)
        assert any("failed part-way" in n for n in raised.value.__notes__)
        model(X).square().mean().backward()
        with pytest.raises(tiermem.TierMemError, match=r"load_state_dict\(\) failed part-way"):
            opt.step()
        with pytest.raises(tiermem.TierMemError, match=r"load_state_dict\(\) failed part-way"):
            opt.state_dict()
        opt.zero_grad()
        assert type(opt.state).__name__ == "HeldState"  # not taken for a replaced opt.state
        opt.load_state_dict(sd)  # succeeds: replaces all of it
        model[0].weight.requires_grad_(True)
        if durability == "crash_consistent":
            model(X).square().mean().backward()
            with monkeypatch.context() as m:
                m.setattr(tm.offloaded, "update", lambda *a, **k: (_ for _ in ()).throw(
                    OSError("injected: the step failed")))
                with pytest.raises(OSError, match="the step failed"):
                    opt.step()
            assert tm.offloaded.broken is None
            opt.zero_grad()
        _train(model, opt, 2)
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("durability", DURABILITY)
def test_a_block_left_after_a_load_failed_part_way(tmp_path, monkeypatch, durability):
    """Leaving the block with the load still half done hands nothing back: the last commit
    stays on disk to resume (crash_consistent), or the state is gone and opt.step() says so
    (scratch), rather than the mixed state reaching opt.state or a manifest."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, 3)
    cfg = _cfg(tmp_path, "threads", durability)
    with pytest.warns(tiermem.TierMemWarning, match="failed part-way"):
        with tiermem.offload(opt, cfg, model=model):
            _train(model, opt, 2)
            with monkeypatch.context() as m:
                _half_scatter(m)
                with pytest.raises(OSError, match="injected"):
                    opt.load_state_dict(_source())
    assert not opt.state
    if durability == "scratch":
        with pytest.raises(tiermem.TierMemError, match="state is lost"):
            opt.step()
        return
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == 2
        _train(model, opt)
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("durability", DURABILITY)
def test_a_state_method_failing_part_way(tmp_path, monkeypatch, durability):
    """schedule-free's eval() failing on its second partition: crash_consistent goes on
    from the last commit, bitwise the plain run that never called it; scratch refuses
    every later use, naming it (before, both went on with half the weights swapped)."""
    schedulefree = pytest.importorskip("schedulefree")

    def make(m):
        return schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2, warmup_steps=2)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 8))
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref)
    ref_opt.train()
    _train(ref, ref_opt, 3)
    cfg = _cfg(tmp_path, "threads", durability)
    with pytest.warns(tiermem.TierMemWarning) if durability == "scratch" else \
            contextlib.nullcontext():
        with tiermem.offload(opt, cfg, model=model) as tm:
            opt.train()
            _train(model, opt, 2)
            off = tm.offloaded
            assert len(off.parts) >= 2
            real, calls = off.rule.run_method, []

            def second_fails(name, batch):
                calls.append(name)
                if len(calls) == 2:
                    raise OSError("injected: reading a record failed")
                return real(name, batch)

            with monkeypatch.context() as m:
                m.setattr(off.rule, "run_method", second_fails)
                with pytest.raises(OSError, match="injected") as raised:
                    opt.eval()
            if durability == "scratch":
                for call in (opt.train, opt.step, opt.state_dict):
                    with pytest.raises(tiermem.TierMemError, match=r"eval\(\) failed part-way"):
                        call()
            else:
                opt.train()
                _train(model, opt)
    notes = "".join(getattr(raised.value, "__notes__", []))
    if durability == "scratch":
        with pytest.raises(tiermem.TierMemError, match="state is lost"):
            opt.step()
        assert "eval() failed part-way" in notes
        return
    compare_runs(model, opt, ref, ref_opt)
    assert "eval() failed part-way; the optimizer state and the model's weights were rolled " \
        "back to committed step 2" in notes


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("where, half", [("before", False), ("after", True)])
def test_a_load_the_optimizer_class_refuses(tmp_path, monkeypatch, backend, where, half):
    """The optimizer class's own load_state_dict raising: before it changed anything (its
    own checks), the state is as it was and training goes on, bitwise the plain run that
    never loaded; after torch's load put the groups in place, it is half-loaded."""
    sd, model, opt, ref, ref_opt = _pair()
    _train(ref, ref_opt, 4)
    real = torch.optim.AdamW.load_state_dict

    def refusing(self, state_dict):
        if where == "before":
            raise ValueError("injected: the class refused the state dict")
        real(self, state_dict)
        raise ValueError("injected: the class refused the state dict")

    with tiermem.offload(opt, _cfg(tmp_path, backend, "crash_consistent"), model=model) as tm:
        _train(model, opt, 2)
        with monkeypatch.context() as m:
            m.setattr(torch.optim.AdamW, "load_state_dict", refusing)
            with pytest.raises(ValueError, match="injected") as raised:
                opt.load_state_dict(sd)
        notes = "".join(raised.value.__notes__)
        assert ("failed part-way" in notes) == half
        assert ("the load changed nothing" in notes) == (not half)
        assert bool(tm.offloaded.half_loaded) == half
        if half:
            with pytest.raises(tiermem.TierMemError, match="failed part-way"):
                opt.state_dict()
            return
        _train(model, opt, 2)
    compare_runs(model, opt, ref, ref_opt)
