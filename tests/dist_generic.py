"""What each rank runs in tests/test_distributed_generic.py: the generic path (a third-party
optimizer, or a subclass with a step of its own) under a process group, in ZeRO mode on
shares of whole parameters.

The reference on every rank is the plain optimizer on a copy of the model fed the mean
gradient (dist_scenarios.averaged): with 2 ranks the mean is the same sum in the same
order, so the runs are bitwise equal.
"""

from __future__ import annotations

import copy
import os

import torch

import tiermem
from tiermem.dist.collectives import PeerError
from tiermem.optim.rules import UnsupportedOptimizer

from dist_scenarios import (averaged, barrier, groups_of, kept_at_exit, local_backward,
                            small_cfg, train_pair)
from offload_helpers import Synthetic, compare_runs, compare_state_dicts, make_batches


class LionLike(torch.optim.Optimizer):
    """Lion, written here: the sign of an interpolated momentum, one state tensor."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


class CountingSGD(torch.optim.SGD):
    """A subclass of SGD with a step of its own: momentum SGD whose lr decays with a count
    kept in the group of the steps that updated one of its parameters (a rank owning none
    of a group's parameters never counts it itself), a count kept on the optimizer, and a
    scale the user sets on it."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = 0
        self.scale = 1.0  # a setting the user may change between steps

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            lr = group["lr"] * self.scale / (1 + 0.5 * group.get("updates", 0))
            stepped = False
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                buf = st.get("momentum_buffer")
                if buf is None:
                    buf = st["momentum_buffer"] = p.grad.clone()
                else:
                    buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-lr)
                stepped = True
            if stepped:
                group["updates"] = group.get("updates", 0) + 1
        return None


class ScaledSGD(CountingSGD):
    """CountingSGD taking GradScaler's hand-over itself, as torch's fused kernels do: skip
    on inf, else divide each gradient by the scale in place."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        if getattr(self, "found_inf", None) is not None and float(self.found_inf):
            return None
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(scale)
        return super().step(closure)


class GroupNorm(LionLike):
    """Divides every gradient by the group's gradient norm: it couples the parameters."""

    couples = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads)) if grads else 1.0
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm if self.couples else p.grad, alpha=-group["lr"])
        return None


class LossScaled(LionLike):
    """Scales its lr by the loss its closure returns (as EmoNavi reads the loss)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    scale = 1.0 if loss is None else float(loss)
                    p.add_(p.grad, alpha=-group["lr"] * scale)
        return loss


def _lion(m):
    from lion_pytorch import Lion
    return Lion(groups_of(m), lr=1e-3, weight_decay=0.01)


def _schedulefree(m):
    from schedulefree import AdamWScheduleFree
    return AdamWScheduleFree(groups_of(m), lr=1e-2, warmup_steps=2, weight_decay=0.01)


OPTIMIZERS = {
    "lion-like": lambda m: LionLike(groups_of(m), lr=1e-3, weight_decay=0.01),
    "counting-sgd": lambda m: CountingSGD(groups_of(m), lr=1e-2, momentum=0.9),
    "lion": _lion,
    "schedulefree": _schedulefree,
}


def _equal(rank: int, model, ref_model, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"rank {rank} {what} {n}"


def generic_parity(rank: int, world: int, tmp: str, name: str, grads: str = "reduce_scatter",
                   backend: str = "threads", durability: str = "scratch") -> None:
    """Weights equal the plain optimizer's on the mean gradient after every step, with the
    state on NVMe; state_dict() inside the block (the group values a step keeps: counts,
    schedule-free's k and weight_sum, on every rank, owner of the group or not) equals
    torch's, and loading it back steps on equal; schedule-free's eval()/train() rewrite the
    weights on every rank as the plain optimizer's do; the state is whole at exit."""
    make = OPTIMIZERS[name]
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref_model)
    cfg = small_cfg(tmp, backend=backend, grads=grads)
    cfg["swap"]["durability"] = durability
    batches = make_batches(model, 5, seed=10 + rank)
    modes = callable(getattr(type(opt), "train", None))

    def steps(first: int, n: int) -> None:
        for i, micro in enumerate(batches[first:first + n], start=first):
            local_backward(model, micro, i, rank)
            if grads == "allreduced":  # the mean on every rank, as DDP leaves them
                averaged(model, world)
            opt.step()
            opt.zero_grad()
            local_backward(ref_model, micro, i, rank)
            averaged(ref_model, world)
            ref_opt.step()
            ref_opt.zero_grad()
            _equal(rank, model, ref_model, f"step {i}")

    with tiermem.offload(opt, cfg) as tm:
        if modes:
            opt.train()
            ref_opt.train()
            # (schedule-free's train() leaves an empty entry per parameter in torch's
            # state_dict, which tiermem does not keep, in one process too)
        else:
            compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        steps(0, 3)
        sd = opt.state_dict()
        compare_state_dicts(sd, ref_opt.state_dict(), exact=True)
        if modes:  # the weights rewritten from the state, every rank's share on every rank
            opt.eval()
            ref_opt.eval()
            _equal(rank, model, ref_model, "eval()")
            compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
            opt.train()
            ref_opt.train()
            _equal(rank, model, ref_model, "train()")
        opt.load_state_dict(sd)
        if name == "counting-sgd":
            opt.scale = ref_opt.scale = 0.5
        steps(3, 2)
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
        plan = tm.plan()
    compare_runs(model, opt, ref_model, ref_opt, exact=True)
    compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
    if name == "counting-sgd":
        assert opt.calls == ref_opt.calls == 5, (opt.calls, ref_opt.calls)
    # whole parameters: every parameter is in one rank's share, and the state was on disk
    held = [p for g in opt.param_groups for p in g["params"]]
    assert sum(r["share_elements"] for r in plan["ranks"]) == sum(p.numel() for p in held)
    assert plan["state_bytes"]["nvme"] > 0, plan["state_bytes"]


def closure(rank: int, world: int, tmp: str) -> None:
    """step(closure): tiermem evaluates the closure once, as the plain step does, and steps
    on the mean gradient; an optimizer that reads the loss is refused on every rank (each
    rank's closure gives its own batch's loss), before anything moves."""
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS["lion-like"](model), OPTIMIZERS["lion-like"](ref_model)
    batches = make_batches(model, 3, seed=10 + rank)
    with tiermem.offload(opt, small_cfg(tmp)):
        for i, micro in enumerate(batches):
            def fn():
                local_backward(model, micro, i, rank)
                return torch.tensor(float(i))

            def ref_fn():
                local_backward(ref_model, micro, i, rank)
                averaged(ref_model, world)
                return torch.tensor(float(i))
            assert float(opt.step(fn)) == float(ref_opt.step(ref_fn)) == i
            opt.zero_grad()
            ref_opt.zero_grad()
            _equal(rank, model, ref_model, f"step {i}")
    compare_runs(model, opt, ref_model, ref_opt, exact=True)

    model = Synthetic()
    opt = LossScaled(groups_of(model), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with tiermem.offload(opt, small_cfg(tmp), name="loss"):
        try:
            opt.step(lambda: (local_backward(model, batches[0], 0, rank), torch.tensor(1.0))[1])
        except UnsupportedOptimizer as exc:
            assert "uses the loss its closure returns" in str(exc), exc
        else:
            raise AssertionError("a loss-reading step(closure) under a process group ran")
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.zero_grad()


def added_group(rank: int, world: int, tmp: str) -> None:
    """A group added inside the block (a subclass of SGD with its own step, counting in its
    groups) is cut into shares as at set-up and steps as the plain optimizer's; one whose
    settings make the step couple its parameters is refused on every rank, not added."""
    def make(m):
        return CountingSGD(groups_of(m)[:1], lr=1e-2, momentum=0.9)

    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref_model)
    with tiermem.offload(opt, small_cfg(tmp, timeout=60), model=model):
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
        for o, m in ((opt, model), (ref_opt, ref_model)):
            # zero_grad() never cleared it: the gradients it piled up are not the mean's
            m.side.bias.grad = None
            o.add_param_group({"params": [m.side.bias], "lr": 5e-3})
        train_pair(rank, world, model, opt, ref_model, ref_opt, 3, first=2)
        compare_state_dicts(opt.state_dict(), ref_opt.state_dict(), exact=True)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)

    class Couples(CountingSGD):
        """Couples the parameters of a group whose settings say so."""

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                if group.get("normed"):
                    grads = [p.grad for p in group["params"] if p.grad is not None]
                    norm = torch.sqrt(sum((g ** 2).sum() for g in grads)) if grads else 1.0
                    for g in grads:
                        g.div_(norm)
            return super().step(closure)

    model = Synthetic()
    groups = groups_of(model)
    opt = Couples(groups[:1], lr=1e-2, momentum=0.9)
    with tiermem.offload(opt, small_cfg(tmp, timeout=60), model=model, name="couples"):
        try:
            opt.add_param_group({**groups[1], "normed": True})
        except UnsupportedOptimizer as exc:
            assert "couples its parameters" in str(exc), exc
        else:
            raise AssertionError("a coupling group was added")
        assert len(opt.param_groups) == 1


def coupling_refused(rank: int, world: int, tmp: str) -> None:
    """An optimizer coupling its parameters is refused on every rank by the probe, which
    runs on synthetic parameters: the same answer everywhere, nothing changed, no hang. One
    that couples on one rank only (other settings there) is refused on every rank too: the
    ranks that accepted it hear of the refusal instead of waiting in set-up."""
    model = Synthetic()
    before = [p.detach().clone() for p in model.parameters()]
    opt = GroupNorm(groups_of(model), lr=1e-2)
    try:
        with tiermem.offload(opt, small_cfg(tmp, timeout=20)):
            pass
    except UnsupportedOptimizer as exc:
        assert "couples its parameters" in str(exc), exc
    else:
        raise AssertionError("a coupling optimizer under a process group was tiered")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state

    opt = GroupNorm(groups_of(model), lr=1e-2)
    opt.couples = rank == world - 1
    try:
        with tiermem.offload(opt, small_cfg(tmp, timeout=20), name="one"):
            pass
    except UnsupportedOptimizer as exc:
        if rank == world - 1:
            assert "couples its parameters" in str(exc), exc
        else:
            assert f"other ranks refused it (rank {world - 1}: UnsupportedOptimizer: " \
                in str(exc) and "couples its parameters" in str(exc), exc
    except PeerError as exc:
        raise AssertionError(f"rank {rank} waited for the refusing rank: {exc}") from exc
    else:
        raise AssertionError(f"rank {rank} tiered an optimizer another rank refused")


def half_loaded_one_rank(rank: int, world: int, tmp: str) -> None:
    """A load that fails part-way on one rank only (its records' write, or tiermem.dist's
    own cutting of the share once the groups are loaded): the next step is refused on every
    rank, naming that rank's failed load, before any of its collectives (the others used
    to enter them and wait for that rank until the timeout); a load that then succeeds
    everywhere lets the run go on, bitwise the plain optimizer. A load the optimizer class
    refuses before changing anything leaves that rank's state usable."""
    import tiermem.optim.offloaded as offloaded
    from tiermem.dist.collectives import RankMismatch
    from tiermem.dist.sharded import DistributedOffload

    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt = LionLike(groups_of(model), lr=1e-3, weight_decay=0.01)
    ref_opt = LionLike(groups_of(ref_model), lr=1e-3, weight_decay=0.01)

    def half(tiers, parts, keys, state):
        real_scatter(tiers, parts[: len(parts) // 2], keys, state)
        raise OSError("injected: writing a record failed")

    def no_piece(*args, **kwargs):
        raise OSError("injected: cutting the share failed")

    def no_load(*args, **kwargs):
        raise ValueError("injected: the optimizer class refused the state dict")

    real_scatter = offloaded.scatter
    with tiermem.offload(opt, small_cfg(tmp, timeout=20)):
        train_pair(rank, world, model, opt, ref_model, ref_opt, 1)
        sd = opt.state_dict()
        for where, name, fault in [(offloaded, "scatter", half),
                                   (DistributedOffload, "_piece", no_piece)]:
            real = getattr(where, name)
            if rank == world - 1:
                setattr(where, name, fault)
            try:
                opt.load_state_dict(sd)
            except OSError:
                assert rank == world - 1
            finally:
                setattr(where, name, real)
            local_backward(model, make_batches(model, 2, seed=10 + rank)[1], 1, rank)
            try:
                opt.step()
            except RankMismatch as exc:
                assert "load_state_dict() failed part-way" in str(exc), exc
            except PeerError as exc:
                raise AssertionError(f"rank {rank} waited for the refusing rank ({name}): "
                                     f"{exc}") from exc
            else:
                raise AssertionError(f"rank {rank} stepped while rank {world - 1}'s state "
                                     f"was half loaded ({name})")
            opt.zero_grad()
            opt.load_state_dict(sd)
        # The class's own load refusing before it changed anything, on that rank: its state
        # is as it was, so no rank refuses the steps after it
        real_load = torch.optim.Optimizer.load_state_dict
        if rank == world - 1:
            torch.optim.Optimizer.load_state_dict = no_load
        try:
            opt.load_state_dict(sd)
        except ValueError as exc:
            assert rank == world - 1 and "the load changed nothing" in str(exc.__notes__)
        finally:
            torch.optim.Optimizer.load_state_dict = real_load
        ref_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2, first=1)
        _equal(rank, model, ref_model, "after the load")
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def _lion_pair(tmp: str, durability: str):
    """A model, a LionLike over it, their plain copies, and a config of that durability."""
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    cfg = small_cfg(tmp, timeout=20)
    cfg["swap"]["durability"] = durability
    return (model, LionLike(groups_of(model), lr=1e-3, weight_decay=0.01), ref_model,
            LionLike(groups_of(ref_model), lr=1e-3, weight_decay=0.01), cfg)


def _left_faulty(rank: int, world: int, durability: str, run, step: int,
                 on_error: bool = False, last_says: str = "") -> None:
    """`run(last)` trains `step` steps in a block named "f" and makes the last rank's share
    unusable or unwritable there (raising _Crash on every rank when `on_error`). After the
    block: the last rank said `last_says` (scratch: that its share is lost), the others
    named it; opt.step() is refused on every rank (scratch, on the last one: the state is
    lost); crash_consistent: every rank resumes step `step` and goes on bitwise the plain
    optimizer. `run` returns (model, opt, ref_model, ref_opt, cfg)."""
    last = rank == world - 1
    said = ""
    try:
        model, opt, ref_model, ref_opt, cfg = run(last)
    except (_Crash, tiermem.TierMemError) as exc:
        assert on_error == isinstance(exc, _Crash), exc
        said = str(exc) + str(getattr(exc, "__notes__", ""))
        model, opt, ref_model, ref_opt, cfg = exc.pair
    else:
        raise AssertionError("the block was left without a word")
    lost = last and durability == "scratch"
    if last:
        want = ("lost" if on_error else "its share is lost") if lost else last_says
        assert want in said, said
    elif not on_error:
        assert f"rank(s) [{world - 1}]" in said, said
    try:
        opt.step()
    except tiermem.TierMemError as exc:
        assert ("is lost" if lost else "was kept on disk") in str(exc), exc
    else:
        raise AssertionError(f"rank {rank} stepped with its share on disk or lost")
    if durability == "scratch":
        return
    tiermem.optim.handle.forget_kept(opt)
    with tiermem.offload(opt, cfg, model=model, name="f", resume=True) as tm:
        assert tm.resumed_step == step, tm.resumed_step
        train_pair(rank, world, model, opt, ref_model, ref_opt, 1, first=step)
    compare_runs(model, opt, ref_model, ref_opt, exact=True)


def unusable_share_left(rank: int, world: int, tmp: str, durability: str,
                        on_error: bool) -> None:
    """A block left (normally, or on an exception on every rank) with one rank's share half
    loaded: that share reaches no manifest. scratch: it is lost, and that rank's opt.step()
    says so (it used to start the optimizer over there, the others' steps refused);
    crash_consistent: its last commit stays on disk, and every rank resumes it, bitwise the
    plain optimizer."""
    import tiermem.optim.offloaded as offloaded

    real_scatter = offloaded.scatter

    def half(tiers, parts, keys, state):
        real_scatter(tiers, parts[: len(parts) // 2], keys, state)
        raise OSError("injected: writing a record failed")

    def run(last):
        pair = _lion_pair(tmp, durability)
        model, opt, ref_model, ref_opt, cfg = pair
        try:
            with tiermem.offload(opt, cfg, model=model, name="f"):
                train_pair(rank, world, model, opt, ref_model, ref_opt, 1)
                sd = opt.state_dict()
                if last:
                    offloaded.scatter = half
                try:
                    opt.load_state_dict(sd)
                except OSError:
                    assert last
                finally:
                    offloaded.scatter = real_scatter
                if on_error:
                    raise _Crash
        except BaseException as exc:
            exc.pair = pair
            raise
        return pair

    _left_faulty(rank, world, durability, run, 1, on_error,
                 "committed step 1" if on_error else "its share was unusable")


def write_back_failed_at_exit(rank: int, world: int, tmp: str, durability: str) -> None:
    """One rank's write-back fails for good as the block ends (its flush raises): that
    rank's records are in buffers only. scratch: its share is lost, and its opt.step() says
    so (it used to start the optimizer over there); crash_consistent: its last commit stays
    on disk, the other rank keeps its share, and every rank resumes, bitwise the plain
    optimizer."""
    def broken_disk():
        raise tiermem.TierMemError("injected: a write-back failed for good")

    def run(last):
        pair = _lion_pair(tmp, durability)
        model, opt, ref_model, ref_opt, cfg = pair
        try:
            with tiermem.offload(opt, cfg, model=model, name="f") as tm:
                train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
                if last:
                    tm.offloaded.tiers.flush = broken_disk
        except BaseException as exc:
            exc.pair = pair
            if last:
                assert "could not be written back (injected" in str(exc), exc
            raise
        return pair

    _left_faulty(rank, world, durability, run, 2, last_says="of committed step 2 stays on disk")


def loose_state_refused(rank: int, world: int, tmp: str) -> None:
    """State under a key that is no parameter (MADGRAD's state['k']) is no rank's share."""
    model = Synthetic()
    opt = LionLike(groups_of(model))
    opt.state["k"] = torch.tensor(0)
    try:
        with tiermem.offload(opt, small_cfg(tmp)):
            pass
    except UnsupportedOptimizer as exc:
        assert "it keeps state under 'k', a key that is no parameter" in str(exc), exc
    else:
        raise AssertionError("state under a key that is no parameter was tiered")

    class CountsInState(LionLike):
        @torch.no_grad()
        def step(self, closure=None):
            self.state["k"] = self.state.get("k", 0) + 1
            return super().step(closure)

    opt = CountsInState(groups_of(model))
    try:
        with tiermem.offload(opt, small_cfg(tmp), name="made"):
            pass
    except UnsupportedOptimizer as exc:
        assert "it keeps state under 'k', a key that is no parameter" in str(exc), exc
    else:
        raise AssertionError("state a step makes under a key that is no parameter was tiered")


def resume(rank: int, world: int, tmp: str, name: str) -> None:
    """A crash-consistent run kept on disk at exit resumes on every rank (the counts its
    step keeps in the groups and on itself too) and goes on as the uninterrupted plain
    optimizer on the mean gradient."""
    make = OPTIMIZERS[name]
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref_model)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    modes = callable(getattr(type(opt), "train", None))
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="r"):
        if modes:
            opt.train()
            ref_opt.train()
        train_pair(rank, world, model, opt, ref_model, ref_opt, 2)
    assert not opt.state
    fresh = make(model)  # a new process's optimizer: the counts come from the disk
    with tiermem.offload(fresh, cfg, model=model, name="r", resume=True) as tm:
        assert tm.resumed_step == 2, tm.resumed_step
        # the group values of a group's owner on every rank (updates of param_groups[1],
        # whose one parameter one rank owns)
        compare_state_dicts(fresh.state_dict(), ref_opt.state_dict(), exact=True)
        train_pair(rank, world, model, fresh, ref_model, ref_opt, 2, first=2)
        compare_state_dicts(fresh.state_dict(), ref_opt.state_dict(), exact=True)
    compare_runs(model, fresh, ref_model, ref_opt, exact=True)


class _Crash(Exception):
    pass


def resume_after_crash(rank: int, world: int, tmp: str) -> None:
    """A crash right after a step's commit: each rank's manifest holds the group values its
    own step left, written before the ranks shared them (a rank owning no parameter of
    param_groups[1] has no count there). The resume takes them from each group's owner,
    so every rank holds the plain optimizer's."""
    from unittest import mock

    from tiermem.optim.offloaded import OffloadedOptimizer

    def crashed(off):  # what a crash leaves: the last commit, nothing written after it
        d = off.tiers.run_dir()
        off.close_tiers(remove_swap=False, flush=False)
        return d

    make = OPTIMIZERS["counting-sgd"]
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make(model), make(ref_model)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    try:
        with mock.patch.object(OffloadedOptimizer, "keep_on_disk", crashed), \
                tiermem.offload(opt, cfg, model=model, name="c"):
            train_pair(rank, world, model, opt, ref_model, ref_opt, 3)
            raise _Crash
    except _Crash:
        pass
    fresh = make(model)
    with tiermem.offload(fresh, cfg, model=model, name="c", resume=True) as tm:
        assert tm.resumed_step == 3, tm.resumed_step
        compare_state_dicts(fresh.state_dict(), ref_opt.state_dict(), exact=True)
        train_pair(rank, world, model, fresh, ref_model, ref_opt, 1, first=3)
    compare_runs(model, fresh, ref_model, ref_opt, exact=True)


def kept(rank: int, world: int, tmp: str) -> None:
    """Crash-consistent Lion whose shares stay on disk at exit, for `tiermem recover` in the
    test process: rank 0 saves what the plain optimizer and model hold after the same steps."""
    model = Synthetic()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS["counting-sgd"](model), OPTIMIZERS["counting-sgd"](ref_model)
    cfg = small_cfg(tmp)
    cfg["swap"]["durability"] = "crash_consistent"
    with kept_at_exit(), tiermem.offload(opt, cfg, model=model, name="kept"):
        train_pair(rank, world, model, opt, ref_model, ref_opt, 3)
    if rank == 0:
        torch.save({"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict()},
                   os.path.join(tmp, "kept.expected.pt"))
    barrier()


def run_named(rank: int, world: int, base: str, names: list[str], extra: dict) -> dict:
    from dist_harness import run_in_dirs

    table = {
        "lion-like": lambda r, d: generic_parity(r, world, d, "lion-like"),
        "lion-like-allreduced-io_uring": lambda r, d: generic_parity(
            r, world, d, "lion-like", "allreduced", backend="io_uring"),
        "counting-sgd": lambda r, d: generic_parity(r, world, d, "counting-sgd"),
        "counting-sgd-allreduced": lambda r, d: generic_parity(r, world, d, "counting-sgd",
                                                               "allreduced"),
        "lion": lambda r, d: generic_parity(r, world, d, "lion", "allreduced"),
        "schedulefree": lambda r, d: generic_parity(r, world, d, "schedulefree"),
        "schedulefree-allreduced-crash-consistent": lambda r, d: generic_parity(
            r, world, d, "schedulefree", "allreduced", durability="crash_consistent"),
        "closure": lambda r, d: closure(r, world, d),
        "coupling-refused": lambda r, d: coupling_refused(r, world, d),
        "added-group": lambda r, d: added_group(r, world, d),
        "loose-state-refused": lambda r, d: loose_state_refused(r, world, d),
        "half-loaded-one-rank": lambda r, d: half_loaded_one_rank(r, world, d),
        "resume-schedulefree": lambda r, d: resume(r, world, d, "schedulefree"),
        "resume-after-crash": lambda r, d: resume_after_crash(r, world, d),
        "kept": lambda r, d: kept(r, world, d),
        **{f"unusable-share-left-{durability}{'-on-error' * on_error}":
           (lambda r, d, durability=durability, on_error=on_error:
            unusable_share_left(r, world, d, durability, on_error))
           for durability in ("scratch", "crash_consistent") for on_error in (False, True)},
        **{f"write-back-failed-at-exit-{durability}":
           (lambda r, d, durability=durability: write_back_failed_at_exit(r, world, d,
                                                                          durability))
           for durability in ("scratch", "crash_consistent")},
    }

    return run_in_dirs(rank, base, table, names)

