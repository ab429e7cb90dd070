"""Weights the user changes between steps (a clamp, a pruning mask, model.load_state_dict)
are what the next step starts from, as with the plain optimizer.

In crash-consistent mode every record of an fp32 model also keeps a master copy of its
weights, for the commit; the step used to start from that copy, so every change the user
made since the last step was silently undone. The reference is the plain optimizer on a
deep copy, given the same batches and the same edits.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from offload_helpers import backend_params, compare_runs, config

OPTIMIZERS = {
    "adam-match": (lambda ps: torch.optim.Adam(ps, lr=1e-2), "match"),
    # the native kernel is bitwise torch's fused one
    "adamw-native": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), "native"),
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9), "match"),
    "adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=1e-2), "match"),  # whole-parameter
}


def _edit(model: torch.nn.Module, how: str) -> None:
    with torch.no_grad():
        if how == "clamp":  # weight clipping, through .data as old code does
            for p in model.parameters():
                p.data.clamp_(-0.05, 0.05)
        elif how == "mask":  # magnitude pruning
            for p in model.parameters():
                p.mul_((p.abs() > 0.02).to(p.dtype))
        else:  # a rewind or a merge, through the module
            model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("durability", ["scratch", "crash_consistent"])
@pytest.mark.parametrize("how", ["clamp", "mask", "load_state_dict"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_weights_edited_between_steps_are_stepped_from(tmp_path, backend, durability, how,
                                                       name):
    make, kernel = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 8))
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    cfg = config(tmp_path, backend=backend, host="48KiB", kernel=kernel)  # host and NVMe
    cfg["swap"]["durability"] = durability
    with tiermem.offload(opt, cfg, model=model):
        for m, o in ((ref, ref_opt), (model, opt)):
            for _ in range(3):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
                _edit(m, how)
    compare_runs(model, opt, ref, ref_opt)
