"""The padding_rows check's state: the padding rows [real, rows) of the embedding and lm_head
weights (guard/device/rows.py checks and repairs them on the device) and, under `repair`, HF
generation kept off the padding ids."""

from __future__ import annotations

import logging

from torch import nn

from guard.checks import padding_rows
from guard.device.reading import Reading
from guard.device.rows import PaddingRows
from guard.policy import Action
from guard.stateful.stages import from_the_rank_that_fired
from guard.stateful.state import Attaching, CheckState
from guard.vocab.stage import Stage
from guard.weights.masters import Masters
from guard.weights.vocab import unread_rows, vocab_weights

__all__ = ["PaddingRowsState", "suppress_padding_ids"]

log = logging.getLogger("guard")


class PaddingRowsState(CheckState):
    spec = padding_rows.SPEC
    at_detach = False  # reads the weights

    def __init__(self, rows: PaddingRows | None, action: Action, real: int, total: int, *,
                 sharded: bool = False, unread: str | None = None,
                 stage: Stage | None = None) -> None:
        # None where no weight has a padding row on this process (a vocab-parallel shard of
        # real ids only): it checks nothing, the other ranks report theirs.
        self.rows = rows
        self.action = action
        self.real, self.total = real, total  # of the whole vocab: the padding ids [real, total)
        self.sharded = sharded  # the rows are a vocab-parallel shard's: some rank holds them
        self.names = "the padding rows" if rows is None else rows.names
        self._unread = unread  # the weights whose rows cannot be read, and why
        self.stage = stage  # a pipeline stage: the rows named are the firing stage's

    @classmethod
    def attach(cls, at: Attaching) -> PaddingRowsState:
        s = at.sizes
        state = cls(PaddingRows.of(at.flags, at.heads, s.first_padding, Masters(at.optimizer)),
                    at.policy.action("padding_rows"), s.real, s.rows, sharded=s.shard is not None,
                    unread=unread_rows(at.heads, s.first_padding), stage=at.stage)
        if state.sharded:  # every rank names them alike, whichever holds padding rows
            state.names = " and ".join(h.name for h in vocab_weights(at.heads, s.first_padding))
        return state

    def unread(self) -> str | None:
        return self._unread

    @property
    def reads_at_attach(self) -> bool:
        # The same on every rank: the attach read is a collective, and under a vocab-parallel
        # head the ranks whose shard holds no padding row take part in it all the same.
        return self.rows is not None or (self.sharded and self.real < self.total)

    def check(self) -> None:
        if self.rows is not None:
            self.rows.check()

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        """The weights whose padding rows are checked, by name (on a pipeline, the weights
        of the stage that found them)."""
        return from_the_rank_that_fired(self.names, reading, self.check_name, self.stage,
                                        reduce=reduce)

    def repair(self) -> None:
        if self.rows is not None:
            self.rows.repair()

    def after_attach(self, model: nn.Module) -> None:
        if self.action is Action.REPAIR:
            suppress_padding_ids(model, self.real, self.total)  # global ids, sharded or not


def suppress_padding_ids(model: nn.Module, real: int, rows: int) -> None:
    """HF models: generate() never emits a padding id, greedy, sampling and beam search alike
    (transformers applies generation_config.suppress_tokens in every decoding mode)."""
    config = getattr(model, "generation_config", None)
    if config is None or real >= rows or not hasattr(config, "suppress_tokens"):
        return
    before = list(config.suppress_tokens or [])
    config.suppress_tokens = sorted(set(before) | set(range(real, rows)))
    log.info("generation_config.suppress_tokens now holds the padding ids [%d, %d)",
             real, rows)
