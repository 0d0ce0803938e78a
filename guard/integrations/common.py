"""What the framework callbacks share: the attach arguments, kept until the trainer starts."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.device.checks import masked_logits
from guard.device.loss import LossShares
from guard.errors import AttachError
from guard.guard import Guard, attach
from guard.policy import Action, Policy
from guard.policy_file import coerce_policy
from guard.step.clock import Steps

__all__ = ["GuardedTraining", "torch_optimizer"]

log = logging.getLogger("guard")


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a wrapper (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer): the wrapper does not run torch's step hooks, the optimizer does."""
    seen = 0
    while optimizer is not None and seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer, seen = inner, seen + 1
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise AttachError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def _tokenizer_of(processing_class: Any) -> Any:
    """A tokenizer from a Trainer's processing_class: itself, or a processor's .tokenizer."""
    tok = getattr(processing_class, "tokenizer", processing_class)
    try:
        len(tok)
    except TypeError:
        return None  # an image processor or feature extractor: no vocabulary
    return tok


class GuardedTraining:
    """Base of the framework callbacks: attach()'s arguments, given when the callback is built;
    the model, the optimizer and (as a fallback) the tokenizer come from the trainer."""

    def __init__(
        self,
        policy: Policy | dict[str, Any] | str | os.PathLike[str] | None = None,
        *,
        vocab_size: int | None = None,
        tokenizer: Any = None,
        embedding: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        vocab_shard: tuple[int, int] | None = None,
    ) -> None:
        self.policy = coerce_policy(policy)  # a bad policy fails when the callback is built
        self.vocab_size, self.tokenizer, self.vocab_shard = vocab_size, tokenizer, vocab_shard
        self.embedding, self.lm_head = embedding, lm_head
        self.guard: Guard | None = None  # the last one attached; its stats stay readable
        self._mask_after: RemovableHandle | None = None  # see finish()

    def _attach(self, model: nn.Module, *, optimizer: Any = None, processing_class: Any = None,
                steps: Steps = "auto", loss_shares: LossShares = "last",
                loss_scale: float = 1.0) -> Guard:
        """Attach to `model`; the trainer's tokenizer gives the real vocab unless one was given."""
        self._detach()  # a run that raised leaves its guard attached until the next one
        self.release()
        tokenizer = self.tokenizer
        if tokenizer is None and self.vocab_size is None and self.policy.vocab.real_size is None:
            tokenizer = _tokenizer_of(processing_class)
            if tokenizer is None:
                log.warning("guard: no tokenizer, vocab_size or vocab.real_size: the real vocab "
                            "is taken to be the head rows, so no column counts as padding")
        self.guard = attach(model, policy=self.policy, vocab_size=self.vocab_size,
                            tokenizer=tokenizer, optimizer=torch_optimizer(optimizer),
                            embedding=self.embedding, lm_head=self.lm_head,
                            vocab_shard=self.vocab_shard, steps=steps,
                            loss_shares=loss_shares, loss_scale=loss_scale)
        return self.guard

    def _detach(self) -> None:
        if self.guard is not None:
            self.guard.detach()

    def figures(self) -> dict[str, float]:
        """The guard's figures as of its last read, for the trainer's own loggers:
        `Record.scalars()` ({} without a guard or before its first read; no device read)."""
        return {} if self.guard is None else self.guard.record.scalars()

    def finish(self) -> None:
        """At the end of training: detach the guard, and under `mask` keep masking the padding
        columns of the head's output in this process, so evaluation and generation after
        training score as a head over the real vocab does (the weights' padding rows are
        repaired and HF generation suppresses the padding ids either way: docs/integrations.md,
        what the callbacks leave behind). `release()` removes that mask."""
        g = self.guard
        if g is not None and g.policy.action("padding_rows") is Action.REPAIR:
            g.repair_padding_rows()  # to the mean of the real rows as they are now
        self._detach()
        if g is None or not g.policy.masks or g.real >= g.rows or self.vocab_shard is not None:
            return
        real, rows = g.real, g.rows

        def mask(module: nn.Module, args: Any, out: Any) -> Any:
            if isinstance(out, torch.Tensor) and out.shape[-1] == rows:
                return masked_logits(out, real)
            return None

        self._mask_after = g.heads.lm_head.register_forward_hook(mask)

    def release(self) -> None:
        """Remove the mask `finish()` left on the head; idempotent."""
        if self._mask_after is not None:
            self._mask_after.remove()
            self._mask_after = None
