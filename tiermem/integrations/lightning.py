"""`TiermemCallback`: every optimizer of a LightningModule tiered for the whole `trainer.fit`.

    trainer = L.Trainer(callbacks=[TiermemCallback("configs/nvme.yaml")], ...)
    trainer.fit(module)                       # or trainer.fit(module, ckpt_path=...)

The block of `tiermem.offload` is entered in `on_fit_start` (Lightning has built the
optimizers; a `ckpt_path=` resume loads their state after this hook, through the hooked
`load_state_dict`, straight into the tiers) and left in `on_fit_end`, or in `on_exception`
with the exception, so a failed or interrupted fit leaves through the same exit as
`with tiermem.offload(...)`. Checkpoints need nothing: Lightning saves `optimizer.state_dict()`,
which tiermem answers in torch's format.

With `pipeline.overlap_backward`, Lightning's automatic optimization needs two things the
callback does: the backward of each micro-batch that only accumulates runs inside
`tm.accumulating()` (`on_before_backward` / `on_after_backward`), and `optimizer.step(closure)`
(how Lightning always steps, and refused under overlap) runs the closure first and then
steps without it, which is what torch's Adam does with a closure. Gradient clipping edits
gradients after backward started the update: refused up front with overlap.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from typing import Any

import lightning.pytorch as pl
import torch

import tiermem
from tiermem.config import load_config
from tiermem.errors import TierMemError
from tiermem.integrations import leave
from tiermem.optim import averaging
from tiermem.optim.hooks import installed


class TiermemCallback(pl.Callback):
    """Tier the state of every optimizer of the LightningModule during `trainer.fit`.

    config: as `tiermem.offload` takes it (YAML path, dict, Settings, None).
    offload_kwargs: passed to `tiermem.offload` (name=, process_group=, resume=); model= is
    the LightningModule. With several optimizers, optimizer i gets the swap name `<name>-i`.
    """

    def __init__(self, config: Any = None, **offload_kwargs: Any) -> None:
        if "model" in offload_kwargs:
            raise TypeError("TiermemCallback passes the LightningModule as model=")
        self.config = config
        self.offload_kwargs = offload_kwargs
        self.handles: list[Any] = []  # one `tm` per optimizer, while the fit runs
        self._stack: contextlib.ExitStack | None = None
        self._accumulating: contextlib.ExitStack | None = None
        self._overlap = False

    @property
    def tm(self) -> Any:
        """The `tm` of the (single) optimizer: stats(), plan(), accumulating()."""
        if len(self.handles) != 1:
            raise TierMemError(f"{len(self.handles)} optimizers are tiered now: use .handles")
        return self.handles[0]

    # -- entering --------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        settings = load_config(self.config)
        self._overlap = settings.pipeline.overlap_backward
        if self._overlap and trainer.gradient_clip_val:
            raise TierMemError(
                "gradient_clip_val cannot be used with pipeline.overlap_backward: true (the "
                "update starts during backward, before Lightning clips); drop one of them")
        optimizers = _wrapped(trainer, pl_module)
        if not optimizers:
            raise TierMemError("TiermemCallback: the LightningModule has no optimizer")
        if len(optimizers) > 1 and settings.parameters.offload != "none":
            # each optimizer's block would take the whole module's weights into a tier of
            # its own: the second finds them taken (empty) and fails on that instead
            raise TierMemError(
                f"parameters.offload: {settings.parameters.offload} cannot be used with "
                f"{len(optimizers)} optimizers: the parameter tier holds the weights of the "
                "whole LightningModule for one optimizer; use one optimizer (param groups) "
                "or parameters.offload: none")
        name = self.offload_kwargs.get("name", "default")
        kwargs = {k: v for k, v in self.offload_kwargs.items() if k != "name"}
        stack = contextlib.ExitStack()
        handles = []
        try:
            for i, opt in enumerate(optimizers):
                swap_name = name if len(optimizers) == 1 else f"{name}-{i}"
                handles.append(stack.enter_context(
                    tiermem.offload(opt, settings, model=pl_module, name=swap_name, **kwargs)))
                if self._overlap:
                    if handles[-1].offloaded.rule.uses_loss():
                        # Lightning's closure returns the loss only after its backward has
                        # started the update: the step would never see it, as plain does
                        raise TierMemError(
                            f"pipeline.overlap_backward cannot be used with "
                            f"{type(handles[-1].optimizer).__name__} under Lightning: its "
                            "step uses the loss of the closure Lightning passes, and the "
                            "update starts during that closure's backward; set "
                            "overlap_backward: false")
                    _closure_first(handles[-1].optimizer)
            if settings.parameters.offload != "none":
                _route_weight_averaging(trainer, handles[0], stack)
        except BaseException as exc:
            stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._stack, self.handles = stack, handles

    # -- overlap: accumulation -------------------------------------------------

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        # Manual optimization decides itself when it steps: its own code wraps its
        # backwards in callback.tm.accumulating().
        if (self._stack is None or not self._overlap or not pl_module.automatic_optimization
                or not trainer.fit_loop._should_accumulate()):
            return
        acc = contextlib.ExitStack()
        for tm in self.handles:
            acc.enter_context(tm.accumulating())
        self._accumulating = acc

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc, self._accumulating = self._accumulating, None
        if acc is not None:
            acc.close()

    # -- leaving ---------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._leave(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Reached without on_fit_end or on_exception only if Lightning changes its order of
        # hooks; leaving here still hands the state back rather than keeping the hooks.
        self._leave(None)

    def _leave(self, exc: BaseException | None) -> None:
        acc, self._accumulating = self._accumulating, None
        if acc is not None:
            acc.close()
        stack, self._stack = self._stack, None
        self.handles = []
        leave(stack, exc)  # an error of the exit itself: Lightning raises that instead


def _wrapped(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    """The trainer's optimizers as `self.optimizers()` gives them to the module (in their
    LightningOptimizer), which tiermem.offload unwraps (tm.plan() says so); the plain
    optimizer where Lightning has wrapped none (a wrapper of another one is not used).
    Either way the wrapper's zero_grad, state_dict and train()/eval() reach the tiers:
    tiermem.offload routes them for every wrapper of the optimizer it tiers
    (tiermem/optim/wrappers.py)."""
    plain = list(trainer.optimizers)
    wrapped = pl_module.optimizers(use_pl_optimizer=True)
    wrapped = wrapped if isinstance(wrapped, list) else [wrapped]
    if len(wrapped) != len(plain):
        return plain
    return [w if getattr(w, "optimizer", None) is opt else opt
            for w, opt in zip(wrapped, plain)]


def _closure_first(opt: torch.optim.Optimizer) -> None:
    """Make `opt.step(closure)` run the closure, then tiermem's step without it (overlap).

    Set on the instance over tiermem's own hook, so leaving the block (which restores the
    methods the instance had before tiermem) removes it too."""
    if installed(opt) is None:  # not hooked (never expected): leave step alone
        return
    hooked = opt.step

    def step(opt_self: torch.optim.Optimizer, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hooked()
        return loss

    step._wrapped_by_lr_sched = True  # as tiermem's hook: lr schedulers see it stepped
    opt.step = types.MethodType(step, opt)


class _Tensors:
    """A module as Lightning's WeightAveraging reads one (and the AveragedModel it keeps, as
    `_average_model`, whose `.module` is itself): some of the tensors as its parameters, no
    buffers."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors
        self.module = self
        self._average_model = self

    def parameters(self) -> Any:
        return iter(self._tensors)

    def buffers(self) -> Any:
        return iter(())


def _in_window(original: Any, callback: Any, tm: Any, pl_module: pl.LightningModule) -> None:
    """Lightning's WeightAveraging._swap_models / _copy_average_to_current over a module in
    the parameter tier: its own method, on a few (averaged, current) pairs at a time, the
    current weights of those brought into the window and written back after (the methods
    write through p.data, which no version counter sees)."""
    average = callback._average_model
    if average is None:
        return original(callback, pl_module)
    pairs = list(zip(itertools.chain(average.module.parameters(), average.module.buffers()),
                     itertools.chain(pl_module.parameters(), pl_module.buffers())))
    for chunk in averaging.window_chunks(tm, pairs):
        with tm.weights_in_memory([p for _, p in chunk if tm.held(p)], changed=True):
            original(_Tensors([a for a, _ in chunk]), _Tensors([p for _, p in chunk]))


def _route_weight_averaging(trainer: pl.Trainer, tm: Any, stack: contextlib.ExitStack) -> None:
    """Lightning's WeightAveraging callbacks (EMAWeightAveraging) swap the averaged weights
    in for validation and copy them in at the end of training through p.data of every
    parameter: with the weights in the parameter tier the released ones are empty there
    (a size mismatch naming nothing), and a change to a live one was lost at its release.
    Routed through the window for the fit (AveragedModel.update_parameters, which they
    call after each step, is routed by tiermem.optim.averaging)."""
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # a Lightning without weight averaging callbacks
        return
    for callback in trainer.callbacks:
        if not isinstance(callback, WeightAveraging):
            continue
        for name in ("_swap_models", "_copy_average_to_current"):
            original = getattr(type(callback), name, None)
            if original is None or name in vars(callback):
                continue
            setattr(callback, name, functools.partial(_in_window, original, callback, tm))
            stack.callback(vars(callback).pop, name, None)
