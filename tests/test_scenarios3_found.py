"""What a third random scenario search found (optimizer options per group, lr schedulers
that move momentum, state_dict() round trips mid-run, zero_grad variants, steps without a
backward, the I/O and pipeline knobs), each held here by the smallest run that showed it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tiermem
from tiermem.optim.rules import UnsupportedOptimizer
from offload_helpers import (Synthetic, backend_params, compare_runs, compare_state_dicts,
                             config, loss_of, make_batches)
from adam_helpers import assert_bitwise


def _nesterov_sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=True)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("host", ["64MiB", 0], ids=["host", "nvme"])
def test_foreach_nesterov_sgd_leaves_the_plain_runs_gradients(tmp_path, backend, host):
    """torch's foreach SGD with nesterov (no weight decay, no maximize) adds the momentum
    into p.grad itself; tiermem's native SGD pass, which runs it, only read p.grad. The
    weights were equal, but a loop that leaves out a zero_grad (accumulating into the last
    step's gradient, as torch does) went elsewhere, and p.grad read after a step differed."""
    model = Synthetic(vocab=300, hidden=130, out=9, seed=1)
    ref = copy.deepcopy(model)
    batches = make_batches(model, 3)
    grads = []

    def run(m, opt):
        for i, ((tokens, target),) in enumerate(batches):
            loss_of(m, tokens, target, False).backward()
            opt.step()
            grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
            if i != 1:  # step 2 adds its gradient to step 1's, as left by the step
                opt.zero_grad()

    ref_opt = _nesterov_sgd(ref.parameters())
    run(ref, ref_opt)
    opt = _nesterov_sgd(model.parameters())
    with tiermem.offload(opt, config(tmp_path, backend=backend, host=host), model=model):
        run(model, opt)
    compare_runs(model, opt, ref, ref_opt)
    half = len(grads) // 2
    for n, (got, want) in enumerate(zip(grads[half:], grads[:half])):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_bitwise(g, w, f"p.grad after step {n}")


@pytest.mark.parametrize("backend", backend_params())
def test_foreach_nesterov_sgd_with_updates_during_backward_is_refused(tmp_path, backend):
    """Updated during backward, its step would leave p.grad rewritten before the user's
    code between backward and step() sees it: refused at entry, naming the group and
    what runs instead (foreach=False: the same weights)."""
    model = Synthetic(vocab=300, hidden=130, out=9)
    side = [model.side.weight, model.side.bias]
    rest = [p for n, p in model.named_parameters() if not n.startswith("side.")]
    opt = torch.optim.SGD([{"params": rest, "maximize": True}, {"params": side}], lr=0.05,
                          momentum=0.9, nesterov=True, foreach=True)
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["pipeline"]["overlap_backward"] = True
    with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[1\] .*foreach=False"):
        with tiermem.offload(opt, cfg, model=model):
            pass
    for group in opt.param_groups:
        group["foreach"] = False
    with tiermem.offload(opt, cfg, model=model):
        pass


class _WithEmpty(torch.nn.Module):
    """A layer with no outputs (a head configured to size 0): parameters of no elements,
    which the plain optimizer steps and keeps state for like any other."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 16)
            with warnings.catch_warnings():  # "Initializing zero-element tensors is a no-op"
                warnings.simplefilter("ignore", UserWarning)
                self.head = torch.nn.Linear(16, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y + self.head(y).sum()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=0.01),
                                  lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.05)],
                         ids=["adam", "sgd", "adagrad"])
def test_an_empty_parameter_is_counted_by_a_step_with_updates_during_backward(
        tmp_path, backend, make):
    """A parameter of no elements is in no partition. step() counts every parameter with
    a gradient, but with overlap_backward the counts came only from the partitions: the
    empty parameter was never counted, and state_dict() held no state (Adagrad: step 0)
    where the plain optimizer's holds its count and empty moments."""
    model = _WithEmpty()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 16, generator=g))
            for _ in range(3)]

    def run(m, opt):
        for x, t in data:
            (m(x) - t).square().mean().backward()
            opt.step()
            opt.zero_grad()

    ref_opt = make(ref.parameters())
    run(ref, ref_opt)
    opt = make(model.parameters())
    cfg = config(tmp_path, backend=backend, host=0)
    cfg["pipeline"]["overlap_backward"] = True
    with tiermem.offload(opt, cfg, model=model):
        run(model, opt)
    compare_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("backend", backend_params())
def test_a_sparse_gradient_with_updates_during_backward_names_the_optimizer(
        tmp_path, backend):
    """Refused, as it should be, but the error said "Adam does not support sparse
    gradients" whatever the optimizer (SGD and Adagrad take sparse gradients in torch):
    it now names the optimizer and the parameter."""
    emb = torch.nn.Embedding(50, 16, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.05)
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["pipeline"]["overlap_backward"] = True
    with pytest.raises(tiermem.TierMemError,
                       match=r"SGD under tiermem does not support sparse gradients "
                             r"\(parameter 'weight'\)"):
        with tiermem.offload(opt, cfg, model=emb):
            emb(torch.tensor([[1, 2, 3]])).sum().backward()
            opt.step()


@pytest.mark.parametrize("make", [lambda gs: torch.optim.Adam(gs, lr=0.01),
                                  lambda gs: torch.optim.SGD(gs, lr=0.05, momentum=0.9),
                                  lambda gs: torch.optim.Adafactor(gs, lr=0.01)],
                         ids=["adam", "sgd", "adafactor"])
def test_a_parameter_listed_twice_in_a_group_is_refused(tmp_path, make):
    """torch only warns about a parameter listed twice in one group, and its step then
    updates it once per listing on one state. Tiered, the run went elsewhere without a
    word (Adam's weights a few 1e-3 off after three steps): refused at entry, naming it,
    and inside the block by add_param_group."""
    model = Synthetic(vocab=300, hidden=130, out=9)
    ps = list(model.parameters())
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = make([{"params": ps + [ps[0]]}])
    cfg = config(tmp_path, host="64MiB")
    with pytest.raises(UnsupportedOptimizer, match=r"params\[7\] \(shape \(300, 61\)\) is "
                                                   "listed twice"):
        with tiermem.offload(opt, cfg, model=model):
            pass
    opt = make([{"params": ps[:5]}])
    with tiermem.offload(opt, cfg, model=model):
        with pytest.raises(UnsupportedOptimizer, match=r"param_groups\[1\]: params\[1\]"):
            with pytest.warns(UserWarning, match="duplicate parameters"):
                opt.add_param_group({"params": [ps[5], ps[5]]})


_TURNED = {  # (optimizer, the setting turned after the first step, its new value)
    "sgd-momentum-on": (lambda ps: torch.optim.SGD(ps, lr=0.05), "momentum", 0.6),
    "sgd-momentum-off": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), "momentum", 0.0),
    "adam-amsgrad-off": (lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True), "amsgrad", False),
    "rmsprop-centered-off": (lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True),
                             "centered", False)}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", sorted(_TURNED))
def test_a_setting_turned_inside_the_block_leaves_the_state_dict_as_torchs(
        tmp_path, backend, case):
    """A setting that decides which state a group keeps, changed after a step (a momentum
    warm-up from 0): the next step is refused (the records are laid out), but state_dict()
    and the state handed back at the block's end were made from the group's settings now.
    SGD turning momentum on got a momentum_buffer of zeros that torch does not have (a
    plain optimizer loading it, or a block entered again, then steps from the zeros: other
    numbers with dampening); turning it (or amsgrad, centered) off dropped the buffer torch
    keeps and hands back."""
    make, key, value = _TURNED[case]
    model = Synthetic(vocab=300, hidden=130, out=9, seed=1)
    ref = copy.deepcopy(model)
    (tokens, target), = make_batches(model, 1)[0]

    def run(m, opt):
        loss_of(m, tokens, target, False).backward()
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:
            group[key] = value

    ref_opt = make(ref.parameters())
    run(ref, ref_opt)
    opt = make(model.parameters())
    with tiermem.offload(opt, config(tmp_path, backend=backend), model=model):
        run(model, opt)
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict())
    compare_runs(model, opt, ref, ref_opt)
