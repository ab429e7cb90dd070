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
@pytest.mark.parametrize("inner", [False, True])
def test_fabric_save_load_clip(tmp_path, offload, inner):
    from lightning.fabric import Fabric
    def run(tiered, root, stop=None, resume=None):
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        fabric = Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, 1, 0.8)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(12)]
        state = {"model": model, "optimizer": opt, "sched": sched, "it": 0}
        with tiermem.offload(opt.optimizer if inner else opt, cfg(tmp_path, offload), model=model) if tiered else contextlib.nullcontext():
            if resume:
                fabric.load(resume, state)
            for i in range(state["it"], len(data)):
                x, y = data[i]
                acc = i % 2 == 0
                with fabric.no_backward_sync(model, enabled=acc):
                    fabric.backward((model(x) - y).square().mean())
                if not acc:
                    fabric.clip_gradients(model, opt, max_norm=0.05)
                    opt.step(); opt.zero_grad(set_to_none=False); sched.step()
                state["it"] = i + 1
                if stop is not None and i + 1 == stop:
                    fabric.save(root / "ck.pt", state)
        return model, opt
    pm, po = run(False, tmp_path / "p", stop=6)
    tm, to = run(True, tmp_path / "t", stop=6)
    for (n, p), (_, q) in zip(tm.named_parameters(), pm.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), n)
    compare_state_dicts(to.state_dict(), po.state_dict())
    rm, ro = run(True, tmp_path / "r", resume=tmp_path / "t" / "ck.pt")
    for (n, p), (_, q) in zip(rm.named_parameters(), pm.named_parameters()):
        assert_same_tensor(p.detach(), q.detach(), n)
    compare_state_dicts(ro.state_dict(), po.state_dict())

def test_hf_schedulefree_eval(tmp_path):
    from test_integration_transformers import train, compare, dataset
    from tiermem.integrations.transformers import TiermemCallback
    import transformers as T
    def run(root, cbs):
        from test_integration_transformers import Tiny
        model = Tiny()
        kw = dict(output_dir=str(root), per_device_train_batch_size=4, learning_rate=5e-2, weight_decay=0.05,
                  save_strategy="no", logging_strategy="no", report_to=[], optim="schedule_free_adamw", max_steps=6,
                  eval_strategy="steps", eval_steps=2, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0)
        tr = T.Trainer(model=model, args=T.TrainingArguments(**kw), train_dataset=dataset(), eval_dataset=dataset(8), callbacks=cbs)
        tr.train()
        ev = tr.evaluate()
        return (model, tr), ev
    plain, evp = run(tmp_path / "p", [])
    cb = TiermemCallback(cfg(tmp_path, "none"))
    with cb:
        tiered, evt = run(tmp_path / "t", [cb])
    print(evp, evt)
    compare(tiered, plain)
    assert evp["eval_loss"] == evt["eval_loss"]
