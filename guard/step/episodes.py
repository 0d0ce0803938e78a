"""Localisation per non-finite episode: the guard's use of guard/step/localise.py.

The first nonfinite read of an episode names the first module that went non-finite: by a
re-run of the last forward when the read is synchronous in the optimizer's step pre-hook,
else by flag hooks armed for the next training forward. A clean read ends the episode.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from guard.device.hooks import Handle, hook
from guard.policy import Action, Policy
from guard.step.localise import Inputs, Localiser, RerunFailed, capture, rerun
from guard.step.verdict import Note, Verdict

__all__ = ["Episodes"]


class _OnDevice(Protocol):
    @property
    def device(self) -> torch.device: ...


class Episodes:
    """Annotates nonfinite violations with the module; state across reads of one run."""

    def __init__(self, model: nn.Module, action: Action, masks: bool = False) -> None:
        self.model = model
        self.action = action  # the policy's nonfinite action, for the notes
        self.masks = masks  # padding columns at -inf: a ghost label's loss is +inf
        self.root = type(model).__name__
        self.inputs: Inputs | None = None
        self._armed: Localiser | None = None
        self._armed_step = 0
        self._open = False  # inside a run of nonfinite reads, already localised

    @classmethod
    def from_policy(cls, policy: Policy, model: nn.Module) -> Episodes | None:
        """None where nonfinite is off or `localise: false`: nothing is kept, nothing armed."""
        if not (policy.enabled("nonfinite") and policy.checks.nonfinite.localise):
            return None
        return cls(model, policy.action("nonfinite"), policy.masks)

    def install(self, on: _OnDevice) -> list[Handle]:
        """Keep each training forward's inputs for a re-run (only useful where reads are
        synchronous in the optimizer's step pre-hook); `on.device`: where the model runs."""
        self._on = on
        return [hook(self.model, self._keep, kind="forward_pre", compiled="eager",
                     with_kwargs=True)]

    def _keep(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training:  # references, no copy
            self.inputs = capture(args, kwargs, self._on.device.type)

    def close(self) -> None:
        if self._armed is not None:
            self._armed.disarm()
            self._armed = None
        self.inputs = None

    def annotate(self, verdict: Verdict, *, rerun_now: bool, step: int,
                 rank: int) -> tuple[Verdict, Note | None]:
        """(the verdict with its nonfinite violation localised, a note from armed flags)."""
        note = None
        if self._armed is not None and self._armed.calls:
            armed, self._armed = self._armed, None
            note = self._armed_note(armed, step, rank)
        found = list(verdict.violations)
        i = next((k for k, v in enumerate(found) if v.check == "nonfinite"), None)
        if i is None:
            self._open = False  # a clean read: the next NaN is a new episode
            return verdict, note
        if self._open:
            return verdict, note
        self._open = True
        v = found[i]
        if v.kind == "loss" and self.masks and any(
                o.check == "token_range" and "label" in o.kind for o in found):
            return verdict, note  # ghost labels explain it (its message says so): no module
        if v.kind == "grad":
            # The forward was finite: a re-run of it finds nothing; the gradients' check named
            # the parameters (guard/stateful/nonfinite.py).
            return verdict, note
        if rerun_now and self.inputs is not None:
            try:
                finding = rerun(self.model, self.inputs)
            except RerunFailed as e:
                found[i] = replace(v, message=f"{v.message} Localisation: the re-run of the last "
                                   f"forward raised {e} (logged above): not localised.")
                return Verdict(tuple(found)), note
            if finding is None:
                why = ("every module output was finite on a re-run of the last forward: the "
                       "value arose outside the modules (the loss?) or in an earlier micro-batch")
                found[i] = replace(v, message=f"{v.message} Localisation: {why}.")
            else:
                found[i] = replace(v, module=finding.module or self.root, message=(
                    f"{v.message} Localisation: {finding.describe(self.root)}."))
        elif v.action is Action.FAIL:
            found[i] = replace(v, message=f"{v.message} Pass optimizer= to guard.attach to name "
                               "the first non-finite module at the failing step.")
        elif self._armed is None:
            self._armed = Localiser(self.model, training_only=True)
            self._armed.arm()
            self._armed_step = v.step
        return Verdict(tuple(found)), note

    def _armed_note(self, loc: Localiser, step: int, rank: int) -> Note:
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
        return Note("nonfinite", self.action, step, message, module)
