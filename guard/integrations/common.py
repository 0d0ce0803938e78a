"""What the framework callbacks share: the attach arguments, kept until the trainer starts."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import guard
from guard.errors import AttachError

__all__ = ["GuardedTraining", "torch_optimizer"]



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
        policy: guard.Policy | dict[str, Any] | str | os.PathLike[str] | None = None,
        *,
        vocab_size: int | None = None,
        tokenizer: Any = None,
        embedding: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        vocab_shard: tuple[int, int] | None = None,
    ) -> None:
        self.policy = guard.load_policy(policy)  # a bad policy fails when the callback is built
        self.vocab_size, self.tokenizer, self.vocab_shard = vocab_size, tokenizer, vocab_shard
        self.embedding, self.lm_head = embedding, lm_head
        self.guard: guard.Guard | None = None  # the last one attached; its stats stay readable

    def _attach(self, model: nn.Module, *, optimizer: Any = None, processing_class: Any = None,
                steps: guard.Steps = "auto", loss_shares: guard.LossShares = "last",
                loss_scale: float = 1.0) -> guard.Guard:
        """Attach to `model`; the trainer's tokenizer gives the real vocab unless one was given."""
        self._detach()  # a run that raised leaves its guard attached until the next one
        self.release()
        tokenizer = self.tokenizer
        if tokenizer is None and self.vocab_size is None and self.policy.vocab.real_size is None:
            # None: attach looks in the model, and says so (coverage) when it finds nothing.
            tokenizer = _tokenizer_of(processing_class)
        self.guard = guard.attach(model, policy=self.policy, vocab_size=self.vocab_size,
                            tokenizer=tokenizer, optimizer=torch_optimizer(optimizer),
                            embedding=self.embedding, lm_head=self.lm_head,
                            vocab_shard=self.vocab_shard, steps=steps,
                            loss_shares=loss_shares, loss_scale=loss_scale)
        return self.guard

    def _detach(self, *, keep_mask: bool = False) -> None:
        if self.guard is not None:
            self.guard.detach(keep_mask=keep_mask)

    def figures(self) -> dict[str, float]:
        """The guard's figures as of its last read, for the trainer's own loggers
        (`Guard.figures()`; {} without a guard or before its first read; no device read)."""
        return {} if self.guard is None else self.guard.figures()

    def finish(self) -> None:
        """At the end of training: the padding rows repaired to the mean of the real rows as
        they are now (under `padding_rows: repair`), then the guard detached, leaving under
        `mask` the padding columns of the head's output masked in this process, so evaluation
        and generation after training score as a head over the real vocab does
        (docs/integrations.md, what the callbacks leave behind). `release()` removes that."""
        if self.guard is not None:
            self.guard.repair_padding_rows()
        self._detach(keep_mask=True)

    def release(self) -> None:
        """Remove the mask `finish()` left on the head; idempotent."""
        if self.guard is not None:
            self.guard.release()
