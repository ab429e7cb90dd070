"""What a second random scenario search found (GradScaler, parameters frozen and unfrozen,
grads None, weights edited between steps, tensor lr and betas, maximize,
zero_grad(set_to_none=False), foreach/fused flags, param groups with their own
hyperparameters), each held here by the smallest run that showed it."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from offload_helpers import Synthetic, backend_params, config, loss_of, make_batches


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=0.01),
                                  # Adagrad lays out a record for a frozen parameter too
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.01)],
                         ids=["adam", "adagrad"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_a_parameter_unfrozen_inside_the_block_with_the_weights_in_the_tier_is_refused(
        tmp_path, backend, make, overlap):
    """The parameter tier hooks the gradients of the parameters that required one when the
    block opened; one unfrozen since kept its gradient in p.grad, where the step never
    looked: it stayed as it was, without a word. Refused, as without the tier."""
    model = Synthetic(vocab=300, hidden=130, out=9)
    model.emb.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    (tokens, target), = make_batches(model, 1)[0]
    cfg = config(tmp_path, backend=backend, host="64MiB")
    cfg["parameters"] = {"offload": "nvme"}
    cfg["pipeline"]["overlap_backward"] = overlap
    opt = make(model.parameters())
    with pytest.raises(tiermem.TierMemError, match="requires_grad=False"):
        with tiermem.offload(opt, cfg, model=model):
            model.emb.weight.requires_grad_(True)
            loss_of(model, tokens, target, False).backward()
            opt.step()
    # refused at the forward: nothing was updated
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach())
