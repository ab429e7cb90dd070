"""`TiermemCallback` for the Hugging Face `Trainer`, whose optimizer it builds itself.

    cb = TiermemCallback("configs/nvme.yaml")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    with cb:                                  # an exception leaves the block like offload's
        trainer.train()                       # or trainer.train(resume_from_checkpoint=...)

`on_train_begin` receives the optimizer the Trainer built (`optim="adamw_torch"`,
`"adamw_torch_fused"`, or one passed in `optimizers=`), wrapped by Accelerate, and enters
`tiermem.offload` with it; a `resume_from_checkpoint` has loaded its state just before, and
that state moves into the tiers. `on_train_end` leaves the block. Checkpoints need nothing:
the Trainer saves `optimizer.state_dict()`, which tiermem answers in torch's format.

The Trainer has no exception event, so a failed `train()` is seen only by a `with cb:`
around it, which leaves through the same exit as `with tiermem.offload(...)` (state handed
back or kept on disk, swap removed only when safe, Ctrl-C reported).
"""

from __future__ import annotations

import contextlib
from typing import Any

from transformers import TrainerCallback

import tiermem
from tiermem.config import load_config
from tiermem.errors import TierMemError
from tiermem.integrations import leave


class TiermemCallback(TrainerCallback):
    """Tier the Trainer's optimizer state from `on_train_begin` to `on_train_end`.

    config: as `tiermem.offload` takes it. offload_kwargs: passed to `tiermem.offload`
    (name=, process_group=, resume=); model= is the Trainer's model.
    """

    def __init__(self, config: Any = None, **offload_kwargs: Any) -> None:
        if "model" in offload_kwargs:
            raise TypeError("TiermemCallback passes the Trainer's model as model=")
        self.config = config
        self.offload_kwargs = offload_kwargs
        self.tm: Any = None  # the `tm` of tiermem.offload while training
        self._stack: contextlib.ExitStack | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if optimizer is None:
            raise TierMemError("TiermemCallback: the Trainer passed no optimizer to "
                               "on_train_begin")
        settings = load_config(self.config)
        if settings.pipeline.overlap_backward:
            # Trainer rescales every gradient after backward (clip_grad_norm_, with an
            # infinite norm when max_grad_norm is 0, to log grad_norm): the updates that
            # overlap started during backward would not match; refuse before any step.
            raise TierMemError("pipeline.overlap_backward cannot be used with the Hugging "
                               "Face Trainer: it edits gradients between backward and "
                               "optimizer.step() (gradient clipping / grad_norm)")
        self._leave(None)  # a second train() on the same Trainer: the first block is over
        stack = contextlib.ExitStack()
        self.tm = stack.enter_context(
            tiermem.offload(optimizer, settings, model=model, **self.offload_kwargs))
        self._stack = stack

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                              **kwargs: Any) -> None:
        # With parameters.offload the gradients live in the parameter tier, not in p.grad.
        # The Trainer clips through Accelerator.clip_grad_norm_, which tiermem routes to
        # the tier's clip (tiermem/optim/clipping.py). Should an Accelerate clip some other
        # way, reading p.grad and finding none, nothing was clipped: clip once here, as
        # the Trainer meant to (its logged grad_norm then reads what Accelerate found).
        tm = self.tm
        if (tm is not None and args.max_grad_norm and args.max_grad_norm > 0
                and tm.offloaded.weights is not None and not tm.clipped()):
            tm.clip_grad_norm_(args.max_grad_norm)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._leave(None)

    def __enter__(self) -> "TiermemCallback":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self._leave(exc)
        return False

    def _leave(self, exc: BaseException | None) -> None:
        stack, self._stack = self._stack, None
        self.tm = None
        leave(stack, exc)
