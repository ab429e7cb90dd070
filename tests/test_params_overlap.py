"""parameters.offload with pipeline.overlap_backward: each partition's update runs during
backward, from the gradients backward left in memory (never written to their records
unless the window needs the room), and training gives the same numbers as plain torch.

The model is test_params_parity's (a tied embedding, a block called twice, LayerNorms);
its small window evicts weights between forward and backward, and its smallest one also
makes the tier write held gradients out (spill) before their update takes them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.errors import TierMemError

from offload_helpers import backend_params
from test_params_parity import (STEPS, assert_same_model, batches, cfg, committed_and_resumed,
                                config_window, loss_of, make_opt, plain_run, twins)


def overlap_cfg(swap, **kw) -> dict:
    c = cfg(swap, **kw)
    c["pipeline"]["overlap_backward"] = True
    return c


def overlap_run(model, data, config: dict, *, micro: int = 1):
    """Train as plain_run does; every backward but a step's last inside tm.accumulating()
    (the last one starts the update)."""
    opt = make_opt(model)
    losses = []
    with tiermem.offload(opt, config, model=model) as tm:
        for step in range(len(data) // micro):
            batch = data[step * micro:(step + 1) * micro]
            for k, (t, y) in enumerate(batch):
                loss = loss_of(model, t, y)
                if k + 1 < len(batch):
                    with tm.accumulating():
                        loss.backward()
                else:
                    loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
        stats = tm.param_stats()
        early = sum(s["early_partitions"] for s in tm.stats())
        with torch._C.DisableTorchFunction():  # as the tier left them (p.shape says the record's)
            held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert held <= config_window(config)
    return losses, stats, early


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("offload", ["host", "nvme"])
@pytest.mark.parametrize("state_host", [True, False], ids=["state-host", "state-nvme"])
@pytest.mark.parametrize("micro", [1, 3])
def test_overlap_matches_plain(tmp_path, offload, backend, state_host, micro):
    ref, model = twins()
    data = batches(STEPS * micro, seed=micro)
    want, _ = plain_run(ref, data, micro=micro)
    got, stats, early = overlap_run(model, data, overlap_cfg(
        tmp_path, offload=offload, backend=backend, state_host=state_host, window="1MiB"),
        micro=micro)
    assert got == want
    assert_same_model(ref, model)
    assert model.head.weight is model.emb.weight
    assert early > 0  # partitions were updated during backward, not in step()
    assert stats["grads_held"] > 0  # and took their gradients from memory


@pytest.mark.parametrize("backend", backend_params())
def test_overlap_with_a_window_that_spills_gradients(tmp_path, backend):
    """A window smaller than the model, micro-batches accumulated: the kept gradients
    fill it during the first backwards (no update is queued to free room), so they are
    written out ("spilled") to make room for the weights backward needs, added to there,
    and read back by their update; same numbers."""
    ref, model = twins()
    data = batches(STEPS * 3, seed=4)
    want, _ = plain_run(ref, data, micro=3)
    got, stats, early = overlap_run(model, data, overlap_cfg(
        tmp_path, offload="nvme", backend=backend, state_host=False, window="224KiB"),
        micro=3)
    assert got == want
    assert_same_model(ref, model)
    assert stats["evictions"] > 0 and early > 0
    assert stats["grads_held"] > 0 and stats["grads_spilled"] > 0


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_overlap_crash_consistent_matches_plain_and_resumes(tmp_path, offload):
    """Every step committed (the weights with it) while its updates ran during backward;
    the kept run directory resumes into a fresh model and goes on bitwise."""
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    c = overlap_cfg(tmp_path / "a", offload=offload, window="256KiB")
    c["swap"]["durability"] = "crash_consistent"
    got, _, resumed, again = committed_and_resumed(model, data, c)
    assert got == want
    assert_same_model(ref, model)
    assert resumed == want[STEPS // 2:]
    assert_same_model(ref, again)


def test_clipping_is_refused_with_overlap(tmp_path):
    """The global norm is known only once backward is over, after the updates started."""
    _, model = twins()
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, overlap_cfg(tmp_path, offload="host", window="1MiB"),
                         model=model) as tm:
        loss_of(model, t, y).backward()
        with pytest.raises(TierMemError, match="clip_grad_norm_ cannot run"):
            tm.clip_grad_norm_(1.0)
        opt.step()


def test_zero_grad_between_backward_and_step_is_refused(tmp_path):
    """Part of the step already ran on the gradients zero_grad then dropped."""
    _, model = twins()
    opt = make_opt(model)
    (t, y), = batches(1)
    with pytest.raises(TierMemError, match="changed between backward and"):
        with tiermem.offload(opt, overlap_cfg(tmp_path, offload="nvme", window="1MiB"),
                             model=model):
            loss_of(model, t, y).backward()
            opt.zero_grad()
            opt.step()


@pytest.mark.parametrize("backend", backend_params())
def test_overlap_with_activation_checkpointing(tmp_path, backend):
    """Backward runs the checkpointed blocks' forward again (their modules' weights
    fetched and pinned) while the worker updates the partitions already final."""
    import copy

    from test_params_parity import Checkpointed

    torch.manual_seed(0)
    ref = Checkpointed()
    model = copy.deepcopy(ref)
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, stats, early = overlap_run(model, data, overlap_cfg(
        tmp_path, offload="nvme", backend=backend, window="256KiB"))
    assert got == want
    assert_same_model(ref, model)
    assert early > 0


def test_overlap_with_a_model_built_on_the_meta_device(tmp_path):
    """The tier makes the parameters (swap_tensors): the overlap's hooks go on the
    parameters it made, after the tier's own."""
    torch.manual_seed(0)
    from test_params_parity import Net

    ref = Net()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, stats, early = overlap_run(model, data, overlap_cfg(
        tmp_path, offload="nvme", window="1MiB"))
    assert got == want
    assert_same_model(ref, model)
    assert early > 0 and stats["grads_held"] > 0


def test_overlap_with_a_frozen_parameter_and_two_groups(tmp_path):
    """A frozen parameter (in the tier, not in the optimizer) and two param groups: the
    same numbers as plain torch; the frozen weight never changes."""
    ref, model = twins()
    for m in (ref, model):
        m.b2.ln.weight.requires_grad_(False)
    frozen = model.b2.ln.weight.detach().clone()

    def opt_for(m):
        groups = [{"params": [p for n, p in m.named_parameters()
                              if p.requires_grad and n.startswith("b1")], "lr": 2e-2},
                  {"params": [p for n, p in m.named_parameters()
                              if p.requires_grad and not n.startswith("b1")]}]
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05, foreach=False)

    data = batches(STEPS)

    def fit(m, opt):
        losses = []
        for t, y in data:
            loss = loss_of(m, t, y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return losses

    want = fit(ref, opt_for(ref))
    opt = opt_for(model)
    with tiermem.offload(opt, overlap_cfg(tmp_path, offload="nvme", window="1MiB"),
                         model=model) as tm:
        got = fit(model, opt)
        assert sum(s["early_partitions"] for s in tm.stats()) > 0
    assert got == want
    assert_same_model(ref, model)
    assert torch.equal(model.b2.ln.weight, frozen)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(window=st.sampled_from(["224KiB", "320KiB", "512KiB", "2MiB"]),
       micro=st.integers(1, 3), offload=st.sampled_from(["host", "nvme"]),
       prefetch=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_overlap_matches_plain_whatever_the_window(tmp_path_factory, window, micro, offload,
                                                   prefetch, seed):
    """Whatever the window (spilling or not), accumulation, tier and read-ahead: the same
    numbers as plain torch."""
    ref, model = twins()
    data = batches(2 * micro, seed=seed)
    want, _ = plain_run(ref, data, micro=micro)
    got, stats, _ = overlap_run(model, data, overlap_cfg(
        tmp_path_factory.mktemp("swap"), offload=offload, state_host=False, window=window,
        prefetch=prefetch), micro=micro)
    assert got == want
    assert_same_model(ref, model)
    assert stats["grads_stored"] > 0
