"""The coverage check's state: where the labels are looked for in each training forward (the
guarded forward's labels= / targets= parameter and its position, guard/device/labels.py), for
the message of a step that brought none; on a pipeline stage, the data another stage holds,
marked seen at each step boundary so that a stage counts only what it should see."""

from __future__ import annotations

from guard.checks import coverage
from guard.checks.spec import SeenKind
from guard.device.flags import Flags
from guard.device.labels import LabelsArg
from guard.device.reading import Reading
from guard.stateful.state import Attaching, CheckState
from guard.vocab.stage import Stage

__all__ = ["CoverageState", "elsewhere"]


def elsewhere(stage: Stage | None) -> tuple[SeenKind, ...]:
    """The data of a step that another pipeline stage sees: the input ids on the first, the
    logits, labels and loss on the last (none for a whole model)."""
    if stage is None:
        return ()
    held: dict[SeenKind, bool] = {"inputs": stage.embedding, "logits": stage.head,
                                  "labels": stage.head, "loss": stage.head}
    return tuple(k for k, here in held.items() if not here)


class CoverageState(CheckState):
    spec = coverage.SPEC

    def __init__(self, labels: LabelsArg, flags: Flags | None = None,
                 stage: Stage | None = None) -> None:
        self.labels, self.flags, self.stage = labels, flags, stage
        self._elsewhere = elsewhere(stage)

    @classmethod
    def attach(cls, at: Attaching) -> CoverageState:
        return cls(LabelsArg.of(at.caller or at.model, at.model), at.flags, at.stage)

    def end_step(self) -> None:
        if self.flags is not None:
            for kind in self._elsewhere:  # another stage's to see (its own coverage counts it)
                self.flags.mark(coverage.SEEN[kind])

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        """What the guard looked for in the forward's arguments, and the ways to give labels."""
        if self.stage is not None and self.stage.head:
            return ("no target reached the guard of this pipeline's last stage: wrap the "
                    "schedule's loss_fn as loss_fn=g.loss_fn(loss_fn)")
        return self.labels.looked_for()
