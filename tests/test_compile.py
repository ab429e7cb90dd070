"""A torch.compile'd model whose optimizer state is tiered (dynamo traces the forward and
backward; the step and, with overlap_backward, the gradient hooks stay eager) equals the
plain run. aot_eager keeps the arithmetic eager's, so the reference is the eager plain
run. The parameter tier (parameters.offload) under compile: tests/test_compile_params.py."""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
from offload_helpers import backend_params, compare_runs, config


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("overlap", [False, True])
def test_a_compiled_model_steps_as_the_plain_one(tmp_path, backend, overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 8))
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    cfg = config(tmp_path, backend=backend, host=0, kernel="match")
    cfg["pipeline"]["overlap_backward"] = overlap
    torch._dynamo.reset()
    with tiermem.offload(opt, cfg, model=model):
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(3):
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    compare_runs(model, opt, ref, ref_opt)
