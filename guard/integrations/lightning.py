"""Lightning: a Callback that guards `Trainer.fit()`.

The step boundary is Lightning's `on_before_optimizer_step`, not the optimizer's step
pre-hook: with automatic optimization Lightning calls `optimizer.step(closure)` and the
closure runs forward and backward inside it, after torch's pre-hooks, so a pre-hook would read
the previous step's flags. `on_before_optimizer_step` runs after the closure and before the
update, so `fail` raises `GuardViolation` with the weights untouched; it propagates out of
`trainer.fit()` (Lightning calls `on_exception`, which detaches the guard, then re-raises) on
every rank at the same step. `trainer.should_stop` would stop only after this step's update.

The guard's figures go to the module's loggers with `pl_module.log_dict(on_step=True)` right
after each read (Lightning allows `self.log` in `on_before_optimizer_step`), so Lightning
writes them at its own cadence (`log_every_n_steps`) and step, in the same rows as the
module's metrics, to every logger (CSVLogger, TensorBoardLogger, ...).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

import guard
from guard.integrations.common import GuardedTraining

__all__ = ["GuardCallback", "guarded_module"]


def guarded_module(pl_module: nn.Module, embedding: nn.Module | None = None,
                   lm_head: nn.Module | None = None) -> nn.Module:
    """The smallest submodule holding both the embedding and the lm_head: the model that
    `training_step` calls, whose forward sees the labels and returns the loss."""
    heads = guard.find_heads(pl_module, embedding=embedding, lm_head=lm_head)
    # Their names in pl_module itself: find_heads names them inside any wrapper it unwraps
    # (a LightningModule whose only child is the model is one).
    names = {id(m): n for n, m in reversed(list(pl_module.named_modules()))}
    emb, head = names.get(id(heads.embedding), ""), names.get(id(heads.lm_head), "")
    prefix: list[str] = []
    for a, b in zip(emb.split(".")[:-1], head.split(".")[:-1], strict=False):
        if a != b:
            break
        prefix.append(a)
    return pl_module.get_submodule(".".join(prefix)) if prefix else pl_module


class GuardCallback(GuardedTraining, pl.Callback):
    """Attaches a guard at fit start (to `guarded_module(pl_module)`), marks a step at each
    `on_before_optimizer_step` of the first optimizer, detaches at fit end or on an exception.

    The loss is the model output's (HF `.loss`, nanoGPT's `(logits, loss)`); when the model
    returns none, the loss Lightning backpropagates (divided by `accumulate_grad_batches` when
    accumulating; the last micro-batch's). The real vocab comes from `tokenizer`,
    `vocab_size`, the policy's `vocab.real_size`, or the datamodule's `tokenizer` attribute.
    The guard's state is this callback's in Lightning's checkpoints (`state_dict()`), and
    `trainer.fit(ckpt_path=...)` goes on from it (docs/integrations.md, "Resuming a run").
    """

    # Per fit, set in on_fit_start (the constructor is GuardedTraining's).
    _optimizer: torch.optim.Optimizer | None = None
    _loss: torch.Tensor | None = None
    _fitting = False  # the guard is attached for this fit
    _resumed: dict[str, Any] | None = None  # a checkpoint's guard state, until it is loaded

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = guarded_module(pl_module, self.embedding, self.lm_head)
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
        # Lightning runs forward and backward inside optimizer.step(closure): only this
        # callback knows where a step ends.
        # Under 16-mixed its GradScaler skips the updates whose gradients are not finite.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._attach(target, processing_class=tokenizer, steps="manual", scaler=scaler)
        opts = trainer.optimizers
        self._optimizer = guard.torch_optimizer(opts[0]) if opts else None
        self._fitting = True
        self._resume()

    def state_dict(self) -> dict[str, Any]:
        """What Lightning saves of this callback in a checkpoint: the guard's state (plain
        data; nothing before the first fit)."""
        return {} if self.guard is None else self.guard.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`fit(ckpt_path=...)`: Lightning restores the callbacks before fit start (most
        strategies) or after it; the guard goes on from the state once it is attached."""
        self._resumed = state_dict
        self._resume()

    def _resume(self) -> None:
        if self._resumed is not None and self._fitting and self.guard is not None:
            state, self._resumed = self._resumed, None
            self.guard.load_state_dict(state)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        self._loss = loss

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        if self.guard is None or guard.torch_optimizer(optimizer) is not self._optimizer:
            return  # one step per batch: the first optimizer's (GANs step several)
        loss, self._loss = self._loss, None
        # The model's own loss when its forward returned one; else the one Lightning
        # backpropagates. Raises GuardViolation on `fail`, before the update.
        self.guard.step(loss, fallback=True)
        self._log_figures(pl_module)

    def _log_figures(self, pl_module: pl.LightningModule) -> None:
        """The figures as of the last read, to the module's loggers (docs/integrations.md)."""
        figures = self.figures()
        if not figures:
            return
        # CPU tensors, not floats: `self.log` turns a number into a tensor on the module's
        # device and Lightning reads each logged tensor back with .item() when it writes the
        # logs, one device sync per figure; a CPU tensor stays on the CPU (Lightning moves the
        # metric to the value's device) and its .item() is a copy in host memory. float64
        # keeps counts exact past float32's 2**24.
        pl_module.log_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in figures.items()},
                           on_step=True, on_epoch=False, batch_size=1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._detach()

    def _detach(self, *, keep_mask: bool = False, raise_late: bool = False) -> None:
        try:
            super()._detach(keep_mask=keep_mask, raise_late=raise_late)
        finally:
            self._loss, self._fitting = None, False
