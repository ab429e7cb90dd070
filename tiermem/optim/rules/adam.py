"""Adam and AdamW: torch.optim.Adam's update, on one partition's record.

A record holds, per element: an fp32 master weight when the update cannot run on
the parameter itself (a low-precision or device parameter, or a crash-consistent
run, which commits weights with the state), exp_avg, exp_avg_sq, and
max_exp_avg_sq with amsgrad; moments in fp32, or bf16 with optimizer.state_dtype.
The update runs one of kernels.adam's kernels, all behind one dispatcher.
"""

from __future__ import annotations

from typing import Any

import torch

from tiermem.errors import TierMemError
from tiermem.kernels.adam import adam_update
from tiermem.kernels.native_adam import state_seed
from tiermem.optim.rules.base import Batch, UpdateRule, Views, check_group_tensors
from tiermem.partition import Partition, state_kinds

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MASTER_KEY = "master_param"  # fp32 master weight of a low-precision param, in state_dict()
MIXED_OUT = (torch.bfloat16, torch.float16)  # model dtypes the native kernel writes directly


class AdamRule(UpdateRule):
    """torch.optim.Adam / AdamW (every flag but differentiable), on any tier."""

    optimizers = (torch.optim.Adam,)
    elementwise = True
    torch_keys = {"master": MASTER_KEY, **{k: k for k in MOMENTS}}

    def __init__(self, *, state_dtype: str = "fp32", state_rounding: str = "nearest") -> None:
        self.state_dtype = state_dtype
        self.state_rounding = state_rounding

    def check(self, opt: torch.optim.Optimizer) -> None:
        for g, group in enumerate(opt.param_groups):
            check_group_tensors(g, group)
            for p in group["params"]:
                if self.state_dtype == "bf16":
                    self._check_bf16_state(g, p)

    @staticmethod
    def _check_bf16_state(g: int, p: torch.Tensor) -> None:
        """bf16 moments are updated by the native CPU kernel only: refuse what it cannot run."""
        if p.device.type != "cpu":
            raise TierMemError(
                f"param_groups[{g}]: optimizer.state_dtype bf16 needs the Adam step on "
                f"the CPU for now, and a parameter is on {p.device}; use state_dtype "
                "fp32 for models off the CPU")
        if p.dtype not in (torch.float32, *MIXED_OUT):
            raise TierMemError(
                f"param_groups[{g}]: optimizer.state_dtype bf16 supports fp32, bf16 and "
                f"fp16 parameters, not {p.dtype}")

    def kinds(self, param: torch.Tensor, group: dict[str, Any], *, keep_master: bool
              ) -> tuple[str, ...]:
        return state_kinds(param, bool(group.get("amsgrad", False)), keep_master)

    def check_group(self, part: Partition, group: dict[str, Any]) -> None:
        if bool(group.get("amsgrad")) != ("max_exp_avg_sq" in part.kinds):
            raise TierMemError(f"param_groups[{part.group}]: amsgrad changed after "
                               "tiermem.offload laid out the state; set it before")

    def kinds_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return tuple(k for k in MOMENTS if k != "max_exp_avg_sq" or group.get("amsgrad"))

    def check_loaded(self, part: Partition, saved: dict[str, Any]) -> None:
        if bool(saved.get("amsgrad")) != ("max_exp_avg_sq" in part.kinds):
            raise TierMemError(f"param_groups[{part.group}]: the checkpoint has amsgrad="
                               f"{saved.get('amsgrad')}, the state laid out by "
                               "tiermem.offload has not; load it before entering offload")

    def init(self, part: Partition, views: Views) -> None:
        """Zero moments; the master weights from the model."""
        for k in MOMENTS:
            if k in views:
                views[k].zero_()
        if "master" in views:
            off = 0
            for s in part.segments:
                views["master"][off: off + s.length].copy_(
                    s.param.detach().reshape(-1)[s.start: s.start + s.length])
                off += s.length

    def wants_native(self, kernel: str, part: Partition, *, on_host: bool) -> bool:
        """The native kernel's single pass (grads of any float dtype in, low-precision
        weights out, CRCs) runs this partition: bf16 state always, kernel native or auto
        (the default: native is the faster one there) on CPU models in fp32, bf16 or fp16."""
        if self.state_dtype == "bf16":
            return True
        return kernel in ("native", "auto") and on_host and all(
            s.param.device.type == "cpu" and s.param.dtype in (torch.float32, *MIXED_OUT)
            for s in part.segments)

    def update(self, batch: Batch, *, kernel: str) -> list[dict[str, int]] | None:
        group = batch.group
        rounding = {}
        if self.state_dtype == "bf16":
            # Stochastic rounding draws the bits of stream (step, partition) at each
            # element's position in the record, so a rerun, or another cut of the same
            # partition into segments, rounds the same way.
            rounding = dict(rounding=self.state_rounding, offsets=batch.offsets,
                            seeds=[state_seed(step=s, partition=batch.part.id)
                                   for s in batch.steps])
        beta1, beta2 = (float(b) for b in group["betas"])
        return adam_update(
            kernel=kernel, params=batch.params, grads=batch.grads,
            exp_avgs=batch.state["exp_avg"], exp_avg_sqs=batch.state["exp_avg_sq"],
            max_exp_avg_sqs=batch.state.get("max_exp_avg_sq", []), steps=batch.steps,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
            weights_out=batch.weights_out, checksums=batch.checksums, **rounding)
