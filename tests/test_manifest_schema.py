"""The manifest is checked like the records: its own CRC32C and a validated schema.

A crash-consistent run's manifest.json (and manifest.previous.json) is damaged
one field at a time — nulled, deleted, negated, replaced by a path or by a
list — and written back either as is (a damaged file: the checksum must catch
it) or re-checksummed (a crafted file: the schema must). `resume=True` and
`tiermem recover` must both refuse it with a TierMemError naming the manifest,
never a raw traceback, never an accepted state. The only exceptions are the
values the schema leaves free (a parameter's name; torch's optional group
flags), which must still not crash anything.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tiermem
import tiermem.tools.cli
from crash_run import crash_config, make_model, make_optimizer, set_grads
from tiermem.errors import TierMemError
from tiermem.swap.manifest import MANIFEST, PREVIOUS, ManifestError, encode, read_manifest
from tiermem.swap.recover import gather

OPTIONAL_GROUP_KEYS = ("foreach", "fused", "capturable", "differentiable",
                       "decoupled_weight_decay")


class Kept:
    """A committed two-path run's files, restorable at their original paths."""

    def __init__(self, root) -> None:
        self.paths = [str(root / "a"), str(root / "b")]
        self.cfg = crash_config(self.paths[0], "threads")
        self.cfg["swap"]["paths"] = self.paths
        self.run_dir = os.path.join(self.paths[0], "tiermem-default")
        model = make_model()
        opt = make_optimizer(model)
        with tiermem.offload(opt, self.cfg, model=model) as tm:
            for k in (1, 2):
                set_grads(model, k)
                opt.step()
            self.files = {}
            for p in self.paths:
                d = os.path.join(p, "tiermem-default")
                for name in os.listdir(d):
                    with open(os.path.join(d, name), "rb") as f:
                        self.files[os.path.join(d, name)] = f.read()
            tm.discard()
        self.body = json.loads(self.files[os.path.join(self.run_dir, MANIFEST)])

    def restore(self, manifest: bytes, name: str = MANIFEST) -> None:
        for path, data in self.files.items():
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            if not os.path.exists(path) or path.endswith(".json"):
                with open(path, "wb") as f:
                    f.write(data)
        with open(os.path.join(self.run_dir, name), "wb") as f:
            f.write(manifest)

    def resume(self) -> int:
        model = make_model()
        with tiermem.offload(make_optimizer(model), self.cfg, model=model, resume=True) as tm:
            tm.discard()
            return tm.resumed_step


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Kept:
    return Kept(tmp_path_factory.mktemp("kept"))


def nodes(value, path=()):
    """Every path into a JSON value (not the root)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for k, v in items:
        yield path + (k,)
        yield from nodes(v, path + (k,))


def mutate(body, path, op):
    body = json.loads(json.dumps(body))
    parent = body
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    old = parent[key]
    if op == "delete":
        del parent[key]
    elif op == "null":
        parent[key] = None
    elif op == "negate":
        assume(isinstance(old, (int, float)) and not isinstance(old, bool))
        parent[key] = -old
    elif op == "path":
        parent[key] = "/etc/passwd" if path[0] != "files" else "../../../etc/passwd"
    elif op == "list":
        parent[key] = [0, "x"]
    return body


def free(path, op) -> bool:
    """Values the schema leaves open: any string names a parameter; torch's optional group
    flags may be missing or null; the values a step changes outside the state, a rank's
    share and the never-stepped parameters holding state are absent from the manifests of
    earlier versions (an Adam run keeps no values; one process has no share); the
    optimizer's defaults are any JSON its
    constructor kept."""
    if path[0] == "params" and len(path) == 3 and path[2] == "name" and op == "path":
        return True
    if path in (("values",), ("share",), ("unstepped_state",), ("late",)) and op == "delete":
        # (a rank's share: absent in one process; all three: in earlier versions)
        return True
    if path[0] == "defaults" and len(path) >= 2:
        return True  # whatever the constructor kept; only Adagrad's recover reads one
    return (path[0] == "groups" and len(path) == 3 and path[2] in OPTIONAL_GROUP_KEYS
            and (op == "delete" or (op == "null" and path[2] in ("foreach", "fused"))))


@settings(max_examples=300)
@given(data=st.data())
def test_any_damaged_or_crafted_manifest_is_refused(kept, data):
    body = kept.body
    path = data.draw(st.sampled_from(sorted(nodes(body), key=repr)), label="field")
    op = data.draw(st.sampled_from(["null", "delete", "negate", "path", "list"]), label="op")
    crafted = data.draw(st.booleans(), label="checksum recomputed")
    name = data.draw(st.sampled_from([MANIFEST, PREVIOUS]), label="file")
    changed = mutate(body, path, op)
    assume(changed != body)
    raw = encode(changed) if crafted else json.dumps(changed).encode()
    if crafted and path == ("crc32c",):
        raw = json.dumps(changed).encode()  # encode() would put a good one back
    kept.restore(raw, name)
    if name == PREVIOUS:
        if crafted and free(path, op):
            read_manifest(kept.run_dir, None, previous=True)
            return
        with pytest.raises(TierMemError, match=PREVIOUS):
            read_manifest(kept.run_dir, None, previous=True)
        return
    if crafted and free(path, op):
        gather(kept.run_dir)  # must not raise anything but tiermem's errors
        kept.resume()
        kept.restore(encode(body))
        return
    with pytest.raises(TierMemError) as recovered:
        gather(kept.run_dir)
    with pytest.raises(TierMemError) as resumed:
        kept.resume()
    for exc in (recovered.value, resumed.value):
        assert MANIFEST in str(exc) or "partition" in str(exc), str(exc)


def test_intact_manifest_reads(kept):
    kept.restore(encode(kept.body))
    assert read_manifest(kept.run_dir, None).step == 2
    assert kept.resume() == 2
    kept.restore(encode(kept.body))


@pytest.mark.parametrize("field,value,says", [
    (("files", 0), "/etc/passwd", "files[0]"),
    (("files", 1), "/tmp/elsewhere/state.swap", "files[1]"),
    (("files", 0), "{run}/../tiermem-default/state.swap", "files[0]"),
    (("step",), -1, "step"),
    (("steps", 0), float("inf"), "not valid JSON"),
    (("records", "0", 0), 5, "records['0'][0]"),
    (("partitions", 0, "segments", 0, 2), 10**9, "partitions[0].segments[0]"),
    (("generations", "0"), True, "generations['0']"),
])
def test_crafted_manifest_names_the_field(kept, tmp_path, capsys, field, value, says):
    body = json.loads(json.dumps(kept.body))
    parent = body
    for k in field[:-1]:
        parent = parent[k]
    parent[field[-1]] = value.format(run=kept.run_dir) if isinstance(value, str) else value
    raw = (json.dumps(body).encode() if value == float("inf") else encode(body))
    kept.restore(raw)
    with pytest.raises(ManifestError, match=r"cannot use .*" + _re(says)):
        read_manifest(kept.run_dir, None)
    out = tmp_path / "ckpt.pt"
    capsys.readouterr()
    assert tiermem.tools.cli.main(["recover", kept.run_dir, "-o", str(out)]) != 0
    assert says in capsys.readouterr().err
    assert not out.exists()
    kept.restore(encode(kept.body))


def _re(text: str) -> str:
    import re
    return re.escape(text)


def test_manifest_of_an_older_version_is_refused(kept):
    body = {**kept.body, "version": 2}
    body.pop("crc32c")
    kept.restore(json.dumps(body).encode())
    with pytest.raises(TierMemError, match="has version 2, this tiermem reads versions 3 to 4"):
        kept.resume()
    kept.restore(encode(kept.body))


def test_manifest_names_the_moment_dtype_so_recover_reads_bf16_state(tmp_path):
    """optimizer.state_dtype bf16: the manifest says each partition's moment dtype, so
    `tiermem recover` lays the records out as they were written (before, it assumed fp32
    and refused every bf16-state run: 'record of 61440 bytes, its layout gives 86016')."""

    cfg = crash_config(str(tmp_path), "threads", "bf16")
    model = make_model()
    opt = make_optimizer(model)
    with tiermem.offload(opt, cfg, model=model) as tm:
        for k in (1, 2):
            set_grads(model, k)
            opt.step()
        ckpt = gather(str(tmp_path / "tiermem-default"))
        live = opt.state_dict()["state"]
        assert ckpt["step"] == 2
        for i, state in ckpt["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[k], live[i][k].float()), (i, k)
        for name, p in model.named_parameters():
            assert torch.equal(ckpt["model"][name], p.detach().float()), name
        tm.discard()


class Paired(torch.optim.Optimizer):
    """Two momenta per parameter kept in a list (a container the record keeps as two
    kinds), for a whole-parameter layout with nested state in the manifest."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["pair"] = [torch.zeros_like(p), torch.zeros_like(p)]
                st["pair"][0].mul_(0.9).add_(p.grad)
                st["pair"][1].mul_(0.5).add_(p.grad)
                p.sub_(st["pair"][0] + st["pair"][1], alpha=group["lr"])


@pytest.fixture(scope="module")
def whole_kept(tmp_path_factory):
    """A committed run of Adafactor's and Paired's whole-parameter layouts (shapes, dtypes,
    a list), its manifest body and run directory."""
    root = tmp_path_factory.mktemp("whole")
    cfg = crash_config(str(root), "threads")
    model = make_model()
    opt = Paired([p for p in model.parameters() if p.dim() == 1])
    fact = torch.optim.Adafactor([p for p in model.parameters() if p.dim() > 1], lr=0.01)
    kept = {}
    for name, o in (("paired", opt), ("adafactor", fact)):
        with tiermem.offload(o, cfg, model=model, name=name) as tm:
            for k in (1, 2):
                set_grads(model, k)
                o.step()
            run = os.path.join(str(root), f"tiermem-{name}")
            files = {}
            for f in os.listdir(run):
                with open(os.path.join(run, f), "rb") as fh:
                    files[f] = fh.read()
            kept[name] = (run, files)
            gather(run)  # intact: recovers
            tm.discard()
    return kept


@pytest.mark.parametrize("which, field, value, says", [
    ("adafactor", ("partitions", 0, "dtypes", "row_var"), "complex128",
     "partitions[0].dtypes.row_var"),
    ("adafactor", ("partitions", 0, "dtypes", "nonesuch"), "float32", "partitions[0].dtypes"),
    ("adafactor", ("partitions", 0, "shapes", 0, "row_var", 0), -1,
     "partitions[0].shapes[0].row_var[0]"),
    ("adafactor", ("partitions", 0, "shapes"), [], "partitions[0].shapes"),
    ("adafactor", ("partitions", 0, "shapes", 0, "row_var"), [10**6],
     "partition 0: record of"),
    ("adafactor", ("params", 0, "scalars", "tiermem_dim_order"), [["row_var", [3]]],
     "params[0].scalars.tiermem_dim_order"),
    ("adafactor", ("params", 0, "scalars", "tiermem_dim_order"), [["nonesuch", [0]]],
     "params[0].scalars.tiermem_dim_order"),
    ("paired", ("partitions", 0, "nested", 0, "pair"), {"leaf": "nonesuch"},
     "partitions[0].nested[0].pair.leaf"),
    ("paired", ("partitions", 0, "nested", 0, "pair"), {"set": []},
     "partitions[0].nested[0].pair"),
    ("paired", ("partitions", 0, "nested", 0, "pair"), {"list": [{"list": [{"list": [
        {"list": [{"list": [{"list": [{"list": [{"list": [{"list": []}]}]}]}]}]}]}]}]},
     "nested at most 8 deep"),
])
def test_whole_parameter_layout_fields_are_checked(whole_kept, which, field, value, says):
    """The layout recover rebuilds a whole-parameter rule's state from (layout_of: each
    kind's dtype, shapes, the containers the optimizer keeps tensors in) is checked like
    every other field: a crafted one is refused, naming it."""
    run, files = whole_kept[which]
    body = json.loads(files[MANIFEST])
    parent = body
    for k in field[:-1]:
        parent = parent[k]
    parent[field[-1]] = value
    os.makedirs(run, mode=0o700, exist_ok=True)
    for name, data in {**files, MANIFEST: encode(body)}.items():
        with open(os.path.join(run, name), "wb") as f:
            f.write(data)
    with pytest.raises(TierMemError, match=_re(says)):
        gather(run)


JSON_SCALARS = (st.none() | st.booleans() | st.integers(-10**9, 10**9)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4))


@settings(max_examples=40, deadline=None)
@given(value=st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                          | st.tuples(inner, inner), max_leaves=10))
def test_a_group_value_the_writer_keeps_the_reader_accepts(whole_kept, value):
    """Whatever a third-party optimizer keeps in a param group, the manifest writes as
    state_io.jsonable makes it and its reader must take back: refused there, every commit
    of the run would be refused at resume (torch_optimizer's RAdam keeps lists of lists)."""
    from tiermem.optim.state_io import jsonable

    run, files = whole_kept["adafactor"]
    body = json.loads(files[MANIFEST])
    body["groups"][0]["cache"] = jsonable(value)
    os.makedirs(run, mode=0o700, exist_ok=True)
    for name, data in {**files, MANIFEST: encode(body)}.items():
        with open(os.path.join(run, name), "wb") as f:
            f.write(data)
    assert read_manifest(run, None).groups[0]["cache"] == jsonable(value)


def test_a_parameter_listed_as_holding_state_and_not_is_refused(kept):
    """stateless and unstepped_state name parameters that hold no state and parameters
    that do: one listed in both would be read one way by recover and another by resume."""
    body = json.loads(json.dumps(kept.body))
    i = body["steps"].index(0) if 0 in body["steps"] else None
    if i is None:  # every parameter stepped: make one never stepped for the check
        i = 0
        body["steps"][0] = 0
    body["stateless"], body["unstepped_state"] = [i], [i]
    kept.restore(encode(body))
    with pytest.raises(ManifestError, match="unstepped_state must be no parameter"):
        read_manifest(kept.run_dir, None)
    kept.restore(encode(kept.body))
