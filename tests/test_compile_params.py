"""torch.compile with the parameter tier (parameters.offload: host | nvme).

The tier's hooks are graph breaks: each module owning parameters is a graph of its own,
traced and run with its weights in place, and the tier's work runs eagerly between the
graphs (tiermem/params/compiled.py). aot_eager keeps eager's arithmetic, so the reference
is the eager plain run (for the test model, whose module boundaries split no sum of
gradients; else the plain model compiled module by module): losses and final weights
bitwise, with a window smaller than the model (weights released and read again during
forward and backward), and dynamo compiles nothing after the first step.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import tiermem
from tiermem.device.lanes import DeferredBackend
from tiermem.errors import TierMemError
from tiermem.params import compiled

from offload_helpers import backend_params
from test_params_parity import (V, Net, assert_same_model, batches, cfg, loss_of, make_opt,
                                plain_run, twins)

STEPS = 3
GRAPHS = 7  # the test model's graphs: embedding, layer_norm, linear x3 shapes, relu, add


def compiled_run(model, data, config, form: str = "whole", **offload_kw):
    """Train `model` compiled in `form` (whole: torch.compile(model); method:
    model.compile(); given: the OptimizedModule passed as model=; sub: one block only;
    backward: a compiled function of the loss and its backward) under the tier; the
    losses, tm.param_stats() and the graph count after each step."""
    torch._dynamo.reset()
    counters.clear()
    opt = make_opt(model)
    given = torch.compile(model, backend="aot_eager") if form == "given" else model
    if form == "sub":
        model.b1 = torch.compile(model.b1, backend="aot_eager")
    losses, graphs, frames = [], [], []
    with tiermem.offload(opt, config, model=given, **offload_kw) as tm:
        run = torch.compile(model, backend="aot_eager") if form == "whole" else given
        if form == "method":
            model.compile(backend="aot_eager")
        if form == "backward":
            def train(t, y):
                loss = loss_of(model, t, y)
                loss.backward()  # (a graph break: autograd's hooks run eagerly)
                return loss
            step = torch.compile(train, backend="aot_eager")
        for t, y in data:
            if form == "backward":
                loss = step(t, y)
            else:
                loss = F.cross_entropy(run(t).reshape(-1, V), y.reshape(-1))
                loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
            frames.append(counters["frames"]["total"])
        stats = tm.param_stats()
    if form == "sub":
        model.b1 = model.b1._orig_mod
    stats["frames"] = frames  # frames dynamo compiled (graphs, resumes, breaks) by each step
    return losses, stats, graphs


@pytest.mark.parametrize("offload, backend, overlap", [
    ("host", "threads", False),
    pytest.param("nvme", "io_uring", False, marks=backend_params()[0].marks),
    ("nvme", "threads", True),
    pytest.param("nvme", "io_uring", True, marks=backend_params()[0].marks),
])
def test_a_compiled_model_trains_as_the_plain_one(tmp_path, offload, backend, overlap):
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    config = cfg(tmp_path, offload=offload, backend=backend,
                 window="240KiB" if overlap else "176KiB")  # (the model: 244 KiB of records)
    config["pipeline"]["overlap_backward"] = overlap
    got, stats, graphs = compiled_run(model, data, config)
    assert got == want
    assert_same_model(ref, model)
    assert stats["evictions"] > 0 and stats["fetches"] > 0
    # the step's graphs: every module's forward, made in the first step, reused after
    assert graphs == [GRAPHS] * STEPS
    assert stats["frames"] == [stats["frames"][0]] * STEPS
    assert counters["stats"]["calls_captured"] == GRAPHS


def test_a_window_just_above_the_check_waits_for_an_update_in_backward(tmp_path, monkeypatch):
    """Compiled, with pipeline.overlap_backward and a window just above what the start-up
    check asks for (204 KiB here): a compiled module's backward unpacks all its saved
    weights at once, and may ask for room while every weight in the window is pinned, some
    by an update running during backward. It waits for that update to unpin them rather
    than raising that the window cannot hold them. Unpatched, that came in about a third
    of the runs; each update slowed by 10 ms here, every run (red without the wait)."""
    from tiermem.optim.rules.adam import AdamRule

    real = AdamRule.update

    def slow(self, batch, *, kernel):
        if threading.current_thread() is not threading.main_thread():  # during backward
            time.sleep(0.01)
        return real(self, batch, kernel=kernel)

    monkeypatch.setattr(AdamRule, "update", slow)
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    config = cfg(tmp_path, offload="nvme", backend="threads", window="208KiB")
    config["pipeline"]["overlap_backward"] = True
    got, _, _ = compiled_run(model, data, config)
    assert got == want
    assert_same_model(ref, model)


@pytest.mark.parametrize("form", ["method", "given", "sub", "backward"])
def test_other_forms_of_compile(tmp_path, form):
    ref, model = twins()
    data = batches(2)
    want, _ = plain_run(ref, data)
    got, stats, graphs = compiled_run(model, data, cfg(tmp_path, offload="nvme"), form)
    assert got == want
    assert_same_model(ref, model)
    # a block compiled alone: no embedding, no head; a compiled loss: the loss's graph too
    assert graphs == [{"sub": GRAPHS - 2, "backward": GRAPHS + 1}.get(form, GRAPHS)] * 2
    assert stats["frames"][1] == stats["frames"][0]


class RMSNorm(torch.nn.Module):
    """Llama's: several ops, so a module's input gradient is a sum of terms."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_bitwise_the_plain_model_compiled_module_by_module(tmp_path):
    """The blocks' LayerNorms made RMS norms, fed by the residual stream: the gradient of
    the stream sums the residual's and the norm's terms, and a graph that ends at the norm
    (the tier's graph breaks) sums them in another order than eager, or the whole model
    compiled, do (the last bits differ). The reference is the plain model with the same
    graphs: every module owning parameters compiled on its own."""
    torch.manual_seed(0)
    ref = Net()
    ref.b1.ln, ref.b2.ln = RMSNorm(64), RMSNorm(64)
    model = copy.deepcopy(ref)
    data = batches(STEPS)
    torch._dynamo.reset()
    for m in ref.modules():
        if next(m.parameters(recurse=False), None) is not None:
            m.compile(backend="aot_eager")
    want, _ = plain_run(ref, data)
    got, _, graphs = compiled_run(model, data, cfg(tmp_path, offload="nvme"))
    assert got == want
    assert_same_model(ref, model)
    assert graphs[-1] == graphs[0]


def test_a_compiled_device_model_on_the_emulation(tmp_path):
    """A device model (the emulated streams: a fresh device buffer holds NaN until its copy
    ran): the graphs read the device buffers the hooks installed, bitwise."""
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, stats, graphs = compiled_run(model, data, cfg(tmp_path, offload="nvme",
                                                       window="256KiB"),
                                      streams=DeferredBackend())
    assert got == want
    assert_same_model(ref, model)
    assert stats["h2d_bytes"] > 0 and stats["evictions"] > 0
    assert graphs == [GRAPHS] * STEPS


class Shapes(Net):
    """A forward that reads the shape of a weight of a module it does not call."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.b2(self.b1(self.emb(t)))
        w = self.emb.weight  # out of the window by now
        return self.head(self.ln(x)) * (w.shape[0] / V)


def test_a_released_weight_read_by_compiled_code_is_refused(tmp_path):
    """dynamo answers `w.shape` from what it traced, with no torch call the guard sees: a
    weight out of the window was traced as (0,), silently (the loss times 0). Refused when
    traced, naming the weight and the way out; the block gives the weights back."""
    torch.manual_seed(0)
    ref = Shapes()
    model = copy.deepcopy(ref)
    t, y = batches(1)[0]
    with pytest.raises(TierMemError, match="read of emb.weight .*parameters.offload: none"):
        with tiermem.offload(make_opt(model), cfg(tmp_path, offload="nvme"), model=model):
            loss_of(torch.compile(model, backend="aot_eager"), t, y)
    assert_same_model(ref, model)


def test_a_dynamo_the_tier_cannot_hook_is_refused(tmp_path, monkeypatch):
    """Without its hook in dynamo, a released weight's shape was traced as (0,): silently
    wrong. Refused at the first compiled call, naming the way out."""
    compiled._hook_dynamo()  # (dynamo is imported: this test module imports it)
    monkeypatch.setattr(compiled, "_patched", "no VariableBuilder.wrap_tensor (a test)")
    ref, model = twins()
    with pytest.raises(TierMemError, match="parameters.offload: none"):
        compiled_run(model, batches(1), cfg(tmp_path, offload="host"))
    assert_same_model(ref, model)  # the block gave the weights back


def test_reads_between_steps_once_dynamo_is_hooked(tmp_path):
    """Once dynamo is imported, the guard's work runs through torch.compiler.disable: a
    read between steps still materialises the weight (it was taken for the tier's own)."""
    compiled._hook_dynamo()
    ref, model = twins()
    with tiermem.offload(make_opt(model), cfg(tmp_path, offload="nvme"), model=model):
        assert torch.equal(model.emb.weight[3].clone(), ref.emb.weight[3])
        assert torch.equal(model.b1.fc1.weight.sum(), ref.b1.fc1.weight.sum())
