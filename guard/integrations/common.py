"""What the framework callbacks share: the attach arguments, kept until the trainer starts."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

import guard

__all__ = ["GuardedTraining"]



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
        vocab_shard: tuple[int, int] | tuple[int, int, Any] | None = None,
    ) -> None:
        self.policy = guard.load_policy(policy)  # a bad policy fails when the callback is built
        self.vocab_size, self.tokenizer, self.vocab_shard = vocab_size, tokenizer, vocab_shard
        self.embedding, self.lm_head = embedding, lm_head
        self.guard: guard.Guard | None = None  # the last one attached; its stats stay readable

    def _tokenizer(self, processing_class: Any) -> Any:
        """The tokenizer given, else the trainer's, unless a size was given. None: attach looks
        in the model, and says so (coverage) when it finds nothing."""
        if self.tokenizer is not None or self.vocab_size is not None \
                or self.policy.vocab.real_size is not None:
            return self.tokenizer
        return _tokenizer_of(processing_class)

    def _audit(self, model: nn.Module, processing_class: Any = None) -> guard.Audit:
        """The vocab sizes attach would find, before anything is attached or changed."""
        vocab = self.policy.vocab
        return guard.audit(model, vocab_size=self.vocab_size or vocab.real_size,
                           tokenizer=self._tokenizer(processing_class),
                           tensor_parallel=vocab.tensor_parallel, pad_multiple=vocab.pad_multiple,
                           embedding=self.embedding, lm_head=self.lm_head)

    def _attach(self, model: nn.Module, *, optimizer: Any = None, processing_class: Any = None,
                steps: guard.Steps = "auto", loss_shares: guard.LossShares | None = None,
                loss_scale: float = 1.0, scaler: Any = None) -> guard.Guard:
        """Attach to `model`; the trainer's tokenizer gives the real vocab unless one was given."""
        self._detach()  # a run that raised leaves its guard attached until the next one
        self.release()
        self.guard = guard.attach(model, policy=self.policy, vocab_size=self.vocab_size,
                            tokenizer=self._tokenizer(processing_class), optimizer=optimizer,
                            embedding=self.embedding, lm_head=self.lm_head,
                            vocab_shard=self.vocab_shard, steps=steps,
                            loss_shares=loss_shares, loss_scale=loss_scale, scaler=scaler)
        return self.guard

    def _detach(self, *, keep_mask: bool = False, raise_late: bool = False) -> None:
        if self.guard is not None:
            self.guard.detach(keep_mask=keep_mask, raise_late=raise_late)

    def figures(self) -> dict[str, float]:
        """The guard's figures as of its last read, for the trainer's own loggers
        (`Guard.figures()`; {} without a guard or before its first read; no device read)."""
        return {} if self.guard is None else self.guard.figures()

    def finish(self) -> None:
        """At the end of training: the padding rows repaired to the mean of the real rows as
        they are now (under `padding_rows: repair`), then the guard detached, leaving under
        `mask` the padding columns of the head's output masked in this process, so evaluation
        and generation after training score as a head over the real vocab does
        (docs/integrations.md, what the callbacks leave behind). `release()` removes that. A fail
        at the last step read one read late raises here (`Guard.detach(raise_late=True)`)."""
        if self.guard is not None:
            self.guard.repair()
        self._detach(keep_mask=True, raise_late=True)

    def release(self) -> None:
        """Remove the mask `finish()` left on the head; idempotent."""
        if self.guard is not None:
            self.guard.release()
