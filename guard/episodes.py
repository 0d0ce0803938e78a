"""Localisation per non-finite episode: the guard's use of guard/localise.py.

The first nonfinite read of an episode names the first module that went non-finite: by a
re-run of the last forward when the read is synchronous in the optimizer's step pre-hook,
else by flag hooks armed for the next training forward. A clean read ends the episode.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from guard.decide import Violation
from guard.localise import Inputs, Localiser, capture, rerun

__all__ = ["Episodes"]


class Episodes:
    """Annotates nonfinite violations with the module; state across reads of one run."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.root = type(model).__name__
        self.inputs: Inputs | None = None
        self._armed: Localiser | None = None
        self._armed_step = 0
        self._open = False  # inside a run of nonfinite reads, already localised

    def keep(self, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> None:
        """The last training forward's inputs, for a re-run (references, no copy)."""
        self.inputs = capture(args, kwargs, device_type)

    def close(self) -> None:
        if self._armed is not None:
            self._armed.disarm()
            self._armed = None
        self.inputs = None

    def annotate(self, found: list[Violation], *, rerun_now: bool, step: int, rank: int,
                 action: str) -> tuple[list[Violation], Violation | None]:
        """(violations with the nonfinite one localised, an event from armed flags or None).

        `action` is the policy's nonfinite action, for the event.
        """
        note = None
        if self._armed is not None and self._armed.calls:
            armed, self._armed = self._armed, None
            note = self._armed_note(armed, step, rank, action)
        i = next((k for k, v in enumerate(found) if v.check == "nonfinite"), None)
        if i is None:
            self._open = False  # a clean read: the next NaN is a new episode
            return found, note
        if self._open:
            return found, note
        self._open = True
        v = found[i]
        if rerun_now and self.inputs is not None:
            finding = rerun(self.model, self.inputs)
            if finding is None:
                why = ("every module output was finite on a re-run of the last forward: the "
                       "value arose outside the modules (the loss?) or in an earlier micro-batch")
                found[i] = replace(v, message=f"{v.message} Localisation: {why}.")
            else:
                found[i] = replace(v, module=finding.module or self.root, message=(
                    f"{v.message} Localisation: {finding.describe(self.root)}."))
        elif v.action == "fail":
            found[i] = replace(v, message=f"{v.message} Pass optimizer= to guard.attach to name "
                               "the first non-finite module at the failing step.")
        elif self._armed is None:
            self._armed = Localiser(self.model, training_only=True)
            self._armed.arm()
            self._armed_step = v.step
        return found, note

    def _armed_note(self, loc: Localiser, step: int, rank: int, action: str) -> Violation:
        """Flags armed after an earlier violation saw a training forward: one event, no count."""
        loc.disarm()
        finding = loc.first()
        where = f"nonfinite on rank {rank} at step {step}"
        if finding is None:
            message = (f"{where}: the non-finite value seen at step {self._armed_step} did not "
                       "recur in the next training forward; not localised")
        else:
            message = (f"{where}: localised with per-module flags armed after step "
                       f"{self._armed_step}: {finding.describe(self.root)}")
        module = None if finding is None else finding.module or self.root
        return Violation("nonfinite", action, step, rank, 0.0, 0.0, message, module)
