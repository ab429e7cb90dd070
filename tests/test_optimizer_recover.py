"""`tiermem recover`: the committed state of a crash-consistent run, read from the swap
files alone, is the plain optimizer's state_dict (step counts, per-parameter scalars,
state tensors, weights), and a plain optimizer loaded from it keeps stepping as an
uninterrupted run: torch's elementwise optimizers, and the whole-parameter rules and the
generic path's optimizers, whose layout (shapes, dtypes, memory order, containers) the
manifest keeps. State only the optimizer's own program can make again (a tensor subclass)
is refused with a clear error."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from tiermem.errors import TierMemError
from tiermem.optim.rules import AdamRule
from tiermem.optim.rules.torch_family import TORCH_RULES
from tiermem.swap import recover as rec

from offload_helpers import Synthetic, config, make_batches, swap_dir, train
from test_optimizer_rules import (GlobalStep, SelfCounted, kept_on_disk, load, lowbit_pair,
                                  lowbit_train, pair, params_equal, params_for, state_equal)


def test_recover_knows_every_elementwise_rule():
    rules = (AdamRule, *TORCH_RULES)
    assert rec.ELEMENTWISE_RULES == {r.__name__ for r in rules}
    assert rec.NO_STEP_RULES == {r.__name__ for r in rules if not r.has_step}
    assert set(rec.EAGER_RULES) == {r.__name__ for r in rules if r.eager_state}


def _kept_run(tmp_path, monkeypatch, cls, kw, steps, dtype=torch.float32):
    model = Synthetic().to(dtype)
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    batches = make_batches(model, steps + 2)
    c = config(tmp_path, host="64KiB")
    c["swap"]["durability"] = "crash_consistent"
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            train(model, opt, batches[:steps])
    monkeypatch.undo()
    return model, ref, ref_opt, batches


@pytest.mark.parametrize("cls, kw", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.05)),
    (torch.optim.Adagrad, dict(lr=0.05, initial_accumulator_value=0.1)),
    (torch.optim.ASGD, dict(lr=0.01, t0=1)),
    (torch.optim.NAdam, dict(lr=0.01)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    (torch.optim.Rprop, dict(lr=0.01)),  # tuples (etas, step_sizes) in its groups
])
def test_recover_equals_the_plain_optimizer(tmp_path, monkeypatch, cls, kw):
    steps = 3
    model, ref, ref_opt, batches = _kept_run(tmp_path, monkeypatch, cls, kw, steps)
    ckpt = torch.load(rec.recover(str(swap_dir(tmp_path)), str(tmp_path / "r.pt"))["path"])
    assert ckpt["step"] == steps
    train(ref, ref_opt, batches[:steps])
    # weights: committed with the state (crash-consistent records hold every weight)
    fresh = Synthetic()
    fresh.load_state_dict(ckpt["model"])
    params_equal(fresh, ref, "recovered weights")
    plain = cls(fresh.parameters(), **kw)
    plain.load_state_dict(ckpt["optimizer"])
    state_equal(plain.state_dict(), ref_opt.state_dict(), "recovered state")
    # the groups as torch's state_dict has them, tuples included (== tells a list apart)
    assert ckpt["optimizer"]["param_groups"] == ref_opt.state_dict()["param_groups"]
    train(fresh, plain, batches[steps:], start=steps)
    train(ref, ref_opt, batches[steps:], start=steps)
    params_equal(fresh, ref, "stepping on from the recovered checkpoint")


def test_recover_adagrad_never_stepped_parameters(tmp_path, monkeypatch):
    """Adagrad builds every parameter's state when made: one never stepped (the side
    branch without gradients in the first step) recovers at its starting accumulator."""
    kw = dict(lr=0.05, initial_accumulator_value=0.25)
    model, ref, ref_opt, batches = _kept_run(tmp_path, monkeypatch, torch.optim.Adagrad, kw, 1)
    ckpt = rec.gather(str(swap_dir(tmp_path)))
    train(ref, ref_opt, batches[:1])
    state_equal(ckpt["optimizer"], ref_opt.state_dict(), "recovered after one step")


@pytest.mark.parametrize("cls, kw", [
    (torch.optim.Adafactor, {}),  # row and column statistics: shapes other than the param's
    (torch.optim.Muon, {}),
    (GlobalStep, {}),  # a count in state["global_step"], under no parameter
    (SelfCounted, {}),  # counts and a list on the optimizer itself
    (("torch_optimizer", "AggMo"), dict(lr=1e-3)),  # a momentum per beta, in a dict
    (("pytorch_optimizer", "MADGRAD"), dict(lr=1e-3)),  # state["k"], a 1-element tensor
    (("pytorch_optimizer", "EmoNavi"), dict(lr=1e-3)),  # a dict of floats in state["ema"]
    # column-major eigenbases (their memory order) and lists of matrices per side
    (("pytorch_optimizer", "SOAP"), dict(lr=1e-3, precondition_frequency=2)),
    (("bitsandbytes.optim", "AdamW8bit"), dict(lr=1e-3, min_8bit_size=1024)),  # uint8 codes
    # a cache of [step, N_sma, step_size] lists in its group, rewritten by its step
    (("torch_optimizer", "RAdam"), dict(lr=1e-3)),
], ids=lambda v: getattr(v, "__name__", None) or (v[1] if isinstance(v, tuple) else None))
def test_recover_whole_parameter_and_generic_runs(tmp_path, monkeypatch, cls, kw):
    """The recovered checkpoint is the plain optimizer's state_dict() at the committed step
    (every tensor in its shape, dtype and memory order, containers rebuilt), the model's
    weights, and the values the optimizer keeps on itself; a plain optimizer and model
    loaded from it step on as the uninterrupted run."""
    if isinstance(cls, tuple):
        cls = load(*cls)
    model, opt, ref, ref_opt = pair(cls, kw)
    batches = make_batches(model, 5)
    kept_on_disk(tmp_path, monkeypatch, model, opt, batches[:3])
    ckpt = torch.load(rec.recover(str(swap_dir(tmp_path)), str(tmp_path / "r.pt"))["path"],
                      weights_only=False)
    train(ref, ref_opt, batches[:3])
    # torch's own packing of the state (bitsandbytes' state_dict() packs its 8-bit state
    # its own way, and its load_state_dict() takes torch's too, as stepping on checks)
    ref_sd = torch.optim.Optimizer.state_dict(ref_opt)
    # what the first step sets and no later one changes is not kept (the loaded optimizer's
    # first step makes it again, as a resumed one's does; stepping on below checks that):
    # EmoNavi's loss averages, which stay as made without a closure's loss
    made_again = {k for k in ref_sd["state"] if k not in ckpt["optimizer"]["state"]}
    assert made_again == ({"ema"} if cls.__name__ == "EmoNavi" else set())
    ref_sd["state"] = {k: v for k, v in ref_sd["state"].items() if k not in made_again}
    state_equal(ckpt["optimizer"], ref_sd, "recovered state")
    for i, st in ref_sd["state"].items():
        for k, v in st.items() if isinstance(i, int) else ():
            if isinstance(v, torch.Tensor) and v.dim() > 1:  # the memory order, too
                assert ckpt["optimizer"]["state"][i][k].stride() == v.stride(), (i, k)
    attrs = {k: v for k, v in vars(ref_opt).items() if k in ckpt["optimizer_attributes"]}
    assert ckpt["optimizer_attributes"] == attrs
    if cls is SelfCounted:
        assert set(attrs) == {"t", "current_lr", "lrs"}
    fresh = copy.deepcopy(model)
    got = fresh.load_state_dict(ckpt["model"], strict=False)  # Muon: the matrices only
    stepped = {id(p) for p in params_for(cls, model)}
    assert set(got.missing_keys) == {n for n, p in model.named_parameters()
                                     if id(p) not in stepped}
    assert not got.unexpected_keys
    params_equal(fresh, ref, "recovered weights")
    # the groups as the plain state_dict has them (a tuple where it has one, a list where
    # it has a list)
    assert ckpt["optimizer"]["param_groups"] == ref_sd["param_groups"]
    plain = cls(params_for(cls, fresh), **kw)
    plain.load_state_dict(ckpt["optimizer"])
    for k, v in ckpt["optimizer_attributes"].items():
        setattr(plain, k, copy.deepcopy(v))
    train(fresh, plain, batches[3:], start=3)
    train(ref, ref_opt, batches[3:], start=3)
    params_equal(fresh, ref, "stepping on from the recovered checkpoint")
    state_equal(torch.optim.Optimizer.state_dict(plain),
                torch.optim.Optimizer.state_dict(ref_opt), "stepping on")


def test_recover_bf16_model_of_a_whole_parameter_rule(tmp_path, monkeypatch):
    """A bf16 model's records keep the fp32 master: the checkpoint's "model" holds it (in
    fp32) and each parameter's state its "master_param", as state_dict() gives them."""
    model = Synthetic().to(torch.bfloat16)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    batches = make_batches(model, 3)
    c = config(tmp_path, host="64KiB")
    c["swap"]["durability"] = "crash_consistent"
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            train(model, opt, batches)
            sd = copy.deepcopy(opt.state_dict())
            monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    monkeypatch.undo()
    ckpt = rec.gather(str(swap_dir(tmp_path)))
    state_equal(ckpt["optimizer"], {**sd, "state": {
        i: {k: v for k, v in st.items() if k != "master_param"}
        for i, st in sd["state"].items()}}, "recovered")
    for i, st in sd["state"].items():
        assert torch.equal(ckpt["optimizer"]["state"][i]["master_param"], st["master_param"])
    names = [n for n, _ in model.named_parameters()]
    for i, n in enumerate(names):
        assert torch.equal(ckpt["model"][n], sd["state"][i]["master_param"]), n


def test_recover_refuses_tensor_subclass_state(tmp_path, monkeypatch):
    """torchao's low-bit state is a tensor subclass that only its own program makes again:
    recover names it and refuses, rather than writing its parts as if they were the state."""
    cls, model, opt, _, _ = lowbit_pair("AdamW8bit")
    c = config(tmp_path, host=0)
    c["swap"]["durability"] = "crash_consistent"
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            lowbit_train(model, opt, [torch.randn(16, 256)])
    with pytest.raises(TierMemError, match=r"cannot recover .*'exp_avg'.* tensor subclass"):
        rec.gather(str(swap_dir(tmp_path)))


def test_recover_refuses_a_group_value_kept_only_as_a_digest(tmp_path, monkeypatch):
    """A value the manifest could keep only as its digest cannot be recovered: named and
    refused, never written as its text."""
    m = Synthetic()
    opt = SelfCounted(m.parameters())
    kept_on_disk(tmp_path, monkeypatch, m, opt, make_batches(m, 2))
    run = swap_dir(tmp_path)
    from tiermem.swap.manifest import read_manifest, write_manifest
    man = read_manifest(str(run), None)
    man.values["groups"] = {"0": {"schedule": {"unkept": "<object>", "digest": "0" * 32}}}
    write_manifest(str(run), man)
    with pytest.raises(TierMemError, match=r"param_groups\[0\]\['schedule'\] was <object>"):
        rec.gather(str(run))


def test_recover_cli_names_the_values_kept_on_the_optimizer(tmp_path, monkeypatch, capsys):
    """`tiermem recover` says which values the checkpoint holds beside the state_dict (they
    belong on the optimizer the user loads it into)."""
    import tiermem.tools.cli

    model = Synthetic()
    opt = SelfCounted(model.parameters())
    kept_on_disk(tmp_path, monkeypatch, model, opt, make_batches(model, 2))
    capsys.readouterr()
    out = tmp_path / "r.pt"
    assert tiermem.tools.cli.main(["recover", str(swap_dir(tmp_path)), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "under 'optimizer_attributes'" in said and "current_lr, lrs, t" in said, said
    assert torch.load(out, weights_only=False)["optimizer_attributes"]["t"] == 2
