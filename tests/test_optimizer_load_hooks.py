"""The optimizer's load_state_dict hooks under tiermem, as torch runs them.

torch's load_state_dict runs each pre-hook on the state dict (a hook may return the one
to load instead: a migration that renames or rescales state) and the post-hooks once the
state is loaded. tiermem reads the per-parameter entries into its records itself, so it
must read them from what the pre-hooks return, and run each hook once. Table-driven over
optimizers, state on NVMe, both I/O backends; the reference is the plain optimizer with
the same hooks.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import tiermem

from offload_helpers import (Synthetic, available_backends, compare_runs, compare_state_dicts,
                             config,
                             make_batches, train)

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.01), "exp_avg"),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9), "momentum_buffer"),
    "adafactor": (torch.optim.Adafactor, dict(lr=0.01), "row_var"),
}


def _run(cls, kw, key, swap, backend):
    model = Synthetic()
    opt = cls(model.parameters(), **kw)
    calls = []

    def pre(o, sd):
        calls.append("pre")
        sd = copy.deepcopy(sd)
        for st in sd["state"].values():
            if key in st:
                st[key] = st[key] * 0.5  # what a migration of old checkpoints might do
        return sd

    def post(o):
        calls.append("post")
        # the post-hook sees the loaded state, as after torch's load
        calls.append(sorted(len(st) for st in o.state_dict()["state"].values())[:1])

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(post)
    batches = make_batches(model, 4, seed=5)
    ctx = (tiermem.offload(opt, config(swap, backend=backend)) if swap is not None
           else contextlib.nullcontext())
    with ctx:
        train(model, opt, batches[:2])
        opt.load_state_dict(opt.state_dict())
        train(model, opt, batches[2:], start=2)
    return model, opt, calls


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_load_state_dict_hooks_run_as_torch_runs_them(tmp_path, backend, name):
    cls, kw, key = OPTIMIZERS[name]
    model, opt, calls = _run(cls, kw, key, tmp_path, backend)
    ref_model, ref_opt, ref_calls = _run(cls, kw, key, None, backend)
    assert calls == ref_calls  # each hook once, the post-hook after the state is loaded
    compare_runs(model, opt, ref_model, ref_opt)


def test_copying_the_optimizer_object_inside_the_block(tmp_path):
    """copy.deepcopy / torch.save of the optimizer object take torch's __getstate__
    (defaults, state, param_groups): inside the block the state is in the tiers, so such a
    copy would start it over; refused while the tiers hold state, and after the block the
    copy holds it all, as a plain optimizer's."""
    import io

    from tiermem.errors import TierMemError

    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.01)
    batches = make_batches(model, 2, seed=5)
    with tiermem.offload(opt, config(tmp_path)):
        assert len(copy.deepcopy(opt).state) == 0  # nothing held yet: as a plain one
        train(model, opt, batches)
        with pytest.raises(TierMemError, match="copy.deepcopy / pickle / torch.save"):
            copy.deepcopy(opt)
        with pytest.raises(TierMemError, match="copy.deepcopy / pickle / torch.save"):
            torch.save(opt, io.BytesIO())
    train(ref_model, ref_opt, batches)
    twin = copy.deepcopy(opt)
    ref_twin = copy.deepcopy(ref_opt)
    assert len(twin.state) == len(ref_twin.state) > 0
    compare_runs(model, opt, ref_model, ref_opt)


STATE_EDITS = {
    "assign": lambda opt, p: opt.state.__setitem__(p, {"momentum_buffer": torch.zeros_like(p)}),
    "assign-key": lambda opt, p: opt.state[p].__setitem__("momentum_buffer",
                                                          torch.zeros_like(p)),
    "in-place": lambda opt, p: opt.state[p]["momentum_buffer"].zero_(),
    "del": lambda opt, p: opt.state.__delitem__(p),
    "pop": lambda opt, p: opt.state.pop(p),
    "update": lambda opt, p: opt.state.update({p: {}}),
    "setdefault": lambda opt, p: opt.state.setdefault(p, {}),
    "clear": lambda opt, p: opt.state.clear(),
    # refused at the next step, before it changes anything
    "replace": lambda opt, p: (setattr(opt, "state", __import__("collections").defaultdict(
        dict)), opt.step()),
}


@pytest.mark.parametrize("edit", sorted(STATE_EDITS))
def test_edits_of_opt_state_inside_the_block_are_refused(tmp_path, edit):
    """opt.state holds none of the per-parameter state inside the block: a write there
    would be lost (measured: a momentum reset by assignment, or opt.state.clear(), left the
    tiered run different from its plain twin, no error), a read finds nothing. Refused,
    nothing changed; the reset the message names equals the plain opt.state.clear()."""
    from tiermem.errors import TierMemError

    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    batches = make_batches(model, 4, seed=5)
    with tiermem.offload(opt, config(tmp_path)):
        train(model, opt, batches[:2])
        before = opt.state_dict()
        with pytest.raises(TierMemError, match="the per-parameter optimizer state is in"):
            STATE_EDITS[edit](opt, model.fc1.weight)
        compare_state_dicts(opt.state_dict(), before)
        assert "k" not in opt.state and opt.state.get(model.fc1.weight) is None
        opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"]})
        train(model, opt, batches[2:], start=2)
    train(ref_model, ref_opt, batches[:2])
    ref_opt.state.clear()
    train(ref_model, ref_opt, batches[2:], start=2)
    compare_runs(model, opt, ref_model, ref_opt)
