"""parameters.offload: training with the model's weights and grads in the tiers gives the
same numbers as plain training.

The model has the shapes that make a parameter tier hard: a tied embedding (one
parameter used by two modules), a block called twice in one forward, LayerNorms (whose
backward needs their weights) and a transposed use of a weight (the tied head). The
window is smaller than the model, so weights are evicted and fetched again between
forward and backward; partitions are tiny, so the step opens the parameters of many
partitions in turn. The same kernel runs on the same numbers: losses, final weights and
gradients are compared bitwise.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiermem
from tiermem.config import ConfigError
from tiermem.errors import TierMemError

from conftest import needs_io_uring
from offload_helpers import backend_params

V, D, STEPS = 50, 64, 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.b1 = Block(D)
        self.b2 = Block(D)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.detour = False  # some steps take another path through the modules

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.emb(t)
        x = self.b1(x)
        if self.detour:
            x = self.b1(x)  # out of the learned order
        x = self.b2(x)
        x = self.b1(x)  # the shared block, a second time
        return self.head(self.ln(x))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (4, 8), generator=g), torch.randint(0, V, (4, 8), generator=g))
            for _ in range(n)]


def loss_of(model: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(t).reshape(-1, V), y.reshape(-1))


def twins() -> tuple[Net, Net]:
    torch.manual_seed(0)
    a = Net()
    return a, copy.deepcopy(a)


def cfg(swap, *, offload: str, backend: str = "threads", state_host: bool = True,
        window: str = "176KiB", prefetch: int = 2) -> dict:
    return {
        "swap": {"paths": [str(swap)]},
        "io": {"backend": backend, "queue_depth": 8, "block_size": "16KiB"},
        "tiers": {"host": {"capacity": "64MiB" if state_host else 0}},
        "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2},
        "optimizer": {"kernel": "match"},
        "parameters": {"offload": offload, "prefetch": prefetch, "window": window},
    }


def make_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)


def plain_run(model: Net, data, *, micro: int = 1, clip: float | None = None,
              detour_at: int | None = None) -> tuple[list[float], list[torch.Tensor]]:
    opt = make_opt(model)
    losses, norms = [], []
    for step in range(len(data) // micro):
        model.detour = step == detour_at
        for t, y in data[step * micro:(step + 1) * micro]:
            loss = loss_of(model, t, y)
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    return losses, norms


def tiered_run(model: Net, data, config: dict, *, micro: int = 1, clip: float | None = None,
               detour_at: int | None = None):
    opt = make_opt(model)
    losses, norms = [], []
    with tiermem.offload(opt, config, model=model) as tm:
        for step in range(len(data) // micro):
            model.detour = step == detour_at
            with tm.accumulating():
                for t, y in data[step * micro:(step + 1) * micro]:
                    loss = loss_of(model, t, y)
                    loss.backward()
                    losses.append(loss.item())
                    assert all(p.grad is None for p in model.parameters())
            if clip is not None:
                norms.append(tm.clip_grad_norm_(clip))
            opt.step()
            opt.zero_grad()
        stats = tm.param_stats()
        plan = tm.plan()["parameters"]
        assert plan["tier"] == config["parameters"]["offload"]
        assert plan["weight_bytes"] == sum(p.numel() * 4 for p in type(model)().parameters())
        assert (plan["swap_bytes"] > 0) == (plan["tier"] == "nvme")
        assert plan["learned_order"] > 0
        # between uses the weights are not in the model: only the window holds some
        with torch._C.DisableTorchFunction():  # as the tier left them (p.shape says the record's)
            held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert held <= config_window(config)
    return losses, norms, stats


def config_window(config: dict) -> int:
    from tiermem.sizes import parse_size
    return parse_size(config["parameters"]["window"])


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.shape == q.shape, n
        assert torch.equal(p, q), f"{n}: max diff {(p - q).abs().max().item()}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("offload", ["host", "nvme"])
@pytest.mark.parametrize("state_host", [True, False], ids=["state-host", "state-nvme"])
def test_training_matches_plain(tmp_path, offload, backend, state_host):
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats = tiered_run(model, data, cfg(tmp_path, offload=offload, backend=backend,
                                                state_host=state_host))
    assert got == want
    assert_same_model(ref, model)
    assert model.head.weight is model.emb.weight  # still tied after the block
    # the window is smaller than the model: weights were evicted and read ahead again
    assert stats["evictions"] > 0 and stats["prefetched"] > 0
    assert stats["out_of_order"] == 0
    assert not list(tmp_path.iterdir()) or all(not any(d.iterdir()) for d in tmp_path.iterdir())


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_accumulation_and_clipping_match_torch(tmp_path, offload):
    ref, model = twins()
    data = batches(STEPS * 3, seed=2)
    want, want_norms = plain_run(ref, data, micro=3, clip=0.5)
    got, got_norms, stats = tiered_run(model, data, cfg(tmp_path, offload=offload),
                                       micro=3, clip=0.5)
    assert got == want
    assert [n.item() for n in got_norms] == [n.item() for n in want_norms]
    assert all(n > 0.5 for n in want_norms[:1])  # the clip really scaled the first step
    assert_same_model(ref, model)


def test_out_of_order_unit_is_fetched_on_demand(tmp_path):
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data, detour_at=2)
    got, _, stats = tiered_run(model, data, cfg(tmp_path, offload="nvme"), detour_at=2)
    assert got == want
    assert_same_model(ref, model)
    assert stats["out_of_order"] > 0


@pytest.mark.parametrize("window, prefetch", [("176KiB", 0), ("1MiB", 4)])
def test_window_and_prefetch_do_not_change_numbers(tmp_path, window, prefetch):
    ref, model = twins()
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats = tiered_run(model, data, cfg(tmp_path, offload="nvme", window=window,
                                                prefetch=prefetch))
    assert got == want
    assert_same_model(ref, model)
    if prefetch == 0:
        assert stats["prefetched"] == 0


def test_grads_left_by_a_backward_without_step_come_back(tmp_path):
    ref, model = twins()
    (t, y), = batches(1)
    loss_of(ref, t, y).backward()
    opt = make_opt(model)
    with tiermem.offload(opt, cfg(tmp_path, offload="host"), model=model):
        loss_of(model, t, y).backward()
        assert model.emb.weight.grad is None
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_state_dict_inside_the_block(tmp_path):
    ref, model = twins()
    data = batches(2)
    plain_run(ref, data)
    opt = make_opt(model)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
        for t, y in data:
            loss_of(model, t, y).backward()
            opt.step()
            opt.zero_grad()
        sd = model.state_dict()
        want = ref.state_dict()
        assert sd.keys() == want.keys()
        for k in want:
            assert torch.equal(sd[k], want[k]), k
        # loading weights inside the block: they go to the records
        fresh = Net().state_dict()
        model.load_state_dict(fresh)
        again = model.state_dict()
        for k in fresh:
            assert torch.equal(again[k], fresh[k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh[k]), k


def test_needs_the_model(tmp_path):
    model = Net()
    opt = make_opt(model)
    with pytest.raises(ConfigError, match="model="):
        with tiermem.offload(opt, cfg(tmp_path, offload="host")):
            pass
    assert model.emb.weight.numel() == V * D


def test_window_too_small_for_a_partition_is_refused(tmp_path):
    model = Net()
    before = [p.detach().clone() for p in model.parameters()]
    opt = make_opt(model)
    with pytest.raises(ConfigError, match="parameters.window"):
        with tiermem.offload(opt, cfg(tmp_path, offload="nvme", window="16KiB"), model=model):
            pass
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_unsupported_combinations_are_refused(tmp_path):
    model = Net()
    opt = make_opt(model)
    c = cfg(tmp_path, offload="host")
    with pytest.raises(TierMemError, match="needs swap.durability crash_consistent"):
        with tiermem.offload(opt, c, model=model, resume=True):
            pass


def committed_and_resumed(model: Net, data, config: dict, *, micro: int = 1,
                          clip: float | None = None):
    """Train `model` under `config` (swap.durability crash_consistent) over `data`, copying
    the run directory after step STEPS // 2's commit (what a crash leaves; the parameter
    tier's records are not copied: the commit holds the weights). Then resume that copy
    into a fresh model whose weights are zero and train on. Returns (losses, clipped norms,
    losses after the resume, the resumed model)."""
    import shutil
    from pathlib import Path

    run = Path(config["swap"]["paths"][0]) / "tiermem-default"
    kept = run.parent.parent / "kept"
    half = STEPS // 2

    def train(tm, m, opt, steps, losses, norms):
        for step in steps:
            for t, y in data[step * micro:(step + 1) * micro]:
                loss = loss_of(m, t, y)
                loss.backward()
                losses.append(loss.item())
            if clip is not None:
                norms.append(tm.clip_grad_norm_(clip).item())
            opt.step()
            opt.zero_grad()
            if step + 1 == half:  # the resumed run starts after it
                assert tm.committed_step == half
                shutil.copytree(run, kept)

    got, norms = [], []
    opt = make_opt(model)
    with tiermem.offload(opt, config, model=model) as tm:
        train(tm, model, opt, range(len(data) // micro), got, norms)
    _, again = twins()
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()  # the resume puts the committed weights back
    opt = make_opt(again)
    assert not run.exists()  # removed at exit
    kept.rename(run)  # the manifest's place
    resumed = []
    with tiermem.offload(opt, config, model=again, resume=True) as tm:
        assert tm.resumed_step == half
        train(tm, again, opt, range(half, len(data) // micro), resumed, [])
    return got, norms, resumed, again


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_crash_consistent_matches_plain_and_resumes(tmp_path, offload):
    """swap.durability crash_consistent: the tied, shared model trains as plain torch does
    (accumulation and clipping too), and a copy of the run directory taken after a step's
    commit resumes into a fresh model and goes on bitwise."""
    ref, model = twins()
    data = batches(STEPS * 2, seed=3)
    want, want_norms = plain_run(ref, data, micro=2, clip=0.5)
    # a partition with fp32 masters holds fewer elements: b1.fc2's weights and grads, with
    # the NVMe footers, need 192 KiB of window
    c = cfg(tmp_path / "a", offload=offload, window="256KiB")
    c["swap"]["durability"] = "crash_consistent"
    got, got_norms, resumed, again = committed_and_resumed(model, data, c, micro=2, clip=0.5)
    assert got == want
    assert got_norms == [n.item() for n in want_norms]
    assert_same_model(ref, model)
    assert resumed == want[STEPS // 2 * 2:]
    assert_same_model(ref, again)
    assert again.head.weight is again.emb.weight


def test_backward_after_a_step_is_refused(tmp_path):
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, cfg(tmp_path, offload="host"), model=model):
        loss_of(model, t, y).backward()
        loss = loss_of(model, t, y)
        opt.step()
        with pytest.raises(TierMemError, match="before opt.step"):
            loss.backward()


class Functional(nn.Module):
    """Uses a child's weights from its own forward: no hook of the child runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Net()

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.inner.emb(t)
        x = self.inner.b1(x)
        # b2.fc1 and the tied head used directly, bypassing their modules' calls
        x = x + F.linear(torch.relu(F.linear(x, self.inner.b2.fc1.weight,
                                             self.inner.b2.fc1.bias)),
                         self.inner.b2.fc2.weight)
        return F.linear(self.inner.ln(x), self.inner.emb.weight)


def test_weights_used_outside_their_module_are_fetched(tmp_path):
    torch.manual_seed(0)
    ref = Functional()
    model = copy.deepcopy(ref)
    data = batches(STEPS)
    opt_ref, opt = make_opt(ref), make_opt(model)
    want, got = [], []
    for t, y in data:
        loss = loss_of(ref, t, y)
        loss.backward()
        want.append(loss.item())
        opt_ref.step()
        opt_ref.zero_grad()
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model) as tm:
        for t, y in data:
            loss = loss_of(model, t, y)
            loss.backward()
            got.append(loss.item())
            opt.step()
            opt.zero_grad()
        assert tm.param_stats()["outside_hooks"] > 0
    assert got == want
    assert_same_model(ref, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_matches_tiermem_without_the_parameter_tier(tmp_path, dtype):
    """A bf16/fp16 model keeps an fp32 master in the optimizer's record: with the weights in
    the tiers the master, the model's rounded weights and the losses are those of the same
    run with the weights in memory."""
    ref, model = twins()
    ref.to(dtype)
    model.to(dtype)
    # a frozen parameter and two param groups: the tier manages every weight, the
    # optimizer steps only what it holds
    for m in (ref, model):
        m.b2.ln.weight.requires_grad_(False)
    data = batches(STEPS)

    def run(m: Net, offload: str, swap) -> list[float]:
        groups = [{"params": [p for n, p in m.named_parameters()
                              if p.requires_grad and n.startswith("b1")], "lr": 2e-2},
                  {"params": [p for n, p in m.named_parameters()
                              if p.requires_grad and not n.startswith("b1")]}]
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05, foreach=False)
        c = cfg(swap, offload=offload)
        c["optimizer"]["kernel"] = "fused"
        losses = []
        with tiermem.offload(opt, c, model=m) as tm:
            for t, y in data:
                loss = loss_of(m, t, y)
                loss.backward()
                losses.append(loss.item())
                tm.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
        return losses

    want = run(ref, "none", tmp_path / "a")
    got = run(model, "nvme", tmp_path / "b")
    assert got == want
    assert_same_model(ref, model)


def test_window_below_the_largest_module_is_refused_and_leaves_nothing(tmp_path):
    model = Net()
    before = [p.detach().clone() for p in model.parameters()]
    opt = make_opt(model)
    c = cfg(tmp_path, offload="nvme", window="8KiB")
    c["pipeline"]["partition_size"] = "64KiB"
    with pytest.raises(ConfigError, match="largest module"):
        with tiermem.offload(opt, c, model=model):
            pass
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    assert not any(tmp_path.glob("tiermem-*"))


@pytest.mark.parametrize("which", ["optimizer", "model"])
def test_zero_grad_before_backward_drops_the_stored_gradients(tmp_path, which):
    """A backward thrown away by zero_grad (either the optimizer's or the model's) does
    not reach the step, as in torch; without zero_grad backwards add up."""
    ref, model = twins()
    data = batches(6, seed=3)

    def loop(m, opt, step_fn=None):
        zero = opt.zero_grad if which == "optimizer" else m.zero_grad
        losses = []
        for k in range(3):
            (t, y), (t2, y2) = data[2 * k], data[2 * k + 1]
            loss_of(m, t, y).backward()  # thrown away
            zero()
            loss_of(m, t2, y2).backward()
            loss_of(m, t, y).backward()  # added
            losses.append(loss_of(m, t, y).item())
            opt.step()
            zero()
        return losses

    opt_ref = make_opt(ref)
    want = loop(ref, opt_ref)
    opt = make_opt(model)
    with tiermem.offload(opt, cfg(tmp_path, offload="host"), model=model):
        got = loop(model, opt)
    assert got == want
    assert_same_model(ref, model)
    assert "zero_grad" not in opt.__dict__ and "zero_grad" not in model.__dict__


def test_a_model_built_on_the_meta_device_is_made_module_by_module(tmp_path):
    """Built on the meta device, the model is never whole in memory: each module's own
    parameters are made and initialised by its reset_parameters() as they go into their
    records. Same seed, same initial weights as a model built on the CPU."""
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    assert model.emb.weight.is_meta
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats = tiered_run(model, data, cfg(tmp_path, offload="nvme"))
    assert got == want
    assert_same_model(ref, model)
    assert not model.emb.weight.is_meta and model.head.weight is model.emb.weight


def test_a_meta_module_without_reset_parameters_is_refused(tmp_path):
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    with torch.device("meta"):
        model = Bare()
    opt = make_opt(model)
    with pytest.raises(TierMemError, match="reset_parameters"):
        with tiermem.offload(opt, cfg(tmp_path, offload="host"), model=model):
            pass
    assert not any(tmp_path.glob("tiermem-*"))


def test_discard_throws_the_weights_away_too(tmp_path):
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model) as tm:
        tm.discard()
        loss_of(model, t, y).backward()
        opt.step()
    assert all(p.numel() == 0 for p in model.parameters())
    assert not any(tmp_path.glob("tiermem-*"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_state_dict_inside_the_block(tmp_path, dtype):
    """opt.state_dict() inside the block (shapes and bf16 masters come from the parameter
    tier) is that of the run with the weights in memory, and loads back."""
    ref, model = twins()
    ref.to(dtype)
    model.to(dtype)
    data = batches(2)

    def run(m: Net, offload: str, swap):
        opt = make_opt(m)
        c = cfg(swap, offload=offload)
        c["optimizer"]["kernel"] = "fused"
        with tiermem.offload(opt, c, model=m):
            for t, y in data:
                loss_of(m, t, y).backward()
                opt.step()
                opt.zero_grad()
            sd = opt.state_dict()
            opt.load_state_dict(sd)
            again = opt.state_dict()
            with pytest.raises(TierMemError, match="add_param_group") if offload != "none" \
                    else contextlib.nullcontext():
                if offload != "none":
                    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        return sd, again

    want, _ = run(ref, "none", tmp_path / "a")
    got, again = run(model, "nvme", tmp_path / "b")
    for sd in (got, again):
        assert sd["state"].keys() == want["state"].keys()
        for k, st in want["state"].items():
            for key, v in st.items():
                assert torch.equal(sd["state"][k][key], v), (k, key)


class Checkpointed(Net):
    """Blocks under activation checkpointing: backward runs their forward again."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.emb(t)
        x = checkpoint(self.b1, x, use_reentrant=False)
        x = checkpoint(self.b2, x, use_reentrant=False)
        x = self.b1(x)
        return self.head(self.ln(x))


def test_activation_checkpointing(tmp_path):
    torch.manual_seed(0)
    ref = Checkpointed()
    model = copy.deepcopy(ref)
    data = batches(STEPS)
    want, _ = plain_run(ref, data)
    got, _, stats = tiered_run(model, data, cfg(tmp_path, offload="nvme"))
    assert got == want
    assert_same_model(ref, model)
    assert stats["evictions"] > 0


def test_weights_too_big_to_give_back_are_a_clear_error(tmp_path, monkeypatch):
    import tiermem.params.tier as tier_mod

    model = Net()
    opt = make_opt(model)
    with pytest.raises(TierMemError, match="do not fit in free host memory"):
        with tiermem.offload(opt, cfg(tmp_path, offload="nvme"), model=model):
            monkeypatch.setattr(tier_mod, "available_memory", lambda: 1 << 10)
    # the optimizer left the block properly all the same
    assert "step" not in opt.__dict__
    assert not any(tmp_path.glob("tiermem-*"))


@pytest.mark.parametrize("master", ["fp32", "kahan", "none"])
def test_a_bf16_models_state_dict_loads_into_a_new_block(tmp_path, master):
    """A bf16 model with its weights in the tier: state_dict() taken after two steps and
    loaded into a new optimizer in a new block goes on bit for bit as the run that never
    stopped. A Kahan term is rebuilt from the checkpoint's master less the model's weights,
    which live in the tier (it was computed from their empty stand-ins and failed)."""
    data = batches(STEPS)

    def config(sub):
        c = cfg(tmp_path / sub, offload="host")
        c["optimizer"].update(kernel="auto", master_weights=master)
        return c

    def steps(model, opt, part):
        for t, y in part:
            loss_of(model, t, y).float().backward()
            opt.step()
            opt.zero_grad()

    whole, split = (m.to(torch.bfloat16) for m in twins())
    opt = make_opt(whole)
    with tiermem.offload(opt, config("whole"), model=whole):
        steps(whole, opt, data)
    opt = make_opt(split)
    with tiermem.offload(opt, config("split"), model=split):
        steps(split, opt, data[:2])
        sd = opt.state_dict()
    opt = make_opt(split)
    with tiermem.offload(opt, config("split"), model=split):
        opt.load_state_dict(sd)
        steps(split, opt, data[2:])
    assert_same_model(whole, split)


def _side_run(model, opt, batches, zero, *, clip: bool = True) -> list[float]:
    """Synthetic's side branch is used on step 1 only: on the other steps its parameters
    have a gradient only as what zero_grad(set_to_none=False) leaves, zeros, which torch
    steps with (AdamW's decay and moments move them)."""
    from offload_helpers import loss_of as synthetic_loss, side_used

    losses = []
    for i, ((tokens, target),) in enumerate(batches):
        loss = synthetic_loss(model, tokens, target, side_used(i))
        loss.backward()
        losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the zeros count in it
        opt.step()
        zero(set_to_none=False)
    return losses


# each backend with each tier, each zero_grad with each tier
@pytest.mark.parametrize("which, offload, backend", [
    pytest.param("optimizer", "host", "io_uring", marks=needs_io_uring),
    ("optimizer", "nvme", "threads"),
    pytest.param("model", "nvme", "io_uring", marks=needs_io_uring),
    ("model", "host", "threads")])
def test_zero_grad_to_zeros_steps_every_parameter_as_torch(tmp_path, backend, offload, which):
    # The tier forgot the gradients on every zero_grad: a parameter no later backward
    # reached had no gradient, so the step left it alone where torch updates it with zeros.
    from offload_helpers import Synthetic, compare_state_dicts, make_batches

    model = Synthetic(vocab=300, hidden=130, out=9)
    ref = copy.deepcopy(model)
    data = make_batches(model, 4)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    want = _side_run(ref, opt_ref, data, ref.zero_grad if which == "model" else opt_ref.zero_grad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    c = cfg(tmp_path, offload=offload, backend=backend, window="1MiB")
    with tiermem.offload(opt, c, model=model):
        got = _side_run(model, opt, data, model.zero_grad if which == "model" else opt.zero_grad)
    assert got == want
    assert_same_model(ref, model)
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), n  # the zeros come back with the weights
    compare_state_dicts(opt.state_dict(), opt_ref.state_dict())


@pytest.mark.parametrize("second", ["backward", "step"])
def test_the_last_steps_gradients_without_zero_grad_are_refused(tmp_path, second):
    # torch adds the next backward to the gradient the last step used (or steps with it
    # again); the tier dropped it at the step, and ran the next step on the new backward's
    # gradient alone, or on none.
    model = Net()
    opt = make_opt(model)
    (t, y), = batches(1)
    with tiermem.offload(opt, cfg(tmp_path, offload="host"), model=model):
        loss_of(model, t, y).backward()
        opt.step()
        with pytest.raises(TierMemError, match="no zero_grad"):
            if second == "backward":
                loss_of(model, t, y).backward()
            else:
                opt.step()
        opt.zero_grad()  # what the message asks for: the loop goes on
        loss_of(model, t, y).backward()
        opt.step()


@pytest.mark.parametrize("before, offload, backend", [
    ("backward", "host", "threads"),
    pytest.param("backward", "nvme", "io_uring", marks=needs_io_uring),
    ("zeros", "nvme", "threads"),
    pytest.param("zeros", "host", "io_uring", marks=needs_io_uring)])
def test_gradients_held_at_entry_move_into_the_tier(tmp_path, offload, before, backend):
    # They stayed in p.grad, which neither the step nor the next backward's hook reads:
    # the backward before the block was lost (zeros: the parameters were not stepped), or
    # the next backward added into it out of the tier's sight.
    ref, model = twins()
    data = batches(3)

    def run(m, opt, inside=contextlib.nullcontext):
        t, y = data[0]
        loss_of(m, t, y).backward()
        if before == "zeros":
            m.zero_grad(set_to_none=False)
        with inside():
            for t, y in data[1:]:
                opt.step()  # the first uses the gradient from before (zeros: decay alone)
                opt.zero_grad()
                m.detour = True  # b1 used twice more: the gradient adds to the old one
                loss_of(m, t, y).backward()
                opt.step()
                opt.zero_grad()

    run(ref, make_opt(ref))
    opt = make_opt(model)
    c = cfg(tmp_path, offload=offload, backend=backend)
    run(model, opt, lambda: tiermem.offload(opt, c, model=model))
    assert_same_model(ref, model)
