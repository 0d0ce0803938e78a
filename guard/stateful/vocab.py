"""The vocab check's state at each read: an embedding and a head that shared one weight at
attach still do. A comparison on the host of the two modules' weight objects, no device read;
the result goes into the flags so that every rank decides alike."""

from __future__ import annotations

from guard.checks import vocab
from guard.device.flags import Flags
from guard.device.reading import Reading
from guard.stateful.state import Attaching, CheckState
from guard.vocab.discover import Heads

__all__ = ["TieState"]


class TieState(CheckState):
    spec = vocab.SPEC

    def __init__(self, heads: Heads, flags: Flags) -> None:
        self.heads, self.flags = heads, flags
        self.names = f"{heads.embedding_name}.weight and {heads.lm_head_name}.weight"

    @classmethod
    def attach(cls, at: Attaching) -> TieState | None:
        return cls(at.heads, at.flags) if at.heads.tied else None  # untied: nothing to keep

    def check(self) -> None:
        if not self.heads.tied:  # the modules' weight attributes, as they are now
            self.flags.put(vocab.UNTIED, 1.0)

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        return self.names
