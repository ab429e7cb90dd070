"""`tiermem stress --optimizer NAME` and `tiermem plan --optimizer NAME`: every named
optimizer runs verified against its plain torch class on both backends, the plan counts
what each rule's records hold, and an unknown name is one error line."""

from __future__ import annotations


import pytest
import torch

from tiermem.config import load_config
from tiermem.tools.optimizers import OPTIMIZERS, UnknownOptimizer, choice, state_bytes
from tiermem.tools.stress import StressArgs, Verifier, run_stress
from tiermem.tools.synthetic import choose_shape, param_shapes

from offload_helpers import backend_params
from zygote import run_python


def _config(tmp_path, backend="threads", host="1MiB", durability="scratch", params="none",
            overlap=False):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"""
parameters: {{offload: {params}}}
swap: {{paths: [{tmp_path / 'swap'}], durability: {durability}}}
io: {{backend: {backend}}}
tiers: {{host: {{capacity: {host}}}}}
pipeline: {{partition_size: 1MiB, buffer_count: 3, prefetch_depth: 2,
           overlap_backward: {str(overlap).lower()}}}
""")
    return path


def _available(name):
    try:
        choice(name)
    except UnknownOptimizer as exc:
        pytest.skip(str(exc))


def _stress(tmp_path, name, backend="threads", synthetic_grads=True, **kw):
    settings = load_config(_config(tmp_path, backend, **kw))
    return run_stress(StressArgs(settings=settings, params=1_000_000, steps=3, verify=True,
                                 synthetic_grads=synthetic_grads, optimizer=name,
                                 progress=False),
                      out=lambda *_: None)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_named_optimizer_runs_verified(tmp_path, backend, name):
    """Bitwise equal to the plain optimizer stepping the same values, state split between
    the host tier and NVMe; the plan's state bytes are the records' (layout padding
    aside)."""
    _available(name)
    # each record pads each of its kinds (at most 4) to a 4 KiB boundary
    _verified_as_planned(_stress(tmp_path, name, backend), kinds=4)


def _verified_as_planned(result: dict, *, kinds: int) -> None:
    """The run verified bit for bit, and the plan's state bytes are the records', but for
    each record's padding of its `kinds` kinds to 4 KiB."""
    assert result["verify"]["ok"], result["verify"]["mismatches"]
    assert result["verify"]["partitions_checked"] >= 3
    real = sum(result["tiermem_plan"]["state_bytes"].values())
    planned = result["plan"]["state"]
    parts = result["tiermem_plan"]["partitions"]
    assert planned <= real <= planned + parts * kinds * 4096, (planned, real)


def test_verifier_catches_a_wrong_update(tmp_path, monkeypatch):
    """Corrupt a sampled SGD record's momentum after the reference was taken: the plain
    reference disagrees and says where."""
    original = Verifier.before
    hit = {}

    def before_then_corrupt(self, step):
        original(self, step)
        if step == 2 and not hit:
            part = next(p for p, _ in self._pending if p.tier == "nvme")
            with self.tm.offloaded.tiers.record(part, write=True) as (views, _):
                views["momentum_buffer"][:8] += 1.0
            hit.update(partition=part.id)

    monkeypatch.setattr(Verifier, "before", before_then_corrupt)
    result = _stress(tmp_path, "sgd")
    assert not result["verify"]["ok"]
    assert f"step 2: partition {hit['partition']} (nvme tier)" in \
        result["verify"]["mismatches"][0]


def test_crash_consistent_run_verifies_with_masters(tmp_path):
    """A crash-consistent run keeps an fp32 master in every record: the plan counts it and
    the reference steps the master."""
    result = _stress(tmp_path, "adagrad", durability="crash_consistent")
    assert result["verify"]["ok"], result["verify"]["mismatches"]
    assert result["plan"]["state_per_param"] == 8


@pytest.mark.parametrize("name, dtype, per_param", [
    ("sgd", torch.float32, 4), ("adagrad", torch.float32, 4), ("rmsprop", torch.float32, 12),
    ("adamw", torch.float32, 8), ("adamw", torch.bfloat16, 12), ("sgd", torch.bfloat16, 8),
    ("adamax", torch.float32, 8), ("asgd", torch.float32, 4)])
def test_plan_bytes_per_parameter(name, dtype, per_param):
    settings = load_config({})
    shapes = [(1024, 1024), (4096,)]
    n = 1024 * 1024 + 4096
    assert state_bytes(name, shapes, dtype, settings) == per_param * n


def test_plan_bytes_of_factored_and_matrix_only_rules():
    """Adafactor keeps a row and a column statistic per matrix (and a full one per
    vector); Muon steps 2-D parameters only. Both counted on the real shapes without
    making a tensor of them."""
    settings = load_config({})
    rows, cols = 50_000, 4096
    assert state_bytes("adafactor", [(rows, cols), (cols,)], torch.float32, settings) == \
        4 * (rows + cols) + 4 * cols
    assert state_bytes("muon", [(rows, cols), (cols,)], torch.float32, settings) == \
        4 * rows * cols
    shape = choose_shape(30_000_000)
    total = sum(torch.Size(s).numel() for s in param_shapes(shape))
    assert total == shape.params


def _cli(*args):
    # forked with torch imported (tests/zygote.py)
    return run_python("-m", "tiermem.tools.cli", *args, timeout=300)


@pytest.mark.parametrize("command", ["stress", "plan"])
def test_unknown_optimizer_is_one_line_exit_2(command):
    proc = _cli(command, "--params", "1M", "--optimizer", "bogus")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown optimizer 'bogus'" in lines[0], proc.stderr
    assert "sgd" in lines[0] and "adagrad" in lines[0] and "adafactor" in lines[0]


def test_plan_command_counts_the_rule(tmp_path):
    # --update-ns: the bytes are what is checked here, not the kernel measurement
    # (tests/test_cli_first_hour.py checks that)
    proc = _cli("plan", "--config", str(_config(tmp_path)), "--params", "100M",
                "--optimizer", "rmsprop", "--update-ns", "1")
    assert proc.returncode in (0, 1), proc.stderr
    assert "(12 B/param, rmsprop)" in proc.stdout
    proc = _cli("plan", "--config", str(_config(tmp_path)), "--params", "100M",
                "--optimizer", "sgd", "--dtype", "bf16", "--update-ns", "1")
    assert "(8 B/param, sgd)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("spec", [
    "sgd(momentum=0.5, nesterov=True)",
    "bitsandbytes.optim.AdamW8bit",  # uint8 codes, block scales and code maps
    "torchao.optim.AdamW8bit",  # the same in a tensor subclass
    "pytorch_optimizer.SOAP(precondition_frequency=2)",  # lists of column-major matrices
    "pytorch_optimizer:AggMo",  # a momentum per beta in a dict
    "pytorch_optimizer.MADGRAD"])  # a count in state['k']
def test_optimizer_by_import_path_runs_verified(tmp_path, backend, spec):
    """Any optimizer class by its import path, with keyword arguments: verified against the
    plain optimizer stepping the same values (its state in torch's format: containers and
    memory order as the optimizer keeps them), and the plan's bytes are the records'."""
    _available(spec)
    # bitsandbytes: two moments, their scales and code maps, a step count
    _verified_as_planned(_stress(tmp_path, spec, backend), kinds=8)


@pytest.mark.parametrize("spec, per_param", [
    # 8-bit codes for both moments and one fp32 scale per 256 elements each (the code
    # maps' 2 KiB per matrix aside): the formats the stand-ins of 4096+ elements show
    ("bitsandbytes.optim.AdamW8bit", 2 + 2 * 4 / 256),
    ("torchao.optim.AdamW8bit", 2 + 2 * 4 / 256),
    ("torchao.optim.AdamW4bit", 1 + 2 * 4 / 128)])
def test_plan_bytes_of_block_quantised_state(spec, per_param):
    _available(spec)
    rows, cols = 50_000, 4096
    got = state_bytes(spec, [(rows, cols)], torch.float32, load_config({})) / (rows * cols)
    assert per_param <= got <= per_param * 1.001, got


@pytest.mark.parametrize("spec, error", [
    ("os.path", "os.path is not a torch.optim.Optimizer subclass"),
    ("sgd(0.5)", "keyword arguments only"),
    ("sgd(momentum=", "cannot read optimizer"),
    ("nosuchpackage.Opt", "install the package that provides nosuchpackage")])
def test_optimizer_spec_errors(spec, error):
    with pytest.raises(UnknownOptimizer, match=error):
        choice(spec)


def test_plan_command_takes_an_import_path(tmp_path):
    spec = "torch.optim.SGD(momentum=0.9, nesterov=True)"
    proc = _cli("plan", "--config", str(_config(tmp_path)), "--params", "100M",
                "--optimizer", spec, "--update-ns", "1")
    assert proc.returncode in (0, 1), proc.stderr
    assert f"(4 B/param, {spec})" in proc.stdout, proc.stdout


@pytest.mark.parametrize("params", ["host", "nvme"])
@pytest.mark.parametrize("spec", ["sgd", "adafactor", "lion", "pytorch_optimizer.MADGRAD"])
def test_verified_with_the_weights_in_the_tiers(tmp_path, params, spec):
    """With parameters.offload the gradients backward leaves are in the parameter tier,
    not in p.grad: the plain reference steps on those (it read p.grad, and reported every
    sampled partition as different)."""
    _available(spec)
    result = _stress(tmp_path, spec, synthetic_grads=False, params=params)
    assert result["verify"]["ok"], result["verify"]["mismatches"]
    assert result["verify"]["partitions_checked"] >= 3


@pytest.mark.parametrize("spec", ["rmsprop", "pytorch_optimizer.MADGRAD",
                                  "pytorch_optimizer.SOAP(precondition_frequency=2)"])
def test_verified_with_updates_during_backward(tmp_path, spec):
    """With pipeline.overlap_backward the sampled partitions are updated during backward,
    before the reference is computed: it steps from the values the step began with (the
    group's count, MADGRAD's state['k']), taken before backward with the records (it took
    them after, and reported the partitions of optimizers that count as different)."""
    _available(spec)
    result = _stress(tmp_path, spec, synthetic_grads=False, overlap=True)
    assert result["verify"]["ok"], result["verify"]["mismatches"]
    assert result["verify"]["partitions_checked"] >= 3


def test_plan_command_times_any_optimizers_update(tmp_path):
    proc = _cli("plan", "--config", str(_config(tmp_path)), "--params", "100M",
                "--optimizer", "adagrad", "--read-gbps", "2", "--write-gbps", "2")
    assert proc.returncode in (0, 1), proc.stderr
    assert "kernel Adagrad's own step, measured here on a 1024 x 1024 matrix" in proc.stdout
    assert "estimated opt.step() time" in proc.stdout, proc.stdout


@pytest.mark.parametrize("spec, why", [
    ("sgd(lr=-1)", "torch.optim.SGD does not take these arguments (ValueError: Invalid "
                   "learning rate: -1)"),
    ("sgd(momentom=0.9)", "unexpected keyword argument 'momentom'")])
def test_optimizer_arguments_checked_by_the_class(spec, why):
    proc = _cli("plan", "--params", "1M", "--optimizer", spec)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and why in lines[0], proc.stderr


def test_plan_refuses_what_the_offload_refuses():
    """State the class makes before any step (a mask per matrix in __init__, as SPAM's) is
    refused by the plan as at tiermem.offload's entry, not counted."""
    from tiermem.optim.rules import UnsupportedOptimizer

    with pytest.raises(UnsupportedOptimizer, match=r"state \['mask'\]"):
        state_bytes("test_optimizer_rules.MadeInInit", [(64, 64)], torch.float32,
                    load_config({}))
