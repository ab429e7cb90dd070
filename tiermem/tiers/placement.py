"""Placement: which tier each partition's record lives on, within the tiers' budgets.

Placement rules (`placement:`, first match on the parameter name) force a tier;
the rest fill the GPU tier, then the host tier, in partition order, and
everything else lives on NVMe. `Budgets` keeps what is left of each capacity
across add_param_group calls.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tiermem.config import ConfigError
from tiermem.errors import TierMemError
from tiermem.partition import Partition


class Budgets:
    """Bytes left on the gpu and host tiers; assign() places new partitions."""

    def __init__(self, gpu: int, host: int) -> None:
        self.left = {"gpu": gpu, "host": host}

    def assign(self, parts: Sequence[Partition]) -> None:
        """Give each of `parts` its tier and take its bytes from that tier's budget; refuse a
        gpu tier without CUDA or for CPU parameters. Nothing changes when it raises."""
        for p in parts:
            devices = {s.param.device.type for s in p.segments}
            if p.forced == "gpu" or (p.forced is None and self.left["gpu"] >= p.record_bytes):
                if not torch.cuda.is_available():
                    raise TierMemError("tiers.gpu.capacity > 0 (or a rule sends state to the "
                                       "gpu tier) but no CUDA device is available")
                if devices != {"cuda"}:
                    raise TierMemError("the gpu tier holds state of CUDA parameters only; "
                                       "this model's parameters are on the CPU")
        assign_tiers(parts, self.left["gpu"], self.left["host"])
        for p in parts:
            if p.tier in self.left:
                self.left[p.tier] -= p.record_bytes


def assign_tiers(parts: Sequence[Partition], gpu_capacity: int, host_capacity: int) -> None:
    """Forced partitions keep their tier; the rest fill gpu -> host -> nvme in order.

    Raises ConfigError when rules alone put more on a tier than its capacity."""
    left = {"gpu": gpu_capacity, "host": host_capacity}
    for part in parts:
        if part.forced is not None:
            part.tier = part.forced
            if part.tier in left:
                left[part.tier] -= part.record_bytes
    for tier, room in left.items():
        if room < 0:
            raise ConfigError("placement", f"rules with tier: {tier}",
                              f"they put {-room} bytes more state on the {tier} tier than "
                              f"tiers.{tier}.capacity allows")
    for part in parts:
        if part.forced is not None:
            continue
        part.tier = "nvme"
        for tier in ("gpu", "host"):
            if part.record_bytes <= left[tier]:
                left[tier] -= part.record_bytes
                part.tier = tier
                break
