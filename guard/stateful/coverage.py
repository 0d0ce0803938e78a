"""The coverage check's state: where the labels are looked for in each training forward (the
guarded forward's labels= / targets= parameter and its position, guard/device/labels.py), for
the message of a step that brought none."""

from __future__ import annotations

from guard.checks import coverage
from guard.device.labels import LabelsArg
from guard.device.reading import Reading
from guard.stateful.state import Attaching, CheckState

__all__ = ["CoverageState"]


class CoverageState(CheckState):
    spec = coverage.SPEC

    def __init__(self, labels: LabelsArg) -> None:
        self.labels = labels

    @classmethod
    def attach(cls, at: Attaching) -> CoverageState:
        return cls(LabelsArg.of(at.caller or at.model, at.model))

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        """What the guard looked for in the forward's arguments, and the ways to give labels."""
        return self.labels.looked_for()
