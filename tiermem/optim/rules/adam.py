"""Adam and AdamW: torch.optim.Adam's update, on one partition's record.

A record holds, per element: an fp32 master weight when the update cannot run on
the parameter itself (a low-precision or device parameter, or a crash-consistent
run, which commits weights with the state), exp_avg, exp_avg_sq, and
max_exp_avg_sq with amsgrad; moments in fp32, or bf16 with optimizer.state_dtype.
The update runs one of kernels.adam's kernels, all behind one dispatcher.

With state_dtype int8 the moments are blockwise 8-bit codes with their scales
(partition.SCALE_KINDS) and the update runs kernels.lowbit per segment. A bf16 or
fp16 parameter's record holds, per optimizer.master_weights, an fp32 master, a Kahan
compensation term in the parameter's dtype, or no weight at all; without an fp32 master
the update runs kernels.lowbit per segment whatever the moments' format (int8, fp32 or
bf16: the same weight arithmetic, the same random streams). Without an fp32 master a
crash-consistent record also holds the model's bf16 (or fp16) weights (kind "weight"):
the update runs on the model's weights as in a scratch run, and OffloadedOptimizer
copies them into the record right after, so a commit holds the weights and the state of
the same step.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.kernels.adam import adam_update
from tiermem.kernels.lowbit import CRC_ARRAYS, lowbit_update
from tiermem.kernels.native_adam import AdamRunTable, state_seed, tail_len
from tiermem.optim.rules.base import (Batch, PreparedUpdate, UpdateRule, Views,
                                      check_group_tensors)
from tiermem.partition import QUANT_BLOCK, Partition, flat, state_kinds

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MASTER_KEY = "master_param"  # fp32 master weight of a low-precision param, in state_dict()
MIXED_OUT = (torch.bfloat16, torch.float16)  # model dtypes the native kernel writes directly
# kinds holding the weights themselves: an fp32 master, or (master_weights kahan/none,
# crash-consistent) a copy of the model's bf16 or fp16 weights
WEIGHT_KINDS = ("master", "weight")


class AdamRule(UpdateRule):
    """torch.optim.Adam / AdamW (every flag but differentiable), on any tier."""

    optimizers = (torch.optim.Adam,)
    elementwise = True
    torch_keys = {"master": MASTER_KEY, **{k: k for k in MOMENTS}}
    fixed_keys = True
    skip_makes_state = True

    def __init__(self, *, state_dtype: str = "fp32", state_rounding: str = "nearest",
                 master_weights: str = "fp32") -> None:
        self.state_dtype = state_dtype
        self.state_rounding = state_rounding
        self.master_weights = master_weights

    def check(self, opt: torch.optim.Optimizer) -> None:
        self._groups = opt.param_groups
        for g, group in enumerate(opt.param_groups):
            check_group_tensors(g, group, elementwise=True)
            if self.state_dtype == "int8" and group.get("amsgrad"):
                raise TierMemError(
                    f"param_groups[{g}]: optimizer.state_dtype int8 keeps no max_exp_avg_sq; "
                    "use amsgrad=False, or state_dtype fp32 or bf16")
            for p in group["params"]:
                if self.state_dtype != "fp32":
                    self._check_low_state(g, p)

    def _check_low_state(self, g: int, p: torch.Tensor) -> None:
        """The parameter dtypes low-bit state runs with. (bf16 moments are updated by the
        native CPU kernel only: a model off the CPU has them with step_device cpu, its grads
        brought to the host by the lanes; config refuses them with step_device device and
        OffloadedOptimizer on the gpu tier.)"""
        if p.is_meta and self.state_dtype == "bf16":
            # nothing to read: the native kernel takes real memory (torch's own kernels
            # step meta tensors as a no-op)
            raise TierMemError(
                f"param_groups[{g}]: optimizer.state_dtype {self.state_dtype} runs tiermem's "
                f"native kernel, which needs the weights' memory, and a parameter is on meta; "
                "materialise the model first (or give parameters.offload, which builds it)")
        if p.dtype not in (torch.float32, *MIXED_OUT):
            raise TierMemError(
                f"param_groups[{g}]: optimizer.state_dtype {self.state_dtype} supports fp32, "
                f"bf16 and fp16 parameters, not {p.dtype}")

    def kinds(self, param: torch.Tensor, group: dict[str, Any], *, keep_master: bool
              ) -> tuple[str, ...]:
        return state_kinds(param, bool(group.get("amsgrad", False)), keep_master,
                           self.state_dtype, self.master_weights)

    def check_group(self, part: Partition, group: dict[str, Any]) -> None:
        if bool(group.get("amsgrad")) != ("max_exp_avg_sq" in part.kinds):
            raise TierMemError(f"param_groups[{part.group}]: amsgrad changed after "
                               "tiermem.offload laid out the state; set it before")

    def kinds_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return tuple(k for k in MOMENTS if k != "max_exp_avg_sq" or group.get("amsgrad"))

    def check_loaded(self, part: Partition, saved: dict[str, Any]) -> None:
        laid = "max_exp_avg_sq" in part.kinds
        if bool(saved.get("amsgrad")) != laid:
            # (say both values: "has not" left which side had amsgrad to guess)
            # amsgrad turned off: the checkpoint's max_exp_avg_sq, which torch keeps unused,
            # is refused at entry too (OffloadedOptimizer._refuse_unkept_keys)
            drop = (", without the max_exp_avg_sq it keeps unused (tiermem refuses to "
                    "drop it silently)") if laid else ""
            raise TierMemError(
                f"param_groups[{part.group}]: the checkpoint has amsgrad="
                f"{bool(saved.get('amsgrad'))} and tiermem.offload laid the state out for "
                f"amsgrad={laid}; load the checkpoint into the optimizer before entering "
                f"tiermem.offload, which then lays the state out for it{drop}")

    def init(self, part: Partition, views: Views) -> None:
        """Zero moments; the master weights (or the bf16 weights' copy) from the model."""
        for k in views:
            if k not in WEIGHT_KINDS:
                views[k].zero_()  # moments, int8 scales and a Kahan term all start at 0
        for k in WEIGHT_KINDS:
            if k in views:
                off = 0
                for s in part.segments:
                    views[k][off: off + s.length].copy_(
                        flat(s.param.detach())[s.start: s.start + s.length])
                    off += s.length

    def lowbit(self, params) -> bool:
        """Whether kernels.lowbit updates these (a partition's or a batch's) weights: int8
        state, or a low-precision weight without an fp32 master (master_weights kahan/none,
        whatever the moments' format)."""
        return self.state_dtype == "int8" or (
            self.master_weights != "fp32" and any(p.dtype != torch.float32 for p in params))

    def wants_native(self, kernel: str, part: Partition, *, on_host: bool) -> bool:
        """The native kernel's single pass (grads of any float dtype in, low-precision
        weights out, CRCs) runs this partition: bf16 state always, int8 state (or bf16
        weights without a master) in place on the host, and with kernel native or auto
        (the default: native is the faster one there) CPU models in fp32, bf16 or fp16."""
        if self.state_dtype != "bf16" and self.lowbit(s.param for s in part.segments):
            # Elsewhere (a GPU-tier record, a device slot of the lanes) the gathered update
            # runs kernels.lowbit's reference, bit for bit the native pass.
            return on_host
        if self.state_dtype == "bf16":
            return True
        if kernel == "auto" and _loop_betas(self._groups[part.group]):
            return False  # auto_for's match: torch's own loop, bit for bit
        return kernel in ("native", "auto") and on_host and all(
            s.param.is_cpu and s.param.dtype in (torch.float32, *MIXED_OUT)
            for s in part.segments)

    def auto_for(self, group: dict[str, Any]) -> str:
        # torch's for-loop computes tensor betas' bias corrections in fp32 tensor
        # arithmetic, which the fused kernels (torch's and the native one) do in double:
        # 7e-7 apart after 20 steps, where with float betas the two stay an ulp or two
        # apart. Only the plain optimizer's own loop then equals it.
        return "match" if _loop_betas(group) else self.auto_kernel

    def update(self, batch: Batch, *, kernel: str) -> list[dict[str, int]] | None:
        group = batch.group
        if self.lowbit(batch.params):
            return self._update_lowbit(batch)
        native: dict[str, Any] = {}  # what only the native kernel takes
        if kernel == "native" and self.state_dtype == "fp32":
            # where the plain fused optimizer's scalar loop runs: the native kernel matches it
            native["torch_tails"] = [tail_len(s.param.numel(), s.start, s.length)
                                     for s in batch.segments]
        if self.state_dtype == "bf16":
            # Stochastic rounding draws the bits of stream (step, parameter) at each
            # element's position in its parameter, as int8 moments do: the bits do not
            # depend on the layout (partition_size, durability's master in the record, a
            # rank's share), and a rerun rounds the same way.
            native = dict(rounding=self.state_rounding,
                          offsets=[start for _, start in batch.origins],
                          seeds=[state_seed(step=s, partition=index)
                                 for s, (index, _) in zip(batch.steps, batch.origins)])
        hyper = _hyperparameters(group)
        if kernel in ("single_tensor", "multi_tensor"):
            # torch's own loops take tensor betas as they are: their lerp weight and bias
            # corrections are then fp32 tensor arithmetic, which Python floats round
            # otherwise (the plain optimizer hands them the group's betas unconverted)
            hyper["beta1"], hyper["beta2"] = group["betas"]
        return adam_update(
            kernel=kernel, params=batch.params, grads=batch.grads,
            exp_avgs=batch.state["exp_avg"], exp_avg_sqs=batch.state["exp_avg_sq"],
            max_exp_avg_sqs=batch.state.get("max_exp_avg_sq", []), steps=batch.steps,
            amsgrad=bool(group["amsgrad"]), weights_out=batch.weights_out,
            checksums=batch.checksums, num_threads=batch.threads, **hyper, **native)

    def prepare_together(self, batches: Sequence[Batch], *, kernel: str
                         ) -> PreparedUpdate | None:
        """Batches of one group with fp32 moments and nothing in the pass but the update
        (and low-precision weights out): one native call for all their segments
        (kernels.native_adam.AdamRunTable), the same bits as a call per batch."""
        if (kernel != "native" or self.state_dtype != "fp32" or not batches
                or any(b.checksums or b.group is not batches[0].group
                       or self.lowbit(b.params) for b in batches)):
            return None
        return AdamTogether(batches)

    def _update_lowbit(self, batch: Batch) -> list[dict[str, int]]:
        """kernels.lowbit per segment: the native pass on CPU tensors, the torch reference
        elsewhere (bitwise the same). params[i] is the fp32 weight the update runs on (a
        master, or an fp32 model), or with master_weights kahan/none the bf16 or fp16 model
        weight itself; the moments are int8 codes with their scales, or fp32 / bf16 values."""
        group = batch.group
        beta1, beta2 = (float(b) for b in group["betas"])
        st = {k: v for k, v in batch.state.items() if k != "weight"}
        out = []
        for i, param in enumerate(batch.params):
            master = "fp32" if param.dtype == torch.float32 else self.master_weights
            native = param.device.type == "cpu" and batch.grads[i].device.type == "cpu"
            # The kernel's "master" array is `param`: an fp32 master's CRC, or, without one,
            # that of the bf16 weights the caller copies into the record's "weight" kind
            # right after (the same bytes).
            # (amsgrad's max has no CRC from the pass: such a record is hashed by the store)
            wanted = [k for k in batch.checksums if k in CRC_ARRAYS and k not in WEIGHT_KINDS]
            if ("master" if master == "fp32" else "weight") in batch.checksums:
                wanted.append("master")
            index, start = batch.origins[i]
            crcs = int8_segment(
                kernel="native" if native else "reference", start=start,
                param_index=index, param=param, grad=batch.grads[i],
                exp_avg=st["exp_avg"][i], exp_avg_sq=st["exp_avg_sq"][i],
                exp_avg_scale=st["exp_avg_scale"][i] if "exp_avg_scale" in st else None,
                exp_avg_sq_scale=(st["exp_avg_sq_scale"][i] if "exp_avg_sq_scale" in st
                                  else None),
                kahan=st["kahan"][i] if "kahan" in st else None,
                max_exp_avg_sq=(st["max_exp_avg_sq"][i] if "max_exp_avg_sq" in st
                                else None),
                weight_out=batch.weights_out[i] if batch.weights_out else None,
                master=master, step=batch.steps[i], lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"],
                maximize=bool(group["maximize"]),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
                rounding=self.state_rounding, num_threads=batch.threads,
                checksums=wanted if native else ())
            if master != "fp32" and "master" in crcs:
                crcs["weight"] = crcs.pop("master")
            out.append(crcs)
        return out


class AdamTogether(PreparedUpdate):
    """Adam's update of several host records in one native call, its argument table laid
    out once (AdamRule.prepare_together): each parameter's whole gradient is a slot, and
    its segments read theirs from where they start in it."""

    def __init__(self, batches: Sequence[Batch]) -> None:
        slot_of: dict[int, int] = {}
        numels: list[int] = []
        self.slots = []
        grad_of = []
        params, outs = [], []
        state: dict[str, list[torch.Tensor]] = {k: [] for k in batches[0].state}
        for b in batches:
            for i, s in enumerate(b.segments):
                if s.index not in slot_of:
                    slot_of[s.index] = len(self.slots)
                    self.slots.append(s.index)
                    numels.append(s.param.numel())
                grad_of.append((slot_of[s.index], s.start))
                params.append(b.params[i])
                outs.append(b.weights_out[i] if b.weights_out else None)
                for k, lst in state.items():
                    lst.append(b.state[k][i])
        self.table = AdamRunTable(
            params=params, exp_avgs=state["exp_avg"], exp_avg_sqs=state["exp_avg_sq"],
            max_exp_avg_sqs=state.get("max_exp_avg_sq", []), weights_out=outs,
            amsgrad="max_exp_avg_sq" in state, grad_of=grad_of, grad_numels=numels)

    def run(self, *, grads: Sequence[torch.Tensor], steps: Sequence[torch.Tensor],
            group: dict[str, Any], threads: int | None) -> None:
        self.table.step(grads=grads, steps=steps, num_threads=threads,
                        **_hyperparameters(group))


def _loop_betas(group: dict[str, Any]) -> bool:
    """The plain optimizer runs torch's for-loop on tensor betas (fused takes them as
    floats; foreach refuses them unless capturable)."""
    return not group.get("fused") and any(isinstance(b, torch.Tensor) for b in group["betas"])


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """An Adam param group's hyperparameters as the kernels take them (amsgrad aside)."""
    beta1, beta2 = (float(b) for b in group["betas"])
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], maximize=bool(group["maximize"]),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)))


WINDOW = 1 << 32  # elements of one stream window (the kernels' 32-bit counter)
ARRAYS = ("param", "grad", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale",
          "kahan", "max_exp_avg_sq", "weight_out")


def int8_segment(*, kernel: str, start: int, param_index: int, step, checksums=(),
                 **kwargs) -> dict[str, int]:
    """kernels.lowbit's `kernel` on one segment: elements start .. start+n of parameter
    `param_index` (kwargs: the segment's ARRAYS and the hyperparameters; no scales with
    fp32 or bf16 moments).

    Element e of parameter k draws its rounding bits from stream (step, k) at index e, and
    quantisation blocks start at multiples of BLOCK of the parameter (partition cuts fall
    on CUT_ALIGN): the update does not depend on how parameters are cut into partitions,
    ranks' shares or segments. A segment crossing a 2^32-element window of its stream (the
    kernels' counter is 32 bits) runs as one call per window; its CRCs (one per array and
    call) are then left out, and the store hashes the record."""
    n = kwargs["param"].numel()
    cuts = [0]
    nxt = (start // WINDOW + 1) * WINDOW - start
    while nxt < n:
        cuts.append(nxt)
        nxt += WINDOW
    if len(cuts) > 1 and start % QUANT_BLOCK and kwargs.get("exp_avg_scale") is not None:
        # (a share cut off CUT_ALIGN, e.g. an FSDP2 shard): a window cut would split a block
        raise TierMemError(
            f"parameter {param_index}: an int8 segment at element {start} crosses a "
            f"2^32-element window of its random stream off a {QUANT_BLOCK}-element block "
            "boundary; use optimizer.state_dtype fp32 or bf16 for this parameter's sharding")
    seed = state_seed(step=step, partition=param_index)
    if len(cuts) == 1:
        return lowbit_update(kernel=kernel, step=step, seed=seed, offset=start,
                             checksums=checksums, **kwargs)
    for a, b in zip(cuts, cuts[1:] + [n]):
        piece = {k: v if k not in ARRAYS or v is None else
                 v[a // QUANT_BLOCK: -(-b // QUANT_BLOCK)] if k.endswith("_scale") else v[a:b]
                 for k, v in kwargs.items()}
        lowbit_update(kernel=kernel, step=step, seed=seed, offset=start + a, checksums=(),
                      **piece)
    return {}
