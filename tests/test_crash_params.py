"""parameters.offload (host, nvme) with swap.durability crash_consistent: kill, resume,
recover.

The optimizer's records of a crash-consistent run hold every weight it updates (an fp32
master, or with master_weights kahan/none the bf16 weights), so the weights of a step are
committed with its state, in the same commit (records fdatasync'ed, then the manifest).
The parameter tier's own weight and gradient records are working copies: a resume drops
what a crashed run left there and rewrites the weights from the commit; gradients are
never durable (a step is committed whole or not at all, and a crash mid-backward
resumes to the step before).

A child (tests/crash_run.py, a real backward through the tier's hooks) is killed during
set-up, backward, the update, the commit and between steps, on both backends; the
resume must give bitwise the weights and optimizer state of an uninterrupted run at the
last committed step and go on as it does, and `tiermem recover` must write them.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiermem
import tiermem.swap.store
import tiermem.tools.cli
from conftest import BACKEND_PARAMS, sweep
from crash_run import backward_grads, crash_config, make_model, make_optimizer, run_killed
from offload_helpers import assert_same_tensor, compare_state_dicts, swap_dir
from test_crash import expected_step, poisoned, recover, refused_before_first_commit
from tiermem.errors import TierMemError

STEPS = 3


def params_config(swap: str, backend: str, params: str, master: str,
                  moments: str = "fp32") -> dict:
    cfg = crash_config(swap, backend, moments, master)
    cfg["parameters"] = {"offload": params}
    return cfg


def make(master: str, meta: bool = False) -> torch.nn.Module:
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    if not meta:
        return make_model(dtype)
    with torch.device("meta"):
        return make_model(dtype)


class Case:
    def __init__(self, backend: str, params: str, master: str, moments: str) -> None:
        self.backend, self.params, self.master = backend, params, master
        self.moments = moments
        self.ref: list[tuple[list[torch.Tensor], dict]] = []
        self.writes_at: list[int] = []  # swap writes issued before "begin k" (k = 1..)
        self.writes = 0

    def config(self, swap: str) -> dict:
        return params_config(swap, self.backend, self.params, self.master, self.moments)

    def run(self, root) -> None:
        """An uninterrupted run: the weights and state_dict after 0..STEPS+1 steps, and
        where each step's swap writes begin (to aim the kills)."""
        count = [0]
        real = tiermem.swap.store.SwapStore.write

        def write(store, part, buf, **kw):
            count[0] += 1
            return real(store, part, buf, **kw)
        tiermem.swap.store.SwapStore.write = write
        try:
            model = make(self.master)
            opt = make_optimizer(model)
            with tiermem.offload(opt, self.config(str(root)), model=model) as tm:
                for k in range(STEPS + 2):
                    if k:
                        self.writes_at.append(count[0])
                        backward_grads(model, k)
                        opt.step()
                    self.ref.append(([w.clone() for w in model.state_dict().values()],
                                     copy.deepcopy(opt.state_dict())))
                self.writes = count[0]
                tm.discard()
        finally:
            tiermem.swap.store.SwapStore.write = real


CASES = {}


@pytest.fixture
def case(tmp_path_factory, request):
    key = request.param
    if key not in CASES:
        c = Case(*key)
        c.run(tmp_path_factory.mktemp("ref"))
        CASES[key] = c
    return CASES[key]


# (point, N from the case): the N-th event of its kind kills the child
def _points(c: Case) -> list[tuple[str, int]]:
    w = c.writes_at  # writes before step 1, 2, 3, 4 begin
    pts = [("write-before", 2),                      # set-up (nvme: the weights taken in)
           ("sync", 1),                              # set-up, not flushed
           ("manifest-tmp", 1),                      # set-up, manifest not renamed
           ("write-before", w[0] + 1),               # step 1: the first write (backward)
           ("write-after", (w[1] + w[2]) // 2),      # mid step 2
           ("sync", 3),                              # step 2 written, not flushed
           ("manifest-renamed", 3),                  # step 2 committed
           ("after-step", 2),                        # between steps
           ("write-after", w[3] - 1)]                # the last writes of step 3
    return pts


# (backend, parameters.offload, master_weights, state_dtype)
KEYS = [(b.values[0], p, "fp32", "fp32") for b in BACKEND_PARAMS for p in ("host", "nvme")] + [
    ("threads", "nvme", "kahan", "int8"), ("threads", "host", "kahan", "fp32"),
    ("threads", "nvme", "none", "bf16")]
IDS = ["-".join(k) for k in KEYS]
N_POINTS = 9


@pytest.mark.parametrize("case,which", [
    pytest.param(key, which, id=f"{'-'.join(key)}-{which}")
    for key, which in sweep(list(range(N_POINTS)), KEYS)], indirect=["case"])
def test_resume_after_kill(tmp_path, case, which):
    point, n = _points(case)[which]
    swap = tmp_path / "swap"
    out = run_killed(swap, case.backend, f"{point}:{n}", STEPS,
                     "fp32" if case.master == "fp32" else "bf16",
                     case.moments, "backward", case.master,
                     case.params)
    step = expected_step(point, out)
    cfg = case.config(str(swap))
    model = make(case.master)
    opt = make_optimizer(poisoned(model))
    if step < 0:
        refused_before_first_commit(opt, cfg, model)
        return
    weights, state = case.ref[step]
    names = list(make(case.master).state_dict())
    recovered = recover(swap, tmp_path, step)
    plain = make(case.master)
    plain.load_state_dict(recovered["model"])
    for (name, p), w in zip(plain.named_parameters(), weights):
        assert_same_tensor(p.detach(), w, f"recovered {name}")
    compare_state_dicts(recovered["optimizer"], state)
    with tiermem.offload(opt, cfg, model=model, resume=True) as tm:
        assert tm.resumed_step == step
        for name, w in zip(names, weights):
            assert_same_tensor(model.state_dict()[name], w, f"resumed at {step}: {name}")
        compare_state_dicts(opt.state_dict(), state)
        backward_grads(model, step + 1)
        opt.step()
        assert tm.committed_step == step + 1
        compare_state_dicts(opt.state_dict(), case.ref[step + 1][1])
        tm.discard()  # the weights are checked inside: at exit they stay in the tier
    assert not swap_dir(swap).exists()
    assert not (swap / "tiermem-default.params").exists()


@pytest.mark.parametrize("case", [KEYS[1]], indirect=True, ids=[IDS[1]])
def test_resume_into_a_model_built_on_meta(tmp_path, case):
    """The model built on the meta device (never whole in memory): the resume makes it
    module by module, then writes the committed weights over the fresh ones; training
    goes on as the uninterrupted run, and the weights given back at exit are its."""
    swap = tmp_path / "swap"
    run_killed(swap, case.backend, "after-step:2", STEPS, "fp32", "fp32", "backward", "fp32",
               case.params)
    model = make(case.master, meta=True)
    opt = make_optimizer(model)
    with tiermem.offload(opt, case.config(str(swap)), model=model, resume=True) as tm:
        assert tm.resumed_step == 2
        backward_grads(model, 3)
        opt.step()
    for p, w in zip(model.parameters(), case.ref[3][0]):
        assert_same_tensor(p.detach(), w, "step 3 after a resume into a meta model")
    compare_state_dicts(opt.state_dict(), case.ref[3][1])


def test_scratch_resume_is_refused(tmp_path):
    model = make_model()
    cfg = params_config(str(tmp_path), "threads", "nvme", "fp32")
    cfg["swap"]["durability"] = "scratch"
    with pytest.raises(TierMemError, match="needs swap.durability crash_consistent"):
        tiermem.offload(make_optimizer(model), cfg, model=model, resume=True).__enter__()


def test_a_failed_step_rolls_back_the_tier_weights(tmp_path, monkeypatch):
    """A step that fails part-way (a write that fails for good) is rolled back: the
    weights in the parameter tier, and the optimizer state, are those of the last commit,
    and the step can be taken again."""
    from tiermem.errors import TierMemIOError

    c = Case("threads", "nvme", "fp32", "fp32")
    c.run(tmp_path / "ref")
    model = make("fp32")
    opt = make_optimizer(model)
    with tiermem.offload(opt, c.config(str(tmp_path / "swap")), model=model) as tm:
        for k in (1, 2):
            backward_grads(model, k)
            opt.step()
        backward_grads(model, 3)
        real = tiermem.swap.store.SwapStore.write
        calls = [0]

        def failing(store, part, buf, **kw):
            calls[0] += 1
            if calls[0] == 3:
                raise TierMemIOError("injected: write failed for good", op="write",
                                     path="x", errno=5)
            return real(store, part, buf, **kw)
        monkeypatch.setattr(tiermem.swap.store.SwapStore, "write", failing)
        with pytest.raises(TierMemIOError, match="injected"):
            opt.step()
        monkeypatch.setattr(tiermem.swap.store.SwapStore, "write", real)
        assert tm.committed_step == 2
        for name, w in zip(list(model.state_dict()), c.ref[2][0]):
            assert_same_tensor(model.state_dict()[name], w, f"rolled back: {name}")
        compare_state_dicts(opt.state_dict(), c.ref[2][1])
        opt.step()  # the gradients of step 3 are still stored: the step runs again
        assert tm.committed_step == 3
        compare_state_dicts(opt.state_dict(), c.ref[3][1])
        tm.discard()
