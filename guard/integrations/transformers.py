"""Hugging Face transformers: a TrainerCallback that guards `Trainer.train()`, the function
that puts it on a Trainer, and a LogitsProcessor that keeps `generate()` off the padding ids.

    cb = guard_trainer(trainer, policy="guard.yaml")   # given the Trainer: the full guard
    trainer.train()

How `fail` stops the Trainer: the guard reads its flags in the optimizer's step pre-hook, so a
`GuardViolation` is raised inside `optimizer.step()`, before the weights change, and propagates
out of `trainer.train()` with the guard's message (on every rank at the same step). Setting
`control.should_training_stop` instead would let the update with the bad gradients happen
first, and `train()` would return as if training had succeeded.

What needs the Trainer, which HF hands no callback (callbacks are read-only; changing the loop
belongs to whoever holds the Trainer), so `guard_trainer` does it in the open:
- the guard's figures reach `report_to`: the Trainer calls its callbacks in list order, the
  reporters (TensorBoard, W&B, ...) before a user's callback, and each writes `logs` in its own
  `on_log`. `guard_trainer` puts the callback ahead of the first callback with an `on_log` of
  its own, so its `on_log` adds the figures before the reporters write;
- a `compute_loss_func` is guarded: it computes the loss outside the model, so the model hook
  sees none. At train begin the callback wraps it, feeding the loss it returns (the one the
  Trainer backpropagates) to `g.step(loss)`, and the original goes back at train end.
`callbacks=[GuardCallback(...)]` guards the rest alike and says at train begin what it cannot.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from transformers import LogitsProcessor, Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

import guard
from guard.errors import AttachError
from guard.integrations.common import GuardedTraining
from guard.integrations.reference import reference_of
from guard.integrations.smoothing import RealColumnsSmoother, refused

__all__ = ["GuardCallback", "PaddingMaskLogitsProcessor", "guard_trainer"]

log = logging.getLogger("guard")

# The attribute under which state() saves the guard's state in trainer_state.json.
_SAVED = "guard_state"


def guard_trainer(trainer: Trainer, policy: Any = None, **attach_kwargs: Any) -> GuardCallback:
    """Guard `trainer.train()`: a GuardCallback (policy and attach's keywords: `vocab_size`,
    `tokenizer`, `embedding`, `lm_head`, `vocab_shard`), put ahead of the Trainer's reporting
    callbacks so its figures reach `report_to`, that guards a `compute_loss_func` too. Works
    with every Trainer subclass (TRL's included); returns the callback (`cb.guard` after train
    begin)."""
    if not isinstance(trainer, Trainer):
        raise AttachError(f"guard_trainer needs a transformers.Trainer, got "
                          f"{type(trainer).__name__}; for a plain loop use guard.attach")
    callback = GuardCallback(policy, **attach_kwargs)
    callback._trainer = trainer
    cbs = trainer.callback_handler.callbacks
    first = next((i for i, cb in enumerate(cbs) if _logs(cb)), len(cbs))
    cbs.insert(first, callback)
    # Now, not at train begin: TRL may precompute the reference's log-probs before that.
    if callback.policy.masks and reference_of(trainer) is not None \
            and isinstance(trainer.model, nn.Module):
        callback._mask_reference(callback._audit(trainer.model, trainer.processing_class).real)
    return callback


class GuardCallback(GuardedTraining, TrainerCallback, ExportableState):
    """Attaches a guard at train begin and detaches it at train end.

    The model, the optimizer (its step pre-hook is the step boundary) and, unless `tokenizer`,
    `vocab_size` or the policy's `vocab.real_size` is given, the real vocab (the Trainer's
    `processing_class`) come from the Trainer. The loss is the model output's `.loss`, which
    the guard's model hook picks up. `label_smoothing_factor` over a head with padding rows
    smooths over the real columns under `mask` when put on by `guard_trainer` (the Trainer's
    label smoother, replaced until train end), and is refused at train begin otherwise. The
    guard's figures
    (`figures()`) go into the Trainer's logs at each log of a training step. Put on a Trainer
    with `guard_trainer`, it also reaches `report_to` and a `compute_loss_func`. The guard's
    state goes into each checkpoint's `trainer_state.json` (`state()`, the Trainer's stateful
    callbacks) and `train(resume_from_checkpoint=...)` goes on from it (docs/integrations.md,
    "Resuming a run").
    """

    _logged_at: int | None = None  # global_step of the last logs given the figures; None: off
    _trainer: Trainer | None = None  # given by guard_trainer
    _wrapped: tuple[Callable[..., Any], Callable[..., Any]] | None = None  # see _feed_loss
    _smoother: tuple[Any, RealColumnsSmoother] | None = None  # the Trainer's, and ours
    _reference: guard.FrozenMask | None = None  # on TRL's ref_model, until release()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       processing_class: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise AttachError("GuardCallback: the Trainer passed no model to on_train_begin")
        if optimizer is None:
            raise AttachError("GuardCallback: the Trainer passed no optimizer to on_train_begin; "
                              "attach with guard.attach(model, optimizer=...) instead")
        self._detach()  # a run that raised left its guard attached and its wrapper in place
        # With num_items_in_batch the Trainer makes each micro-batch's .loss its token sum over
        # the tokens of the whole accumulation window (of every rank, when averaged across
        # devices): the step's loss, as the Trainer logs it, is their sum (times the world size
        # in that case). It divides no compute_loss_func's loss by the accumulation steps
        # either, and scales it alike: the step's loss is the sum there too.
        trainer = self._trainer
        loss_func = None if trainer is None else trainer.compute_loss_func
        sums = loss_func is not None or _normalises_by_window(model)
        scale = (float(args.world_size) if sums and args.world_size > 1
                 and getattr(args, "average_tokens_across_devices", False) else 1.0)
        smoothing = getattr(args, "label_smoothing_factor", 0.0) or 0.0
        # The Trainer's label smoother (TRL's SFTTrainer's too); a compute_loss_func replaces it.
        smoother = getattr(trainer, "label_smoother", None) if loss_func is None else None
        if smoothing > 0 and loss_func is None \
                and (a := self._audit(model, processing_class)).real < a.rows \
                and (smoother is None or not self.policy.masks or self.vocab_shard is not None):
            # Refused before the attach: nothing on the model changes.
            raise AttachError(refused(smoothing, a.rows, a.real, trainer is None))
        g = self._attach(model, optimizer=optimizer, processing_class=processing_class,
                         loss_shares="sum" if sums else "last", loss_scale=scale)
        if trainer is not None and smoother is not None and self.vocab_shard is None:
            # Over the real columns; the labels and the loss, which the model never sees, to g.
            ours = RealColumnsSmoother(smoother, g.real, g)
            cast(Any, trainer).label_smoother = ours  # duck-typed: the Trainer only calls it
            self._smoother = (smoother, ours)
        self._mask_reference(g.real)
        self._logged_at = -1
        self._resume(g, state)
        if trainer is None:
            # Given as callbacks=[...]: a compute_loss_func's loss goes unseen, which coverage
            # reports at step 1; the reporters run first, which only this line can say.
            reporters = list(getattr(args, "report_to", None) or [])
            (log.warning if reporters else log.info)(
                "GuardCallback was given as callbacks=[...], so it runs after the "
                "report_to callbacks (%s: they log no guard/ figures) and cannot see a "
                "compute_loss_func's loss (coverage reports the steps without one); use "
                "guard.integrations.transformers.guard_trainer(trainer, ...) for both "
                "(docs/integrations.md)", ", ".join(reporters) or "none here")
        elif loss_func is not None:
            self._feed_loss(trainer, loss_func, g)

    def state(self) -> dict[str, Any]:
        """What the Trainer saves of this callback in a checkpoint's trainer_state.json (on the
        process that saves): the guard's state while it trains (Guard.state_dict(), plain
        data). The Trainer also asks it before train begin, where it has none."""
        g = self.guard if self._logged_at is not None else None  # _logged_at: None off training
        return {"args": {}, "attributes": {} if g is None else {_SAVED: g.state_dict()}}

    def _resume(self, g: guard.Guard, state: Any) -> None:
        """At a train(resume_from_checkpoint=...) the Trainer's state is the checkpoint's: the
        guard goes on from what `state()` saved there."""
        if vars(self).get(_SAVED) is not None:
            # restore_callback_states_from_checkpoint=True: the Trainer replaced the callback
            # by one built with no arguments, and set what state() saved on it.
            self._detach()
            raise AttachError(
                "GuardCallback: restore_callback_states_from_checkpoint=True rebuilt the "
                "callback without its policy, tokenizer or Trainer; leave it False (the "
                "default): the guard restores its own state from the checkpoint")
        held_by = getattr(state, "stateful_callbacks", None)
        if not isinstance(held_by, dict):
            return
        # A checkpoint saved without this callback has no entry, where the Trainer's next save
        # writes this callback's state (a KeyError there): the entry, until then empty.
        saved = held_by.setdefault(type(self).__name__, {"args": {}, "attributes": {}})
        saved = saved[0] if isinstance(saved, list) and saved else saved
        held = saved.get("attributes", {}).get(_SAVED) if isinstance(saved, dict) else None
        if state.global_step < 1:
            return
        if held is None:
            log.warning("resuming at step %d from a checkpoint without the guard's "
                        "state: its loss window and counters start empty", state.global_step)
            return
        try:
            g.load_state_dict(held)
        except Exception:
            self._detach()
            raise

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

    def _feed_loss(self, trainer: Trainer, loss_func: Callable[..., Any], g: guard.Guard) -> None:
        """Wrap `trainer.compute_loss_func`: each training loss it returns goes to `g`."""

        @functools.wraps(loss_func)
        def fed(*args: Any, **kwargs: Any) -> Any:
            loss = loss_func(*args, **kwargs)
            # Training forwards only, as the model hook: evaluation computes losses too.
            if g.model.training and isinstance(loss, torch.Tensor):
                g.step(loss)  # with the optimizer as the boundary: only records the loss
            return loss

        trainer.compute_loss_func = fed
        self._wrapped = (loss_func, fed)

    def _detach(self, *, keep_mask: bool = False, raise_late: bool = False) -> None:
        # The original compute_loss_func back with the guard's detach (train end, the next
        # train() after one that raised), unless something replaced the wrapper since.
        if self._wrapped is not None and self._trainer is not None:
            loss_func, fed = self._wrapped
            if self._trainer.compute_loss_func is fed:
                self._trainer.compute_loss_func = loss_func
        self._wrapped = None
        held: Any = self._trainer
        if self._smoother is not None and held is not None:
            smoother, ours = self._smoother
            if held.label_smoother is ours:
                held.label_smoother = smoother
        self._smoother = None
        super()._detach(keep_mask=keep_mask, raise_late=raise_late)


    def _mask_reference(self, real: int) -> None:
        """Under `mask`, the padding columns [real, rows) of the Trainer's reference model
        (TRL's `ref_model`) masked too; idempotent."""
        ref = reference_of(self._trainer)
        if ref is not None and self._reference is None and self.policy.masks \
                and self.vocab_shard is None:
            self._reference = guard.mask_frozen(ref, real)

    def release(self) -> None:
        super().release()
        if self._reference is not None:
            self._reference.remove()
            self._reference = None


def _logs(callback: TrainerCallback) -> bool:
    return type(callback).on_log is not TrainerCallback.on_log


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
        out = guard.mask_padding(scores.clone(), self.vocab_real)
        # Always log-probabilities over the real columns. Beam search hands log-probabilities
        # normalised over every column, the padding ones included, and earlier processors
        # (suppress_tokens, bad words, a repetition penalty) have changed them already, so no
        # test on the scores tells log-probabilities from logits; renormalised, each beam is
        # scored as by a head over the real vocab. For greedy and sampling it is a constant
        # per row, which changes no choice (temperature, top-k and top-p after it included).
        real = out[..., : self.vocab_real]
        real -= torch.logsumexp(real.float(), dim=-1, keepdim=True).to(real.dtype)
        return out
