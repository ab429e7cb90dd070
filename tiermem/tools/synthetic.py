"""Synthetic models of a requested size, for stress runs and benchmarks.

A stack of transformer-like blocks (attention projections, an MLP, two layer
norms: 12h² + 13h parameters each) plus an embedding table that takes up the
remainder, so the parameter count is exactly what was asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tiermem.errors import TierMemError


class ShapeError(TierMemError, ValueError):
    """The asked-for model shape is impossible; the message says which numbers clash."""


def block_params(hidden: int) -> int:
    return 12 * hidden * hidden + 13 * hidden


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    embed_rows: int  # rows of the (embed_rows, hidden) table
    extra: int  # a last 1-D parameter for what no row could hold

    @property
    def params(self) -> int:
        return self.layers * block_params(self.hidden) + self.embed_rows * self.hidden + self.extra


def choose_shape(params: int | None, layers: int | None = None,
                 hidden: int | None = None) -> Shape:
    """Layers and width for `params` (GPT-like: about hidden/64 layers), or as given."""
    if params is None:
        if layers is None or hidden is None:
            raise ShapeError("give --params, or both --layers and --hidden")
        return Shape(layers, hidden, 0, 0)
    if params < 1:
        raise ShapeError(f"--params must be positive, got {params}")
    if hidden is None:
        if layers is not None:
            hidden = max(64, int(math.sqrt(params / (12 * layers))) // 64 * 64)
        else:  # layers ~ hidden / 64  =>  params ~ hidden**3 * 12 / 64
            hidden = max(64, int((params * 64 / 12) ** (1 / 3)) // 64 * 64)
    if layers is None:
        layers = max(0, params // block_params(hidden))
    body = layers * block_params(hidden)
    if body > params:
        raise ShapeError(f"--layers {layers} of --hidden {hidden} already hold {body:,} "
                         f"parameters, more than --params {params:,}: give a larger --params, "
                         "or --layers and --hidden without --params")
    rest = params - body
    return Shape(layers, hidden, rest // hidden, rest % hidden)


def param_shapes(shape: Shape) -> list[tuple[int, ...]]:
    """The shapes of SyntheticModel(shape)'s parameters, without making any."""
    h = shape.hidden
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,),
             (h, 4 * h), (h,)]
    out = block * shape.layers
    if shape.embed_rows:
        out.append((shape.embed_rows, h))
    if shape.extra:
        out.append((shape.extra,))
    return out


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        kw = {"dtype": dtype}  # built in the model's dtype: no fp32 copy of a big model
        self.ln1 = nn.LayerNorm(hidden, **kw)
        self.qkv = nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = nn.Linear(hidden, hidden, **kw)
        self.ln2 = nn.LayerNorm(hidden, **kw)
        self.fc1 = nn.Linear(hidden, 4 * hidden, **kw)
        self.fc2 = nn.Linear(4 * hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class SyntheticModel(nn.Module):
    def __init__(self, shape: Shape, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.shape = shape
        heads = max(1, shape.hidden // 64)
        self.blocks = nn.ModuleList(Block(shape.hidden, heads, dtype)
                                    for _ in range(shape.layers))
        self.embed = nn.Parameter(torch.empty(shape.embed_rows, shape.hidden, dtype=dtype)) \
            if shape.embed_rows else None
        self.extra = nn.Parameter(torch.empty(shape.extra, dtype=dtype)) if shape.extra else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The model's own parameters (the blocks' modules have theirs); also what the
        parameter tier calls when the model was built on the meta device."""
        with torch.no_grad():
            for p in (self.embed, self.extra):
                if p is not None:
                    p.normal_(0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.shape.hidden
        dtype = next(self.parameters()).dtype
        if self.embed is not None:
            x = self.embed[tokens % self.shape.embed_rows]
        else:
            x = torch.ones(*tokens.shape, h, dtype=dtype) * 0.01 * tokens[..., None].to(dtype)
        for block in self.blocks:
            x = block(x)
        loss = x.float().square().mean()
        if self.extra is not None:
            loss = loss + 1e-3 * self.extra.float().square().mean()
        return loss


def build_model(params: int | None, *, layers: int | None = None, hidden: int | None = None,
                dtype: torch.dtype = torch.float32, seed: int = 0,
                meta: bool = False) -> SyntheticModel:
    """meta: built on the meta device (no memory), for parameters.offload to make module by
    module."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return SyntheticModel(choose_shape(params, layers, hidden), dtype)


def fill_synthetic_grads(model: nn.Module, step: int, seed: int = 0) -> None:
    """Gradients from a generator seeded by (seed, step): no forward or backward needed."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_(0, 1e-3, generator=gen)
