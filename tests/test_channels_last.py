"""Parameters in channels_last (dense, not contiguous) are tiered for elementwise optimizers.

A channels_last conv weight's elements lie in memory in another order than its logical
one (strides like (27, 1, 9, 3)); a record holds its segments in memory order, and an
elementwise update is the same in any order, so every result is bitwise the plain
optimizer's, and every state tensor handed back has the parameter's strides, as torch's
own (zeros_like(p, memory_format=torch.preserve_format)). Whole-parameter rules, the
parameter tier and torch.distributed refuse such parameters with a message naming them.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

import tiermem
from tiermem.device.lanes import DeferredBackend
from tiermem.errors import TierMemError
from tiermem.kernels.native_adam import torch_tail_width
from tiermem.optim.rules import UnsupportedOptimizer
from tiermem.partition import flat, flat_like, is_dense
from tiermem.swap import recover as rec
from tiermem.swap.manifest import MANIFEST, encode, read_manifest

from offload_helpers import backend_params, config, swap_dir

CL = torch.channels_last
STEPS = 3


class Net(nn.Module):
    """Two convs, a Linear and an unused conv, in channels_last. conv2's weight (18432
    elements) is cut inside by 64 KiB partitions (at a multiple of 1024 elements of its
    memory order) whatever the optimizer's state per element."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 128, 3, padding=1)
        self.fc = nn.Linear(128 * 4, 10)
        # never has a gradient: its record is built from the weights as they are (a
        # crash-consistent run commits it before any step of it)
        self.spare = nn.Conv2d(4, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = nn.functional.adaptive_avg_pool2d(x, 2)
        return self.fc(x.flatten(1))


def net(dtype: torch.dtype = torch.float32) -> Net:
    model = Net().to(dtype=dtype, memory_format=CL)
    assert not model.conv2.weight.is_contiguous()  # what the tests are about
    return model


def batches(n: int, dtype: torch.dtype = torch.float32) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g).to(dtype).contiguous(memory_format=CL),
             torch.randint(0, 10, (4,), generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list, *,
          contiguous_grads: bool = False) -> None:
    for x, y in data:
        nn.functional.cross_entropy(model(x).float(), y).backward()
        if contiguous_grads:
            # a gradient laid out otherwise than its parameter (as a hook may hand one)
            for p in model.parameters():
                if not p.is_contiguous() and p.grad is not None:
                    assert not p.grad.is_contiguous()
                    p.grad = p.grad.contiguous()
        opt.step()
        opt.zero_grad()


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: differs by {(a.double() - b.double()).abs().max()}"
    if a.dim() > 1:
        assert a.stride() == b.stride(), f"{what}: strides {a.stride()} != {b.stride()}"


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
    if a.dim() > 1:
        assert a.stride() == b.stride(), f"{what}: strides {a.stride()} != {b.stride()}"


def same_weights(model: nn.Module, ref: nn.Module, check=same) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        check(p.detach(), q.detach(), n)


def same_state(sd: dict, ref_sd: dict, check=same) -> None:
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in ref_sd["state"].items():
        assert sd["state"][i].keys() == st.keys(), i
        for k, v in st.items():
            got = sd["state"][i][k]
            if isinstance(v, torch.Tensor):
                check(got, v, f"state[{i}][{k!r}]")
            else:
                assert got == v, (i, k)


# -- the helpers ------------------------------------------------------------------------


def test_flat_addresses_memory_order():
    w = torch.arange(16 * 27.0).view(16, 3, 3, 3).contiguous(memory_format=CL)
    assert is_dense(w) and not w.is_contiguous()
    f = flat(w)
    assert f.data_ptr() == w.data_ptr() and f.is_contiguous()
    # memory order: the first elements are pixel (0, 0)'s channels of output 0
    assert f[:3].tolist() == w[0, :, 0, 0].tolist()
    assert not torch.equal(f, w.reshape(-1))  # reshape(-1) reads the logical order
    g = w.contiguous()
    assert torch.equal(flat_like(g, w), f)  # a contiguous grad in the weight's order
    c = w.clone()  # laid out as w: read in place, not copied
    assert flat_like(c, w).data_ptr() == c.data_ptr()
    assert not is_dense(torch.zeros(4, 4)[:, ::2]) and not is_dense(torch.zeros(4).expand(3, 4))
    with pytest.raises(ValueError, match="not dense"):
        flat(torch.zeros(4, 4)[:, ::2])


# -- parity -----------------------------------------------------------------------------

# (class, kwargs): torch's elementwise optimizers, run with kernel "match" (what the plain
# optimizer runs: bitwise)
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, foreach=False)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True,
                                           weight_decay=1e-3)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05, initial_accumulator_value=0.1)),
    "rmsprop-centered": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    "nadam": (torch.optim.NAdam, dict(lr=0.01)),
    "rprop": (torch.optim.Rprop, dict(lr=0.01)),
}
PLACEMENTS = {"nvme": dict(host=0), "mixed": dict(host="96KiB", buffer_count=3)}


def pair(name: str, dtype: torch.dtype = torch.float32):
    cls, kw = OPTIMIZERS[name]
    model = net(dtype)
    ref = copy.deepcopy(model)
    return model, ref, cls(model.parameters(), **kw), cls(ref.parameters(), **kw)


# the rest of torch's elementwise family, on the mixed placement only (time)
MORE = {
    "adamax": (torch.optim.Adamax, dict(lr=0.01, weight_decay=0.01)),
    "radam": (torch.optim.RAdam, dict(lr=0.01, decoupled_weight_decay=True,
                                      weight_decay=0.01)),
    "adadelta": (torch.optim.Adadelta, dict(lr=0.5)),
    "asgd": (torch.optim.ASGD, dict(lr=0.01, t0=1)),
}
OPTIMIZERS.update(MORE)


@pytest.mark.parametrize("name, placement",
                         [(n, p) for n in OPTIMIZERS for p in PLACEMENTS
                          if n not in MORE or p == "mixed"])
def test_parity_table(tmp_path, name, placement):
    model, ref, opt, ref_opt = pair(name)
    data = batches(STEPS)
    with tiermem.offload(opt, config(tmp_path, **PLACEMENTS[placement])) as tm:
        train(model, opt, data)
        # conv2's weight is cut: a segment starts inside it
        assert any(s.start > 0 for part in tm.offloaded.parts for s in part.segments)
        inside = opt.state_dict()
    train(ref, ref_opt, data)
    same_weights(model, ref)
    same_state(inside, ref_opt.state_dict())
    same_state(opt.state_dict(), ref_opt.state_dict())  # handed back at the exit


def test_transposed_weight(tmp_path):
    """Any dense layout, not only channels_last: a weight stored transposed."""
    def make():
        torch.manual_seed(2)
        return nn.Parameter(torch.randn(96, 200).t())  # (200, 96), strides (1, 200)
    w, ref_w = make(), make()
    assert not w.is_contiguous()
    opt, ref_opt = (torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in (w, ref_w))
    x = torch.randn(3, 8, 200, generator=torch.Generator().manual_seed(3))
    with tiermem.offload(opt, config(tmp_path, host=0)):
        for xi in x:
            (xi @ w).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for xi in x:
        (xi @ ref_w).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    same(w.detach(), ref_w.detach(), "weight")
    same_state(opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_overlap_backward(tmp_path, name):
    """Partitions updated during backward, as each one's last gradient lands."""
    model, ref, opt, ref_opt = pair(name)
    data = batches(STEPS)
    cfg = config(tmp_path, host="96KiB", buffer_count=3)
    cfg["pipeline"]["overlap_backward"] = True
    with tiermem.offload(opt, cfg):
        train(model, opt, data)
    train(ref, ref_opt, data)
    same_weights(model, ref)
    same_state(opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("contiguous_grads", [False, True], ids=["cl-grads", "contig-grads"])
def test_backends_and_grad_layouts(tmp_path, backend, contiguous_grads):
    """Both I/O backends, state on NVMe; a gradient laid out otherwise than its parameter
    is read in the parameter's memory order, on every path: kernel match on NVMe records,
    and the native kernel's joined update of resident host records (auto)."""
    model, ref, opt, ref_opt = pair("adamw")
    data = batches(STEPS)
    with tiermem.offload(opt, config(tmp_path / "n", backend=backend, host=0)):
        train(model, opt, data, contiguous_grads=contiguous_grads)
    train(ref, ref_opt, data)
    same_weights(model, ref)
    same_state(opt.state_dict(), ref_opt.state_dict())

    model, ref, opt, _ = pair("adamw")
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **OPTIMIZERS["adamw"][1])
    check = same if torch_tail_width() >= 0 else close
    with tiermem.offload(opt, config(tmp_path / "h", backend=backend, host="64MiB",
                                     kernel="auto")) as tm:
        train(model, opt, data, contiguous_grads=contiguous_grads)
        assert tm.offloaded._plans  # the joined native update ran
    train(ref, ref_opt, data)
    same_weights(model, ref, check)
    same_state(opt.state_dict(), ref_opt.state_dict(), check)


@pytest.mark.parametrize("kernel", ["match", "auto"])
def test_bf16_model_fp32_masters(tmp_path, kernel):
    """A bf16 channels_last model keeps fp32 masters: the weights are the fp32 reference's
    (stepped with the same gradients, upcast) rounded, and state_dict's master_param and
    moments are the reference's, all with the parameter's strides."""
    model = net(torch.bfloat16)
    ref = net(torch.float32)
    kw = OPTIMIZERS["adamw"][1]
    opt = torch.optim.AdamW(model.parameters(), **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(p.float())
    check = same if kernel == "match" else close
    with tiermem.offload(opt, config(tmp_path, host="96KiB", kernel=kernel)):
        for x, y in batches(STEPS, torch.bfloat16):
            nn.functional.cross_entropy(model(x).float(), y).backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = None if p.grad is None else p.grad.float()
                assert q.grad is None or q.grad.stride() == q.stride()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            check(p.detach(), q.detach().to(torch.bfloat16), n)
        sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    for i, p in enumerate(ref.parameters()):
        if i not in ref_sd["state"]:
            continue  # the spare conv: never stepped, no state
        check(sd["state"][i]["master_param"], p.detach(), f"master of {i}")
        for k in ("exp_avg", "exp_avg_sq"):
            check(sd["state"][i][k], ref_sd["state"][i][k], f"state[{i}][{k}]")


@pytest.mark.parametrize("kernel", ["fused", "auto"])
def test_bf16_kahan_state_round_trip(tmp_path, kernel):
    """master_weights kahan: state_dict()'s master_param is the bf16 weight plus the Kahan
    term, added in memory order; loaded into another run (the term taken apart again
    against the weights) it gives back the same state and the same next step."""
    model = net(torch.bfloat16)
    kw = OPTIMIZERS["adamw"][1]
    opt = torch.optim.AdamW(model.parameters(), **kw)
    data = batches(3, torch.bfloat16)

    def cfg(where):
        c = config(tmp_path / where, host="96KiB", kernel=kernel)
        c["optimizer"]["master_weights"] = "kahan"
        return c

    with tiermem.offload(opt, cfg("a")):
        train(model, opt, data[:2])
        sd = copy.deepcopy(opt.state_dict())
        again = copy.deepcopy(model)
        train(model, opt, data[2:])
        after = opt.state_dict()
    # the master is not the bf16 weight: the Kahan term is in it
    assert not torch.equal(sd["state"][1]["master_param"],
                           again.conv2.weight.detach().float())
    opt2 = torch.optim.AdamW(again.parameters(), **kw)
    with tiermem.offload(opt2, cfg("b")):
        opt2.load_state_dict(sd)
        same_state(opt2.state_dict(), sd)
        train(again, opt2, data[2:])
        same_state(opt2.state_dict(), after)
    same_weights(again, model)


@pytest.mark.parametrize("step_device", ["cpu", "device"])
def test_device_lanes(tmp_path, step_device):
    """The host<->device lanes (emulated on the CPU) carry gradients and weights in the
    parameters' memory order, a contiguous gradient of a channels_last weight included."""
    model, ref, opt, _ = pair("adamw")
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **OPTIMIZERS["adamw"][1])
    cfg = config(tmp_path, kernel="fused", host="96KiB", buffer_count=4)
    cfg["optimizer"]["step_device"] = step_device
    data = batches(STEPS)
    with tiermem.offload(opt, cfg, streams=DeferredBackend()):
        train(model, opt, data, contiguous_grads=True)
    train(ref, ref_opt, data)
    same_weights(model, ref)
    same_state(opt.state_dict(), ref_opt.state_dict())


# -- state in and out -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["as-saved", "contiguous"])
def test_state_dict_round_trip(tmp_path, layout):
    """The plain optimizer's state loaded into a tiered one (in its own channels_last
    layout, or made contiguous: it lands in memory order either way), and the tiered
    one's loaded into a plain one: each then steps on as the uninterrupted run."""
    model, ref, opt, ref_opt = pair("rmsprop-centered")
    data = batches(4)
    train(ref, ref_opt, data[:2])
    sd = ref_opt.state_dict()
    if layout == "contiguous":
        sd = copy.deepcopy(sd)
        for st in sd["state"].values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 1:
                    st[k] = v.contiguous()
    model.load_state_dict(ref.state_dict())
    with tiermem.offload(opt, config(tmp_path, host="96KiB")):
        opt.load_state_dict(sd)
        same_state(opt.state_dict(), ref_opt.state_dict())
        train(model, opt, data[2:3])
        out = opt.state_dict()
    train(ref, ref_opt, data[2:3])
    same_weights(model, ref)
    same_state(out, ref_opt.state_dict())
    # tiered -> plain
    plain_model = copy.deepcopy(model)
    plain = torch.optim.RMSprop(plain_model.parameters(), **OPTIMIZERS["rmsprop-centered"][1])
    plain.load_state_dict(out)
    train(plain_model, plain, data[3:])
    train(ref, ref_opt, data[3:])
    same_weights(plain_model, ref)
    same_state(plain.state_dict(), ref_opt.state_dict())


def kept_on_disk(tmp_path, monkeypatch, model, opt, data) -> dict:
    c = config(tmp_path, host="96KiB")
    c["swap"]["durability"] = "crash_consistent"
    monkeypatch.setattr("tiermem.optim.handle.available_memory", lambda: 0)
    with pytest.warns(tiermem.errors.TierMemWarning, match="stays on disk"):
        with tiermem.offload(opt, c, model=model):
            train(model, opt, data)
    monkeypatch.undo()
    return c


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_crash_consistent_resume_and_recover(tmp_path, monkeypatch, name):
    """A crash-consistent run kept on disk: its manifest names the strides of the
    channels_last parameters (and validates); a resume puts the committed weights back
    and steps on as the uninterrupted run; `tiermem recover` gives the plain optimizer's
    state_dict and weights in the parameters' layout."""
    cls, kw = OPTIMIZERS[name]
    model, ref, opt, ref_opt = pair(name)
    data = batches(STEPS + 2)
    c = kept_on_disk(tmp_path, monkeypatch, model, opt, data[:STEPS])
    train(ref, ref_opt, data[:STEPS])

    run_dir = str(swap_dir(tmp_path))
    strides = {p["name"]: p.get("stride") for p in read_manifest(run_dir, None).params}
    assert strides["conv2.weight"] == list(ref.conv2.weight.stride())
    assert strides["fc.weight"] is None  # only where a parameter is not contiguous
    # a stride of no dense layout (re-checksummed, as crafted) is refused by name
    path = os.path.join(run_dir, MANIFEST)
    with open(path, "rb") as f:
        kept = f.read()
    body = json.loads(kept)
    body.pop("crc32c", None)
    for p in body["params"]:
        if "stride" in p:
            p["stride"][0] += 1
    with open(path, "wb") as f:
        f.write(encode(body))
    with pytest.raises(TierMemError, match=r"params\[\d+\]\.stride"):
        rec.recover(run_dir, str(tmp_path / "bad.pt"))
    with open(path, "wb") as f:
        f.write(kept)

    ckpt = torch.load(rec.recover(str(swap_dir(tmp_path)), str(tmp_path / "r.pt"))["path"])
    for (n, q) in ref.named_parameters():
        same(ckpt["model"][n], q.detach(), f"recovered {n}")
    same_state(ckpt["optimizer"], ref_opt.state_dict())
    plain_model = net()
    plain_model.load_state_dict(ckpt["model"])
    plain = cls(plain_model.parameters(), **kw)
    plain.load_state_dict(ckpt["optimizer"])

    resumed = net()
    with torch.no_grad():
        for p in resumed.parameters():
            p.fill_(7.0)  # the resume puts the committed weights back
    r_opt = cls(resumed.parameters(), **kw)
    with tiermem.offload(r_opt, c, model=resumed, resume=True) as tm:
        assert tm.resumed_step == STEPS
        same_weights(resumed, ref)
        train(resumed, r_opt, data[STEPS:])
        r_sd = r_opt.state_dict()
    train(plain_model, plain, data[STEPS:])
    train(ref, ref_opt, data[STEPS:])
    same_weights(resumed, ref)
    same_weights(plain_model, ref)
    same_state(r_sd, ref_opt.state_dict())


# -- what stays refused -----------------------------------------------------------------


def test_whole_parameter_rules_refuse(tmp_path):
    model = net()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    with pytest.raises(UnsupportedOptimizer, match=r"params\[0\] \(shape \(16, 3, 3, 3\), "
                       r"strides \(27, 1, 9, 3\)\) is not contiguous.*whole-parameter"):
        with tiermem.offload(opt, config(tmp_path)):
            pass


def test_generic_path_refuses(tmp_path):
    class Own(torch.optim.SGD):  # a step of its own: the generic path
        def step(self, closure=None):
            return super().step(closure)

    model = net()
    with pytest.raises(UnsupportedOptimizer, match="not contiguous.*whole-parameter"):
        with tiermem.offload(Own(model.parameters(), lr=0.1), config(tmp_path)):
            pass


def test_not_dense_refused(tmp_path):
    w = nn.Parameter(torch.zeros(8, 8)[:, ::2])
    opt = torch.optim.AdamW([w], lr=0.1)
    with pytest.raises(UnsupportedOptimizer, match=r"strides \(8, 2\)\) is not dense"):
        with tiermem.offload(opt, config(tmp_path)):
            pass


def test_parameter_tier_refuses(tmp_path):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cfg = config(tmp_path)
    cfg["parameters"] = {"offload": "host"}
    # the parameter tier's own refusal (tiermem/params), by the parameter's name
    with pytest.raises(TierMemError, match=r"conv1\.weight .*must be a non-empty contiguous"):
        with tiermem.offload(opt, cfg, model=model):
            pass


def test_distributed_refuses(tmp_path):
    """The sharded path cuts shares in row-major order: refused before it starts (the
    process group is never touched)."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedOptimizer, match=r"params\[0\] \(shape \(16, 3, 3, 3\), "
                       r"strides \(27, 1, 9, 3\)\) is not contiguous.*torch.distributed"):
        with tiermem.offload(opt, config(tmp_path), process_group=object()):
            pass


def test_dcp_refuses(tmp_path):
    """tiermem.dist.dcp's checkpoint is row-major (and reads weights by reshape): a
    one-process run with channels_last parameters is refused, naming one."""
    from tiermem.dist import dcp

    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with tiermem.offload(opt, config(tmp_path / "s")) as tm:
        train(model, opt, batches(1))
        with pytest.raises(UnsupportedOptimizer, match=r"parameter 0 \(shape \(16, 3, 3, 3\)"
                           r", strides \(27, 1, 9, 3\)\) is not contiguous"):
            dcp.save(tm, str(tmp_path / "ckpt"))
