"""Where a tiermem run's state could differ from the plain torch run's without an error:
Adagrad's never-stepped parameters (state torch makes in __init__ from the optimizer's
defaults, none for a group added later), state keys an optimizer does not use but torch
keeps, and a crash-consistent run with several swap paths moved elsewhere. Each compares
against the plain torch optimizer (or asserts the clear refusal)."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

import tiermem
from tiermem.errors import TierMemError
from tiermem.swap import recover as rec
from tiermem.swap.manifest import MANIFEST, encode

import tiermem.tools.cli
from crash_run import crash_config, make_model, make_optimizer, set_grads
from offload_helpers import Synthetic, backend_params, config, make_batches, swap_dir, train
from test_optimizer_rules import params_equal, state_equal


def small() -> Synthetic:
    return Synthetic(vocab=61, dim=7, hidden=29, out=5)


def side_group(m: Synthetic, **kw) -> dict:
    return {"params": [m.side.weight, m.side.bias], **kw}


def main_params(m: Synthetic) -> list:
    return [m.emb.weight, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]


ADAGRAD = dict(lr=0.05, initial_accumulator_value=0.25)


def _trained_alike(model, opt, ref, ref_opt, batches, what: str) -> None:
    """Both sides trained on `batches`: weights (`what`) and state_dicts equal after."""
    train(model, opt, batches)
    train(ref, ref_opt, batches)
    params_equal(model, ref, what)
    state_equal(opt.state_dict(), ref_opt.state_dict(), "after two steps")


def crash_cfg(tmp_path, backend="threads") -> dict:
    c = config(tmp_path, backend=backend)
    c["swap"]["durability"] = "crash_consistent"
    return c


def kept(tmp_path, monkeypatch, opt, model, body, backend="threads") -> dict:
    """Run `body` in a crash-consistent block whose state stays on disk at exit."""
    c = crash_cfg(tmp_path, backend)
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            body()
    monkeypatch.undo()
    return c


# -- 1, 2: Adagrad's never-stepped parameters --------------------------------------------


@pytest.mark.parametrize("how", ["no_grad", "frozen"])
def test_recover_fills_adagrad_from_the_defaults_not_the_group(tmp_path, monkeypatch, how):
    """torch's Adagrad fills every accumulator in __init__ from the constructor's
    initial_accumulator_value; a group's own value does not reach it. The side group (its
    own value 0.7) never steps: recover must give 0.25 there, as torch's state_dict does."""
    model = small()
    ref = copy.deepcopy(model)
    if how == "frozen":
        for m in (model, ref):
            m.side.requires_grad_(False)
    opt = torch.optim.Adagrad([{"params": main_params(model)},
                               side_group(model, initial_accumulator_value=0.7)], **ADAGRAD)
    ref_opt = torch.optim.Adagrad([{"params": main_params(ref)},
                                   side_group(ref, initial_accumulator_value=0.7)], **ADAGRAD)
    batches = make_batches(model, 3)
    kept(tmp_path, monkeypatch, opt, model, lambda: train(model, opt, batches[:1]))
    train(ref, ref_opt, batches[:1])  # step 0 leaves the side branch without gradients
    ckpt = rec.gather(str(swap_dir(tmp_path)))
    assert float(ckpt["optimizer"]["state"][5]["sum"][0, 0]) == 0.25
    state_equal(ckpt["optimizer"], ref_opt.state_dict(), "recovered")
    # and a plain optimizer loaded from it steps on as the uninterrupted run
    fresh = small()
    fresh.load_state_dict(ckpt["model"])
    if how == "frozen":
        fresh.side.requires_grad_(False)
    plain = torch.optim.Adagrad([{"params": main_params(fresh)},
                                 side_group(fresh, initial_accumulator_value=0.7)], **ADAGRAD)
    plain.load_state_dict(ckpt["optimizer"])
    train(fresh, plain, batches[1:], start=1)
    train(ref, ref_opt, batches[1:], start=1)
    params_equal(fresh, ref, "stepped on from the recovered checkpoint")


@pytest.mark.parametrize("added", ["before_entry", "inside"])
def test_adagrad_group_added_later_has_no_state_until_it_steps(tmp_path, monkeypatch, added):
    """torch's Adagrad makes state in __init__ only: a group added by add_param_group has
    no state_dict entry until its first step, which fills it from the defaults. tiermem's
    state_dict (inside the block), recover and the state handed back at exit must say the
    same, and its first step must start where torch's does."""
    model = small()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adagrad(main_params(model), **ADAGRAD)
    ref_opt = torch.optim.Adagrad(main_params(ref), **ADAGRAD)
    ref_opt.add_param_group(side_group(ref, initial_accumulator_value=0.7))
    if added == "before_entry":
        opt.add_param_group(side_group(model, initial_accumulator_value=0.7))
    batches = make_batches(model, 2)
    seen = {}

    def body():
        if added == "inside":
            opt.add_param_group(side_group(model, initial_accumulator_value=0.7))
        train(model, opt, batches[:1])
        seen["sd"] = opt.state_dict()
        seen["held"] = bool(opt.state)

    kept(tmp_path, monkeypatch, opt, model, body)
    train(ref, ref_opt, batches[:1])
    want = ref_opt.state_dict()
    assert 5 not in want["state"]
    state_equal(seen["sd"], want, "state_dict inside the block")
    assert seen["held"]
    state_equal(rec.gather(str(swap_dir(tmp_path)))["optimizer"], want, "recovered")
    # resumed (the manifest says which have no state), stepped with the side branch, and
    # handed back at exit: as the plain run
    c = crash_cfg(tmp_path)
    opt2 = torch.optim.Adagrad(main_params(model), **ADAGRAD)
    opt2.add_param_group(side_group(model, initial_accumulator_value=0.7))
    with tiermem.offload(opt2, c, model=model, resume=True):
        state_equal(opt2.state_dict(), want, "state_dict after resume")
        train(model, opt2, batches[1:], start=1)
    train(ref, ref_opt, batches[1:], start=1)
    params_equal(model, ref, "after the side group's first step")
    state_equal(opt2.state_dict(), ref_opt.state_dict(), "handed back at exit")


def test_adagrad_loaded_never_stepped_accumulator_is_kept(tmp_path):
    """A state_dict whose never-stepped accumulator is not this optimizer's default (saved
    by an Adagrad made with another initial_accumulator_value): torch keeps and starts from
    it, and returns nothing for a parameter the state_dict leaves out."""
    model = small()
    ref = copy.deepcopy(model)
    saved = torch.optim.Adagrad(copy.deepcopy(model).parameters(), lr=0.05,
                                initial_accumulator_value=0.6).state_dict()
    del saved["state"][0]  # torch then holds no state for parameter 0 until it steps
    opt = torch.optim.Adagrad(model.parameters(), **ADAGRAD)
    ref_opt = torch.optim.Adagrad(ref.parameters(), **ADAGRAD)
    ref_opt.load_state_dict(saved)
    batches = make_batches(model, 2)
    with tiermem.offload(opt, config(tmp_path),
                         model=model):
        opt.load_state_dict(saved)
        state_equal(opt.state_dict(), ref_opt.state_dict(), "loaded")
        _trained_alike(model, opt, ref, ref_opt, batches, "stepped from the loaded accumulators")


@pytest.mark.parametrize("where", ["loaded", "held_at_entry", "recovered"])
def test_a_never_stepped_entry_of_a_lazy_rule_is_kept_and_started_from(tmp_path, monkeypatch,
                                                                        where):
    """An entry with step 0 of an optimizer that makes its state at the first step
    (Rprop: its step sizes start at lr there): torch holds it, hands it back, and its first
    step starts from it (len(state) != 0), not from the fill. tiermem must do the same,
    whether the entry is loaded inside the block or held by the optimizer at entry, and
    recover must give it from the records of a crash-consistent run."""
    model = small()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.Rprop(m.parameters(), lr=0.01)  # noqa: E731
    saved = make(copy.deepcopy(model)).state_dict()
    saved["state"] = {i: {"step": torch.tensor(0.0), "prev": torch.zeros_like(p),
                          "step_size": torch.full_like(p, 0.003 * (i + 1))}
                      for i, p in enumerate(model.parameters()) if i != 2}
    opt, ref_opt = make(model), make(ref)
    ref_opt.load_state_dict(saved)
    if where == "held_at_entry":
        opt.load_state_dict(saved)
    batches = make_batches(model, 2)
    if where == "recovered":
        kept(tmp_path, monkeypatch, opt, model, lambda: opt.load_state_dict(saved))
        state_equal(rec.gather(str(swap_dir(tmp_path)))["optimizer"], ref_opt.state_dict(),
                    "recovered")
        return
    with tiermem.offload(opt, config(tmp_path), model=model):
        if where == "loaded":
            opt.load_state_dict(saved)
        state_equal(opt.state_dict(), ref_opt.state_dict(), "before a step")
        _trained_alike(model, opt, ref, ref_opt, batches, "stepped from the entries of step 0")


def test_version_3_manifest_still_resumes_and_recover_refuses_what_it_lacks(
        tmp_path, monkeypatch):
    """A manifest of the previous version (no defaults, no stateless list) resumes; recover
    of a never-stepped Adagrad parameter, whose starting value only the defaults give,
    is refused naming the version, not filled from the group."""
    model = small()
    opt = torch.optim.Adagrad([{"params": main_params(model)},
                               side_group(model, initial_accumulator_value=0.7)], **ADAGRAD)
    batches = make_batches(model, 2)
    c = kept(tmp_path, monkeypatch, opt, model, lambda: train(model, opt, batches[:1]))
    run_dir = str(swap_dir(tmp_path))
    path = os.path.join(run_dir, MANIFEST)
    with open(path, "rb") as f:
        body = json.loads(f.read())
    assert body["version"] == 4 and body["defaults"]["initial_accumulator_value"] == 0.25
    for k in ("defaults", "stateless", "unstepped_state", "late", "crc32c"):
        body.pop(k)
    body["version"] = 3
    with open(path, "wb") as f:
        f.write(encode(body))
    with pytest.raises(TierMemError, match="initial_accumulator_value.*version 3"):
        rec.gather(run_dir)
    opt2 = torch.optim.Adagrad([{"params": main_params(model)},
                                side_group(model, initial_accumulator_value=0.7)], **ADAGRAD)
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt2, c, model=model, resume=True) as tm:
            assert tm.resumed_step == 1
            assert float(opt2.state_dict()["state"][5]["sum"][0, 0]) == 0.25
            train(model, opt2, batches[1:], start=2)  # the side group still never steps
    monkeypatch.undo()
    # which parameters hold state is still not known: its commits stay version 3
    with open(path, "rb") as f:
        assert json.loads(f.read())["version"] == 3
    with pytest.raises(TierMemError, match="initial_accumulator_value.*version 3"):
        rec.gather(run_dir)


# -- 3: state keys the optimizer does not use ---------------------------------------------


def _with_extra(cls, kw, key):
    """A state_dict of `cls` after one step, each parameter's entry with `key` added (an
    amsgrad run's max_exp_avg_sq in an Adam one without amsgrad, ...), its lr changed."""
    model = small()
    opt = cls(model.parameters(), **kw)
    train(model, opt, make_batches(model, 1))
    sd = opt.state_dict()
    for st in sd["state"].values():
        st[key] = torch.tensor(7.0) if key == "step" else torch.full((3,), 0.5)
    sd["param_groups"][0]["lr"] = 0.125
    return sd


EXTRA = [(torch.optim.Adam, dict(lr=1e-2), "max_exp_avg_sq"),
         (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True), "something_else"),
         (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), "step"),  # SGD keeps no step
         (torch.optim.Adagrad, dict(lr=1e-2), "max_exp_avg_sq")]


@pytest.mark.parametrize("cls, kw, key", EXTRA)
def test_a_state_key_torch_keeps_unused_is_refused_not_dropped(tmp_path, cls, kw, key):
    """torch keeps a loaded key its step does not use and returns it from state_dict();
    tiermem keeps only what it steps, so it refuses such a state_dict (loaded inside the
    block: before anything changes; held at entry: the block is not entered and the state
    stays in the optimizer) rather than drop the key silently."""
    saved = _with_extra(cls, kw, key)
    ref = cls(small().parameters(), **kw)
    ref.load_state_dict(copy.deepcopy(saved))
    assert key in ref.state_dict()["state"][0]  # what torch does
    model = small()
    opt = cls(model.parameters(), **kw)
    with tiermem.offload(opt, config(tmp_path), model=model):
        with pytest.raises(TierMemError, match=f"{key}.*parameter 0 \\(emb.weight\\)"):
            opt.load_state_dict(copy.deepcopy(saved))
        assert opt.param_groups[0]["lr"] == kw["lr"]  # nothing of it was loaded
    opt.load_state_dict(copy.deepcopy(saved))  # plain torch, outside the block
    with pytest.raises(TierMemError, match=f"{key}.*st.pop"):
        with tiermem.offload(opt, config(tmp_path), model=model):
            pass
    assert key in opt.state_dict()["state"][0]  # still there, not lost


# -- 4: a run with several swap paths, moved ---------------------------------------------


def _two_path_run(monkeypatch, paths, backend, steps, resume=False):
    """Crash-consistent AdamW over two swap paths, `steps` more steps, its state kept on
    disk at exit (as a crash leaves it); returns the state_dict at the last step."""
    cfg = crash_config(paths[0], backend)
    cfg["swap"]["paths"] = [str(p) for p in paths]
    cfg["swap"]["checksums"] = False  # nothing in a record then tells an older copy apart
    model = make_model()
    opt = make_optimizer(model)
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, cfg, model=model, resume=resume) as tm:
            start = tm.resumed_step or 0
            for k in range(start + 1, start + 1 + steps):
                set_grads(model, k)
                opt.step()
            sd = opt.state_dict()
    monkeypatch.undo()
    return sd, cfg


def _resume(cfg, paths):
    cfg = {**cfg, "swap": {**cfg["swap"], "paths": [str(p) for p in paths]}}
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        sd, step = opt.state_dict(), tm.resumed_step
        tm.discard()
    return sd, step


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("old", ["removed", "older"])
def test_moved_two_path_run_needs_every_path_given(tmp_path, monkeypatch, backend, old):
    """A run over swap paths a and b, copied to n/a and n/b at step 4; at the old places
    nothing (removed) or b as it was at step 2 (older). recover and resume read the moved
    run's b only where they are told it is now, never at its old place: without the new
    places recover refuses; told n/a and n/b, both give step 4."""
    src = [tmp_path / "a", tmp_path / "b"]
    _two_path_run(monkeypatch, src, backend, 2)
    shutil.copytree(src[1] / "tiermem-default", tmp_path / "b-at-2")
    want, cfg = _two_path_run(monkeypatch, src, backend, 2, resume=True)
    new = [tmp_path / "n" / "a", tmp_path / "n" / "b"]
    for s, n in zip(src, new):
        n.mkdir(parents=True, mode=0o700)
        shutil.copytree(s / "tiermem-default", n / "tiermem-default")
    if old == "removed":
        for s in src:
            shutil.rmtree(s)
    else:
        shutil.rmtree(src[1] / "tiermem-default")
        shutil.copytree(tmp_path / "b-at-2", src[1] / "tiermem-default")
    run_dir = str(new[0] / "tiermem-default")
    with pytest.raises(TierMemError, match="moved or copied since.*--swap-paths"):
        rec.gather(run_dir)
    ckpt = rec.gather(run_dir, swap_paths=[str(p) for p in new])
    assert ckpt["step"] == 4
    state_equal(ckpt["optimizer"], want, "recovered from the new places")
    if old == "older":
        # b's old place named: refused, for recover and for resume alike
        with pytest.raises(TierMemError, match="swap path 1 is still where"):
            rec.gather(run_dir, swap_paths=[str(new[0]), str(src[1])])
        with pytest.raises(TierMemError, match="swap path 1 is still where"):
            _resume(cfg, [new[0], src[1]])
    # the CLI's way to say where the paths are now
    out = tmp_path / "r.pt"
    assert tiermem.tools.cli.main(["recover", run_dir, "-o", str(out), "--swap-paths",
                                   *map(str, new)]) == 0
    state_equal(torch.load(out)["optimizer"], want, "recovered by the CLI")
    sd, step = _resume(cfg, new)  # (and discarded)
    assert step == 4
    state_equal(sd, want, "resumed from the new places")
