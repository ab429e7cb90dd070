import sys, pytest, contextlib, copy
from pathlib import Path
from offload_helpers import compare_state_dicts, config, listdir, assert_same_tensor
import tiermem, torch

def cfg(tmp_path, offload):
    c = config(tmp_path / "swap", host=0, kernel="match"); c["parameters"] = {"offload": offload}; return c

def _net():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 1100), torch.nn.Tanh(), torch.nn.Linear(1100, 8))

@pytest.mark.parametrize("offload", ["none", "host", "nvme"])
def test_accelerate_prepare_inside(tmp_path, offload):
    from test_integration_accelerate import fresh_accelerator
    def run(tiered):
        acc = fresh_accelerator()
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(8)]
        with tiermem.offload(opt, cfg(tmp_path, offload), model=model) if tiered else contextlib.nullcontext():
            for x, y in data[:2]:
                (model(x) - y).square().mean().backward(); opt.step(); opt.zero_grad()
            model, opt = acc.prepare(model, opt)
            for x, y in data[2:]:
                with acc.accumulate(model):
                    acc.backward((model(x) - y).square().mean())
                    if acc.sync_gradients: acc.clip_grad_norm_(model.parameters(), 0.05)
                    opt.step(); opt.zero_grad()
        return model, opt
    pm, po = run(False)
    tm, to = run(True)
    for (n, p), (_, q) in zip(tm.named_parameters(), pm.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), n)
    compare_state_dicts(to.state_dict(), po.state_dict())
