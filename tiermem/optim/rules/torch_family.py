"""torch.optim's elementwise optimizers (SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam,
Adadelta, ASGD, Rprop), each run by torch's own functional implementation.

A record holds, per element, an fp32 master weight when the update cannot run on the
parameter itself (as for Adam) and the optimizer's per-element state tensors under
torch's own key names, in the parameter's dtype for fp32 models (fp32 otherwise).
Per-parameter scalars (step; ASGD's eta and mu; NAdam's mu_product) stay on the host
with the optimizer (OffloadedOptimizer.steps / .scalars) and go into the manifest.

The update hands torch's `_single_tensor_X` / `_multi_tensor_X` / `_fused_X` the
partition's segment views: the same elementwise arithmetic on the same values as the
plain optimizer, and parameters are cut only at multiples of 1024 elements, so the
results are bitwise equal. torch's functions increment the step counts and update the
scalars they are given: the rule hands them private copies (see Batch.scalars).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import Tensor
from torch.optim import (adadelta, adagrad, adamax, asgd, nadam, radam, rmsprop, rprop,
                         sgd)

from tiermem.kernels.adagrad import adagrad_update
from tiermem.kernels.sgd import sgd_update
from tiermem.optim.rules.base import (Batch, UnsupportedOptimizer, UpdateRule,
                                      check_group_tensors)
from tiermem.partition import Partition, state_kinds

MASTER_KEY = "master_param"  # fp32 master weight of a low-precision param, in state_dict()


def implementation(group: dict[str, Any], kernel: str, has_fused: bool) -> str:
    """"single_tensor", "multi_tensor" or "fused": what runs a group with these flags.

    kernel "match" and "auto" (and "native", which only Adam has) are what the plain
    optimizer runs on the CPU: the default keeps the torch family bitwise equal to the
    plain optimizer (tiermem's native kernels run where they equal that bit for bit, see
    TorchRule.wants_native); "fused" is torch's fused kernel where the optimizer has one,
    else the match."""
    if kernel in ("single_tensor", "multi_tensor"):  # already matched (kernel_matching)
        return kernel
    if kernel == "fused" and has_fused:
        return "fused"
    if group.get("fused"):
        return "fused"
    # torch defaults foreach to True only for CUDA tensors; tiermem's CPU updates see
    # host tensors, where the default is the for-loop.
    return "multi_tensor" if group.get("foreach") else "single_tensor"


class TorchRule(UpdateRule):
    """One torch.optim optimizer, run by its module's functional implementations."""

    elementwise = True
    auto_kernel = "match"
    fixed_keys = True
    module: ClassVar[Any]
    name: ClassVar[str]  # the functions' suffix: _single_tensor_<name>, ...
    has_fused: ClassVar[bool] = False

    def __init__(self, *, state_dtype: str = "fp32", state_rounding: str = "nearest") -> None:
        if state_dtype != "fp32":
            raise UnsupportedOptimizer(
                f"optimizer.state_dtype {state_dtype} runs tiermem's native Adam kernel; "
                f"{self.optimizers[0].__name__} keeps fp32 state: use state_dtype fp32")

    @property
    def torch_keys(self) -> dict[str, str]:  # type: ignore[override]
        return {"master": MASTER_KEY, **{k: k for k in self.all_kinds}}

    all_kinds: ClassVar[tuple[str, ...]] = ()

    def _check(self, opt: torch.optim.Optimizer) -> None:
        for g, group in enumerate(opt.param_groups):
            check_group_tensors(g, group, elementwise=True)
            if group.get("capturable"):
                raise UnsupportedOptimizer(f"param_groups[{g}]: capturable=True is for CUDA "
                                           "graphs; tiermem updates outside them")

    def kinds(self, param: torch.Tensor, group: dict[str, Any], *, keep_master: bool
              ) -> tuple[str, ...]:
        master = state_kinds(param, False, keep_master)[:-2]  # ("master",) or ()
        return master + self.kinds_for(group)

    def check_group(self, part: Partition, group: dict[str, Any]) -> None:
        want = self.kinds_for(group)
        have = tuple(k for k in part.kinds if k != "master")
        if want != have:
            raise UnsupportedOptimizer(
                f"param_groups[{part.group}]: the group's settings now need state "
                f"{list(want)}, tiermem.offload laid out {list(have)}; set momentum, "
                "centered and the like before entering offload")

    def first_fill(self, group: dict[str, Any]) -> dict[str, float]:
        """State kinds torch starts at a value other than zero."""
        return {}

    #: implementations (see implementation()) the rule's native kernel equals bitwise
    native_matches: ClassVar[tuple[str, ...]] = ()

    def check(self, opt: torch.optim.Optimizer) -> None:
        self._groups = opt.param_groups
        self._check(opt)

    def wants_native(self, kernel: str, part: Partition, *, on_host: bool) -> bool:
        """tiermem's one-pass kernel (native/rules.c) runs fp32 CPU partitions whose group's
        implementation it equals bitwise: it returns the CRCs of what it wrote, so a
        checksummed record needs no second pass."""
        if not self.native_matches or not on_host:
            return False
        impl = implementation(self._groups[part.group], kernel, self.has_fused)
        if impl not in self.native_matches:
            return False
        self._native_impl = impl
        return all(s.param.device.type == "cpu" and s.param.dtype == torch.float32
                   and (s.param.grad is None or s.param.grad.dtype == torch.float32)
                   for s in part.segments)

    def update(self, batch: Batch, *, kernel: str) -> list[dict[str, int]] | None:
        group = batch.group
        fill = self.first_fill(group)
        if fill:
            for j, first in enumerate(batch.first):
                if first:
                    for k, v in fill.items():
                        batch.state[k][j].fill_(v)
        if kernel == "native":
            names = tuple("params" if k == "master" else k for k in batch.checksums)
            got = self.run_native(batch, group, names)
            return [{("master" if k == "params" else k): c for k, c in crcs.items()}
                    for crcs in got]
        impl = implementation(group, kernel, self.has_fused)
        fn = getattr(self.module, f"_{impl}_{self.name}")
        # torch's loops increment the step counts they are given: private copies of the
        # count before this step.
        before = [s - 1 for s in batch.steps]
        self.run(fn, batch, before, group, impl)
        return None

    def run_native(self, batch: Batch, group: dict[str, Any], checksums: tuple[str, ...]
                   ) -> list[dict[str, int]]:
        raise NotImplementedError

    def run(self, fn: Callable, batch: Batch, steps: list[Tensor], group: dict[str, Any],
            impl: str) -> None:
        raise NotImplementedError


def _flags(group: dict[str, Any], *names: str) -> dict[str, Any]:
    return {n: group[n] for n in names}


_PLAIN = dict(differentiable=False, capturable=False, has_complex=False)


def _nesterov_into_grads(group: dict[str, Any]) -> bool:
    """torch's foreach SGD adds the nesterov term into the gradient tensors themselves
    when nothing made a copy of them first (maximize negates, weight decay adds into a
    new list)."""
    return bool(group["momentum"] != 0 and group["nesterov"] and not group["maximize"]
                and group["weight_decay"] == 0)


class SGDRule(TorchRule):
    optimizers = (torch.optim.SGD,)
    module, name, has_fused = sgd, "sgd", True
    all_kinds = ("momentum_buffer",)
    has_step = False
    # (skip_makes_state stays False) torch's fused SGD leaves the buffer of a parameter
    # whose first step GradScaler skips uninitialised (torch.empty_like) and steps on from
    # it: tiermem keeps what GradScaler means, and what it gives the unfused SGD, which it
    # never calls on such a step: no state, the next step is the first
    native_matches = ("fused", "single_tensor", "multi_tensor")

    def run_native(self, batch, group, checksums):
        bufs = batch.state.get("momentum_buffer", [])
        crcs = sgd_update(kernel="native", params=batch.params, grads=batch.grads,
                          momentum_buffers=bufs, first=batch.first, checksums=checksums,
                          match=self._native_impl, num_threads=batch.threads,
                          **_flags(group, "lr", "momentum", "dampening", "weight_decay",
                                   "nesterov", "maximize"))
        if self._native_impl == "multi_tensor" and _nesterov_into_grads(group):
            # what torch's foreach SGD leaves in p.grad (the native pass reads it only): a
            # loop that reads or accumulates into p.grad after the step sees the same
            torch._foreach_add_(batch.grads, bufs, alpha=group["momentum"])
        return crcs

    def writes_group_grads(self, group, kernel):
        return (implementation(group, kernel, self.has_fused) == "multi_tensor"
                and _nesterov_into_grads(group))

    def kinds_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def keeps_entry(self, group: dict[str, Any]) -> bool:
        return group["momentum"] != 0

    def run(self, fn, batch, steps, group, impl):
        bufs = batch.state.get("momentum_buffer")
        kw = dict(weight_decay=group["weight_decay"], momentum=group["momentum"],
                  lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
                  maximize=group["maximize"], has_sparse_grad=False)
        if bufs is None:
            fn(batch.params, batch.grads, [None] * len(batch.params), None, None, **kw)
            return
        # torch starts a momentum buffer from the first gradient (not from zero): a
        # segment at its parameter's first step gets None, and its new buffer is copied in.
        fresh = [j for j, f in enumerate(batch.first) if f]
        if impl == "fused" and fresh and len(fresh) < len(bufs):
            # the fused kernel takes all-first or none-first lists: run the two apart
            rest = [j for j in range(len(bufs)) if j not in fresh]
            for idx in (fresh, rest):
                sub = Batch(batch.part, group, [batch.params[j] for j in idx],
                            [batch.grads[j] for j in idx], [batch.steps[j] for j in idx],
                            {"momentum_buffer": [bufs[j] for j in idx]},
                            first=[batch.first[j] for j in idx])
                self.run(fn, sub, [], group, impl)
            return
        given: list[Tensor | None] = [None if f else b for b, f in zip(bufs, batch.first)]
        fn(batch.params, batch.grads, given, None, None, **kw)
        for j in fresh:
            if given[j] is not bufs[j]:
                bufs[j].copy_(given[j])


class AdagradRule(TorchRule):
    optimizers = (torch.optim.Adagrad,)
    module, name, has_fused = adagrad, "adagrad", True
    all_kinds = ("sum",)
    eager_state = True
    skip_makes_state = True  # (a group added after construction: its first step's)
    # torch's for-loop and foreach Adagrad round a few elements differently (addcdiv)
    native_matches = ("fused",)

    def run_native(self, batch, group, checksums):
        return adagrad_update(kernel="native", params=batch.params, grads=batch.grads,
                              state_sums=batch.state["sum"], steps=batch.steps,
                              checksums=checksums, num_threads=batch.threads,
                              **_flags(group, "lr", "lr_decay", "weight_decay", "eps",
                                       "maximize"))

    def kinds_for(self, group):
        return ("sum",)

    def check(self, opt):
        super().check(opt)
        self._defaults = opt.defaults

    def first_fill(self, group):
        # torch fills every accumulator with the constructor's value, which its defaults
        # keep: __init__ for the groups it was given, its step for a group added later,
        # whatever initial_accumulator_value a group sets
        return {"sum": self._defaults["initial_accumulator_value"]}

    def run(self, fn, batch, steps, group, impl):
        fn(batch.params, batch.grads, batch.state["sum"], steps, None, None,
           has_sparse_grad=False, differentiable=False, has_complex=False,
           **_flags(group, "lr", "weight_decay", "lr_decay", "eps", "maximize"))


class RMSpropRule(TorchRule):
    optimizers = (torch.optim.RMSprop,)
    module, name = rmsprop, "rmsprop"
    all_kinds = ("square_avg", "momentum_buffer", "grad_avg")

    def kinds_for(self, group):
        return (("square_avg",) + (("momentum_buffer",) if group["momentum"] > 0 else ())
                + (("grad_avg",) if group["centered"] else ()))

    def run(self, fn, batch, steps, group, impl):
        st = batch.state
        fn(batch.params, batch.grads, st["square_avg"], st.get("grad_avg", []),
           st.get("momentum_buffer", []), steps, **_PLAIN,
           **_flags(group, "lr", "alpha", "eps", "weight_decay", "momentum", "centered",
                    "maximize"))


class AdamaxRule(TorchRule):
    optimizers = (torch.optim.Adamax,)
    module, name = adamax, "adamax"
    all_kinds = ("exp_avg", "exp_inf")

    def kinds_for(self, group):
        return self.all_kinds

    def run(self, fn, batch, steps, group, impl):
        beta1, beta2 = group["betas"]
        fn(batch.params, batch.grads, batch.state["exp_avg"], batch.state["exp_inf"], steps,
           beta1=beta1, beta2=beta2, **_PLAIN,
           **_flags(group, "eps", "lr", "weight_decay", "maximize"))


class NAdamRule(TorchRule):
    optimizers = (torch.optim.NAdam,)
    module, name = nadam, "nadam"
    all_kinds = ("exp_avg", "exp_avg_sq")

    def kinds_for(self, group):
        return self.all_kinds

    def scalar_keys(self, group):
        return ("mu_product",)

    def initial_scalars(self, group):
        return {"mu_product": 1.0}

    def run(self, fn, batch, steps, group, impl):
        beta1, beta2 = group["betas"]
        fn(batch.params, batch.grads, batch.state["exp_avg"], batch.state["exp_avg_sq"],
           [s["mu_product"] for s in batch.scalars], steps, beta1=beta1, beta2=beta2,
           **_PLAIN, **_flags(group, "lr", "weight_decay", "momentum_decay", "eps",
                              "decoupled_weight_decay", "maximize"))


class RAdamRule(TorchRule):
    optimizers = (torch.optim.RAdam,)
    module, name = radam, "radam"
    all_kinds = ("exp_avg", "exp_avg_sq")

    def kinds_for(self, group):
        return self.all_kinds

    def run(self, fn, batch, steps, group, impl):
        beta1, beta2 = group["betas"]
        fn(batch.params, batch.grads, batch.state["exp_avg"], batch.state["exp_avg_sq"],
           steps, beta1=beta1, beta2=beta2, **_PLAIN,
           **_flags(group, "lr", "weight_decay", "eps", "decoupled_weight_decay",
                    "maximize"))


class AdadeltaRule(TorchRule):
    optimizers = (torch.optim.Adadelta,)
    module, name = adadelta, "adadelta"
    all_kinds = ("square_avg", "acc_delta")

    def kinds_for(self, group):
        return self.all_kinds

    def run(self, fn, batch, steps, group, impl):
        fn(batch.params, batch.grads, batch.state["square_avg"], batch.state["acc_delta"],
           steps, **_PLAIN, **_flags(group, "lr", "rho", "eps", "weight_decay", "maximize"))


class ASGDRule(TorchRule):
    optimizers = (torch.optim.ASGD,)
    module, name = asgd, "asgd"
    all_kinds = ("ax",)

    def kinds_for(self, group):
        return ("ax",)

    def scalar_keys(self, group):
        return ("eta", "mu")

    def initial_scalars(self, group):
        return {"eta": float(group["lr"]), "mu": 1.0}

    def run(self, fn, batch, steps, group, impl):
        fn(batch.params, batch.grads, batch.state["ax"], [s["mu"] for s in batch.scalars],
           [s["eta"] for s in batch.scalars], steps, **_PLAIN,
           **_flags(group, "lambd", "lr", "t0", "alpha", "weight_decay", "maximize"))


class RpropRule(TorchRule):
    optimizers = (torch.optim.Rprop,)
    module, name = rprop, "rprop"
    all_kinds = ("prev", "step_size")

    def kinds_for(self, group):
        return self.all_kinds

    def first_fill(self, group):
        lr = group["lr"]
        return {"step_size": lr.item() if isinstance(lr, Tensor) else lr}

    def run(self, fn, batch, steps, group, impl):
        etaminus, etaplus = group["etas"]
        step_size_min, step_size_max = group["step_sizes"]
        fn(batch.params, batch.grads, batch.state["prev"], batch.state["step_size"], steps,
           step_size_min=step_size_min, step_size_max=step_size_max, etaminus=etaminus,
           etaplus=etaplus, maximize=group["maximize"], capturable=False,
           differentiable=False, has_complex=False)


TORCH_RULES: tuple[type[TorchRule], ...] = (
    SGDRule, AdagradRule, RMSpropRule, AdamaxRule, NAdamRule, RAdamRule, AdadeltaRule,
    ASGDRule, RpropRule)
