"""Hugging Face transformers: a TrainerCallback that guards `Trainer.train()`, and a
LogitsProcessor that keeps `generate()` off the padding ids.

How `fail` stops the Trainer: the guard reads its flags in the optimizer's step pre-hook, so a
`GuardViolation` is raised inside `optimizer.step()`, before the weights change, and propagates
out of `trainer.train()` with the guard's message (on every rank at the same step). Setting
`control.should_training_stop` instead would let the update with the bad gradients happen
first, and `train()` would return as if training had succeeded, so the script would go on to
save or push the model with exit status 0; `fail` means stop the job.

How the guard's figures reach `report_to`: the Trainer calls its callbacks in list order, the
reporting ones (TensorBoard, W&B, MLflow, ...) before the user's, and each reporter writes
`logs` in its own `on_log`; keys added by a callback after it never reach it. So at
`on_train_begin` the callback moves itself ahead of the first callback with an `on_log` of its
own (see `_lead_loggers`), and its `on_log` adds the figures to the `logs` dict that the
reporters then write (docs/integrations.md, trainer loggers).

How a `compute_loss_func` is guarded: it computes the loss outside the model, from outputs the
Trainer took the labels away from, so the model hook sees no loss. At `on_train_begin` the
callback wraps it (the Trainer is found like its callback list, `_trainer_of`): the loss it
returns, the one the Trainer backpropagates, is fed to the guard with `g.step(loss)`, and the
original goes back when the guard is detached (at train end).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessor, TrainerCallback
from transformers.trainer_callback import CallbackHandler

from guard.device.checks import mask_padding_
from guard.errors import AttachError
from guard.guard import Guard
from guard.integrations.common import GuardedTraining

__all__ = ["GuardCallback", "PaddingMaskLogitsProcessor"]

log = logging.getLogger("guard")


class GuardCallback(GuardedTraining, TrainerCallback):
    """Attaches a guard at train begin and detaches it at train end.

    The model, the optimizer (its step pre-hook is the step boundary) and, unless `tokenizer`,
    `vocab_size` or the policy's `vocab.real_size` is given, the real vocab (the Trainer's
    `processing_class`) come from the Trainer. The loss is the model output's `.loss`, which
    the guard's model hook picks up. `label_smoothing_factor` over a head with padding rows is
    refused at train begin (it smooths over the padding columns). A `compute_loss_func` takes
    the labels and the loss away from the model: it is wrapped while the guard is attached, so
    the loss it returns is the guard's; the labels stay unseen, and the coverage check says so
    at step 1.

    The guard's figures (`figures()`) go into the Trainer's logs at each log of a training
    step, so every `report_to` integration records them under `guard/` (docs/integrations.md).
    """

    _logged_at: int | None = None  # global_step of the last logs given the figures; None: off
    _wrapped: tuple[Any, Callable[..., Any], Callable[..., Any]] | None = None  # see _feed_loss

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       processing_class: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise AttachError("GuardCallback: the Trainer passed no model to on_train_begin")
        if optimizer is None:
            raise AttachError("GuardCallback: the Trainer passed no optimizer to on_train_begin; "
                              "attach with guard.attach(model, optimizer=...) instead")
        # With num_items_in_batch the Trainer makes each micro-batch's .loss its token sum over
        # the tokens of the whole accumulation window (of every rank, when averaged across
        # devices): the step's loss, as the Trainer logs it, is their sum (times the world size
        # in that case). It divides no compute_loss_func's loss by the accumulation steps
        # either, and scales it alike: the step's loss is the sum there too.
        handler, trainer = _trainer_of(self)
        self._detach()  # a run that raised left its guard attached and its wrapper in place
        loss_func = None if trainer is None else trainer.compute_loss_func
        sums = loss_func is not None or _normalises_by_window(model)
        scale = (float(args.world_size) if sums and args.world_size > 1
                 and getattr(args, "average_tokens_across_devices", False) else 1.0)
        g = self._attach(model, optimizer=optimizer, processing_class=processing_class,
                         loss_shares="sum" if sums else "last", loss_scale=scale)
        smoothing = getattr(args, "label_smoothing_factor", 0.0) or 0.0
        if smoothing > 0 and g.real < g.rows:
            self._detach()
            raise AttachError(
                f"GuardCallback: label_smoothing_factor={smoothing:g} smooths over all {g.rows} "
                f"columns of the logits, the {g.rows - g.real} padding columns [{g.real}, "
                f"{g.rows}) included: under the mask their -inf makes the loss +inf (the Trainer "
                "logs it as 0.0), without it training teaches the model to give ghost ids "
                "probability; and the Trainer takes the labels from the model, so ghost labels "
                "go unchecked. Set label_smoothing_factor=0 and smooth in the model's own loss "
                f"over the real columns logits[..., :{g.real}] (docs/integrations.md), or "
                "train a head without padding rows")
        self._logged_at = -1
        if handler is None:
            log.warning("guard: GuardCallback could not find the Trainer's callback list, so "
                        "the report_to callbacks run before it and log no guard/ figures; "
                        "use report_to='none' and list the reporting callbacks after it: "
                        "callbacks=[GuardCallback(...), TensorBoardCallback()]")
        else:
            _lead_loggers(handler, self)
        if trainer is None:
            log.warning("guard: GuardCallback could not find the Trainer, so the loss of a "
                        "compute_loss_func goes unseen: nonfinite and loss_spike see only the "
                        "model's .loss (coverage reports the steps without one)")
        elif loss_func is not None:
            self._feed_loss(trainer, loss_func, g)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        # One set of figures per global step: the Trainer logs a step's training figures,
        # then may log evaluation metrics and (after the last step) the run's totals at the
        # same step; a second set would put two points at one step in every reporter.
        if logs is None or self._logged_at is None or state.global_step <= self._logged_at:
            return
        figures = self.figures()
        if figures:
            logs.update(figures)
            self._logged_at = state.global_step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._logged_at = None  # evaluate() after training logs no figures of a detached guard
        self.finish()

    def _feed_loss(self, trainer: Any, loss_func: Callable[..., Any], g: Guard) -> None:
        """Wrap `trainer.compute_loss_func`: each training loss it returns goes to `g`."""

        @functools.wraps(loss_func)
        def fed(*args: Any, **kwargs: Any) -> Any:
            loss = loss_func(*args, **kwargs)
            # Training forwards only, as the model hook: evaluation computes losses too.
            if g.model.training and isinstance(loss, torch.Tensor):
                g.step(loss)  # with the optimizer as the boundary: only records the loss
            return loss

        trainer.compute_loss_func = fed
        self._wrapped = (trainer, loss_func, fed)

    def _detach(self) -> None:
        # The original compute_loss_func back with the guard's detach (train end, the next
        # train() after one that raised), unless something replaced the wrapper since.
        if self._wrapped is not None:
            trainer, loss_func, fed = self._wrapped
            if trainer.compute_loss_func is fed:
                trainer.compute_loss_func = loss_func
            self._wrapped = None
        super()._detach()


def _logs(callback: TrainerCallback) -> bool:
    return type(callback).on_log is not TrainerCallback.on_log


def _holds(handler: Any, callback: TrainerCallback) -> bool:
    return isinstance(handler, CallbackHandler) and any(cb is callback
                                                        for cb in handler.callbacks)


def _trainer_of(callback: TrainerCallback) -> tuple[CallbackHandler | None, Any]:
    """The Trainer's `CallbackHandler` holding `callback`, and the Trainer that owns it; None
    for either not found. Called from this callback's `on_train_begin`.

    The Trainer hands callbacks neither itself nor its handler. The handler is the `self` of
    `CallbackHandler.call_event`, the frame that calls this callback's `on_train_begin` (a
    couple of frames up); the Trainer the `self` of `Trainer._inner_training_loop`, two frames
    further. Both are found by type and by holding this very callback, not by position, so a
    wrapper frame in between changes nothing.
    """
    from transformers import Trainer  # imported here: only a Trainer calls on_train_begin

    handler: CallbackHandler | None = None
    frame: FrameType | None = inspect.currentframe()
    try:
        for _ in range(10):  # the Trainer is four frames up; a bound keeps a miss cheap
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if handler is None and _holds(owner, callback):
                handler = owner
            elif isinstance(owner, Trainer) and _holds(owner.callback_handler, callback):
                return owner.callback_handler, owner
            frame = frame.f_back
        return handler, None
    finally:
        del frame  # a frame held in a local keeps every frame above it alive


def _lead_loggers(handler: CallbackHandler, callback: TrainerCallback) -> None:
    """Move `callback` ahead of the first callback with its own `on_log` in `handler`.

    The Trainer builds the callback list as defaults + report_to + the user's, so a callback
    given as `callbacks=[...]` always comes after the reporters. Moved during the handler's
    `call_event` of `on_train_begin`: it iterates the list by index and the move takes the
    callback from index i to j < i, shifting only callbacks already called, so none is skipped
    or called twice. Only callbacks that write logs are passed, so the order of every other
    event (saving, early stopping) among the others is as the user gave it.
    """
    cbs = handler.callbacks
    first = next(i for i, cb in enumerate(cbs) if cb is callback or _logs(cb))
    if cbs[first] is not callback:
        mine = next(i for i, cb in enumerate(cbs) if cb is callback)
        cbs.insert(first, cbs.pop(mine))


def _normalises_by_window(model: nn.Module) -> bool:
    """The Trainer's own test (model_accepts_loss_kwargs) for passing num_items_in_batch."""
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is not None:
        return bool(accepts)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


class PaddingMaskLogitsProcessor(LogitsProcessor):
    """Sets the scores of ids >= `vocab_real` to -inf: `generate()` only emits ids the
    tokenizer has, whatever the padding rows of the head hold; the scores it returns are
    log-probabilities over the real ids, so beams score as with a real-vocab head (and
    `output_scores` shows those log-probabilities).

    Needed where no guard with `padding_mass.action: mask` is attached (that one already masks
    the head's output, in eval too): `model.generate(ids, logits_processor=
    LogitsProcessorList([PaddingMaskLogitsProcessor(len(tokenizer))]))`.
    """

    supports_continuous_batching = True

    def __init__(self, vocab_real: int) -> None:
        if isinstance(vocab_real, bool) or not isinstance(vocab_real, int) or vocab_real < 1:
            raise ValueError(f"vocab_real must be a positive int (len(tokenizer)), "
                             f"got {vocab_real!r}")
        self.vocab_real = vocab_real

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        # (batch, rows); a copy, as other processors return: the caller's scores stay as given.
        out = mask_padding_(scores.clone(), self.vocab_real)
        # Always log-probabilities over the real columns. Beam search hands log-probabilities
        # normalised over every column, the padding ones included, and earlier processors
        # (suppress_tokens, bad words, a repetition penalty) have changed them already, so no
        # test on the scores tells log-probabilities from logits; renormalised, each beam is
        # scored as by a head over the real vocab. For greedy and sampling it is a constant
        # per row, which changes no choice (temperature, top-k and top-p after it included).
        real = out[..., : self.vocab_real]
        real -= torch.logsumexp(real.float(), dim=-1, keepdim=True).to(real.dtype)
        return out
