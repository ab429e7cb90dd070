"""torch's AveragedModel (SWA, EMA) over a model whose weights the parameter tier holds.

`AveragedModel.update_parameters(model)` reads every parameter of the model between
steps, outside its forward: with parameters.offload most of them are released there
(p.data an empty tensor), and the update failed with a size mismatch naming no
parameter. Lightning's WeightAveraging and EMAWeightAveraging callbacks call it after
every step. While a block with a parameter tier is open, the method is wrapped: over a
model holding parameters of the tier it runs torch's own method on a few pairs of
(averaged, model) tensors at a time, with the model's weights of those pairs brought
into the window for the call, so the window bounds the memory it takes.

Every pair's result is that of the call over the whole model: torch's averaging is
elementwise per tensor (the default SWA average, `avg_fn`, which is called per pair,
and torch's own `get_ema_multi_avg_fn` / `get_swa_multi_avg_fn`, whose foreach kernels
compute each tensor alone). A `multi_avg_fn` of the user's own sees lists of tensors
and may combine them, so it gets the whole model in one call: refused with a
TierMemError when the window cannot hold it. `n_averaged` moves once per call, as in
torch.

A call over a model with none of the tier's parameters is torch's own, unchanged. A
reference to the method taken before the block (`update = avg.update_parameters`) is
not covered.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, ContextManager, Iterable, Protocol

import torch
from torch.optim import swa_utils

from tiermem.errors import TierMemError
from tiermem.sizes import format_size


class Averager(Protocol):
    """An open block's parameter tier, as the wrapper sees it."""

    def held(self, p: torch.Tensor) -> bool: ...
    def weights_in_memory(self, params: Iterable[torch.Tensor], *,
                          changed: bool = False) -> ContextManager[None]: ...
    def weight_shape(self, p: torch.Tensor) -> torch.Size: ...
    def weight_bytes(self, p: torch.Tensor) -> int: ...
    def window_bytes(self) -> int: ...


# The open blocks' tiers, innermost last.
_OPEN: list[Averager] = []


class _Side:
    """What torch's update_parameters reads of an AveragedModel, or of the model, over some
    of the pairs: their tensors as parameters, the buffers it keeps in step (or none)."""

    def __init__(self, tensors: list[torch.Tensor], buffers: list[torch.Tensor],
                 averaged: Any = None) -> None:
        self._tensors, self._buffers = tensors, buffers
        self.module = self
        if averaged is not None:
            self.use_buffers = averaged.use_buffers
            self.avg_fn = averaged.avg_fn
            self.multi_avg_fn = averaged.multi_avg_fn
            # torch adds 1 to it at the end of each call: a copy, added to once by the caller
            self.n_averaged = averaged.n_averaged.clone()

    def parameters(self) -> Iterable[torch.Tensor]:
        return iter(self._tensors)

    def buffers(self) -> Iterable[torch.Tensor]:
        return iter(self._buffers)


def window_chunks(tier: Averager, pairs: list[tuple[Any, torch.Tensor]]
                  ) -> list[list[tuple[Any, torch.Tensor]]]:
    """`pairs` (anything, a model's tensor) cut in runs whose tier weights take half the
    window at most (the weights the tier keeps pinned, none between steps, and a read
    ahead in flight keep their room), in order; one pair at least each."""
    window = tier.window_bytes()
    chunks: list[list[tuple[Any, torch.Tensor]]] = []
    chunk: list[tuple[Any, torch.Tensor]] = []
    held = 0
    for a, p in pairs:
        n = tier.weight_bytes(p) if tier.held(p) else 0
        if chunk and held + n > window // 2:
            chunks.append(chunk)
            chunk, held = [], 0
        chunk.append((a, p))
        held += n
    if chunk:
        chunks.append(chunk)
    return chunks


def _torchs_own(fn: Any) -> bool:
    """A multi_avg_fn made by torch.optim.swa_utils (elementwise per tensor)."""
    return getattr(fn, "__module__", None) == swa_utils.__name__


def _owner(tensors: list[torch.Tensor]) -> Averager | None:
    for averager in reversed(_OPEN):
        if any(averager.held(t) for t in tensors):
            return averager
    return None


def _update_parameters(original: Callable[..., Any], averaged: Any, model: Any) -> None:
    mine = (list(itertools.chain(averaged.module.parameters(), averaged.module.buffers()))
            if averaged.use_buffers else list(averaged.parameters()))
    theirs = (list(itertools.chain(model.parameters(), model.buffers()))
              if averaged.use_buffers else list(model.parameters()))
    tier = _owner(theirs)
    if tier is None:
        return original(averaged, model)
    pairs = list(zip(mine, theirs))  # torch zips them as loosely (strict=False)
    for a, p in pairs:
        if tier.held(p) and a.shape != tier.weight_shape(p):
            raise TierMemError(
                f"AveragedModel.update_parameters: the averaged copy of a parameter of shape "
                f"{tuple(tier.weight_shape(p))} has shape {tuple(a.shape)}. An AveragedModel "
                "made inside the tiermem.offload block copies the parameter tier's empty "
                "placeholders (parameters.offload); make AveragedModel(model) before entering "
                "the block")
    window = tier.window_bytes()
    whole = sum(tier.weight_bytes(p) for _, p in pairs if tier.held(p))
    if averaged.multi_avg_fn is not None and not _torchs_own(averaged.multi_avg_fn):
        if whole > window // 2:
            raise TierMemError(
                f"AveragedModel.update_parameters with a multi_avg_fn of its own over a model "
                f"whose weights are in tiermem's parameter tier: it sees the lists of all the "
                f"model's tensors at once, so all its weights ({format_size(whole)}) must be "
                f"in memory together, and parameters.window ({format_size(window)}) holds "
                f"half of that at most for them. Raise parameters.window to "
                f"{format_size(2 * whole)}, or average with avg_fn= (called per parameter) "
                "or torch.optim.swa_utils.get_ema_multi_avg_fn()")
        chunks = [pairs]
    else:
        chunks = window_chunks(tier, pairs)
    buffers = ([] if averaged.use_buffers else
               (list(averaged.module.buffers()), list(model.buffers())))
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        sync = buffers if last and buffers else ([], [])
        weights = [p for _, p in chunk if tier.held(p)]
        with tier.weights_in_memory(weights) if weights else contextlib.nullcontext():
            original(_Side([a for a, _ in chunk], sync[0], averaged),
                     _Side([p for _, p in chunk], sync[1]))
    averaged.n_averaged += 1


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_parameters(averaged: Any, model: Any) -> None:
        return _update_parameters(original, averaged, model)
    return update_parameters


_REPLACED: list[Any] = []  # the method open_tier replaced, to put back


def open_tier(averager: Averager) -> None:
    """`averager`'s block opened: AveragedModel.update_parameters routes to it (wrapped at
    the first open block)."""
    if not _OPEN:
        original = vars(swa_utils.AveragedModel)["update_parameters"]
        _REPLACED.append(original)
        swa_utils.AveragedModel.update_parameters = _wrapped(original)
    _OPEN.append(averager)


def close_tier(averager: Averager) -> None:
    """`averager`'s block is over (idempotent): the method is torch's again once no block
    is open."""
    if averager in _OPEN:
        _OPEN.remove(averager)
    if not _OPEN and _REPLACED:
        swa_utils.AveragedModel.update_parameters = _REPLACED.pop()
