"""tiermem.kernels.vml: every op it warms exists in torch and runs on one element."""

import torch

from tiermem.kernels.vml import VML_OPS, resolve_vml_dispatch


def test_resolve_vml_dispatch_calls_each_op_once_per_process():
    assert torch.backends.mkl.is_available(), "the CPU wheel this project pins bundles MKL"
    called = resolve_vml_dispatch()
    assert called == VML_OPS
    assert resolve_vml_dispatch() is called  # cached: runs once
    for name in VML_OPS:  # and each is a float unary op of torch's
        out = getattr(torch, name)(torch.full((1,), 0.5))
        assert out.dtype == torch.float32 and out.shape == (1,)
