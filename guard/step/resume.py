"""A resumed run: the guard's state saved with a checkpoint and restored at the resume, so the
run goes on as if never stopped (docs/integrations.md, "Resuming a run").

Runs on the host, between steps: `state_dict()` when the loop or the framework saves a
checkpoint (one read of the loss-spike window to the host), `load_state_dict()` right after
attach, before the first step. The state is plain data (ints, floats, bools, lists, dicts):
`torch.save` and `torch.load(weights_only=True)` take it, and so does the JSON of the HF
Trainer's `trainer_state.json`. It holds

- `version`: bumped only by a change an older guard cannot read; a field added later is
  optional, and a field missing from a state keeps this guard's fresh value;
- `step`: the step the run reached (the next one is `step + 1`);
- `rank`, `vocab` (`real`, `rows`), `checks` (the enabled checks): what it must fit;
- `loss_window`: the loss_spike check's window (`size`, `seen`, `history`, `accepted`), so a
  spike right after the resume is judged against the losses before it, not after a new
  warm-up;
- `totals`: what adds up since attach (counts, counts per kind, violations), so the counters
  on the wire go on from the checkpoint's instead of restarting at 0 (a counter reset).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from guard.device.loss import SpikeTracker
from guard.device.probe import Probe
from guard.errors import StateError
from guard.policy import CHECKS, Action
from guard.step.clock import StepClock
from guard.step.record import Record
from guard.vocab.resolve import Sizes

__all__ = ["VERSION", "Resumable"]

log = logging.getLogger("guard")

VERSION = 1
_ACTIONS = frozenset(a.value for a in Action)


class Resumable:
    """`state_dict()` / `load_state_dict()` of a Guard (guard/guard.py), over its parts."""

    _clock: StepClock
    _record: Record
    _probe: Probe
    _sizes: Sizes

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as if never stopped: the step, the loss-spike
        window, the running totals; plain data, saved with the checkpoint. A lagged read still
        queued is read first (a fail in it raises here, as at the next read), unless this guard
        stopped the run already: a halted guard's state is what it had when it raised."""
        if self._record.halted is None:
            self._clock.settle()
        state: dict[str, Any] = {
            "version": VERSION, "step": self._clock.step, "rank": self._record.rank,
            "vocab": {"real": self._sizes.real, "rows": self._sizes.rows},
            "checks": sorted(self._record.enabled), "totals": self._record.totals()}
        if (spike := self._probe.loss.spike) is not None:
            state["loss_window"] = {  # a checkpoint's one read of the window to the host
                "size": spike.history.shape[0], "seen": spike.seen,
                "history": spike.history.tolist(), "accepted": spike.accepted.tolist()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from `state`, a `state_dict()` of a guard on the same model with the same
        checks, right after attach; a state that does not fit is a StateError naming the
        field."""
        if not isinstance(state, Mapping):
            raise StateError("state", f"expected the dict of Guard.state_dict(), got "
                                      f"{type(state).__name__}")
        version = _int(state, "version", required=True)
        if version > VERSION:
            raise StateError("version", f"{version} is a newer guard's state; this guard "
                                        f"reads version {VERSION} and older")
        if self._clock.step > 0:
            raise StateError("step", f"this guard is at step {self._clock.step} already: load "
                                     "a state right after attach, before the first step")
        vocab = state.get("vocab", {})
        for kind, mine in (("real", self._sizes.real), ("rows", self._sizes.rows)):
            saved = vocab.get(kind, mine) if isinstance(vocab, Mapping) else vocab
            if saved != mine:
                raise StateError(f"vocab.{kind}", f"saved from a model with {saved!r}, this "
                                                  f"guard's has {mine}: another model's state")
        checks = sorted(self._record.enabled)
        if (saved_checks := state.get("checks", checks)) != checks:
            raise StateError("checks", f"saved with {saved_checks!r}, this guard runs {checks}: "
                                       "a state of another policy")
        step = _int(state, "step")
        spike = self._probe.loss.spike
        window = None if spike is None or (saved := state.get("loss_window")) is None \
            else _window(spike, saved)
        held = self._record.stats
        totals = _totals(state.get("totals", {}), self._record.counted | {"violations"} | {
            k for k, v in held.items() if v is None})
        rank = _int(state, "rank", default=self._record.rank)
        # Everything checked: nothing changes before this line.
        if rank != self._record.rank:
            # The frameworks save rank 0's state only: the step and the loss window fit every
            # rank, rank 0's totals do not.
            log.info("resuming rank %d from rank %d's state: its step and loss window, "
                     "not its totals", self._record.rank, rank)
            totals = {}
        if spike is not None and window is not None:
            spike.history, spike.accepted, spike.seen = window
        self._record.add_totals(totals, step)
        self._clock.resume(step)
        log.info("resumed at step %d", step)


def _int(state: Mapping[str, Any], name: str, *, default: int = 0,
         required: bool = False) -> int:
    """`state[name]`, an integer >= 0; `default` where it is missing (a field added later)."""
    if name not in state and not required:
        return default
    value = state.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateError(name, f"expected an integer >= 0, got {value!r}")
    return value


def _window(spike: SpikeTracker, saved: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The loss window of `saved`, checked against `spike`: (history, accepted) on its device,
    and the count of losses seen."""
    window = spike.history.shape[0]
    if not isinstance(saved, Mapping):
        raise StateError("loss_window", f"expected a dict, got {type(saved).__name__}")
    if saved.get("size") != window:
        raise StateError("loss_window.size", f"saved with a window of {saved.get('size')!r} "
                                              f"losses, this guard's is {window}")
    history, accepted = saved.get("history"), saved.get("accepted")
    if not (isinstance(history, list) and len(history) == window and all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in history)):
        raise StateError("loss_window.history", f"expected a list of {window} numbers")
    if not (isinstance(accepted, list) and len(accepted) == window
            and all(isinstance(x, bool) for x in accepted)):
        raise StateError("loss_window.accepted", f"expected a list of {window} booleans")
    h = spike.history
    return (torch.tensor(history, dtype=h.dtype).to(h.device),
            torch.tensor(accepted, dtype=torch.bool).to(h.device), _int(saved, "seen"))


def _totals(saved: Any, known: set[str]) -> dict[str, Any]:
    """The saved totals this guard reports, checked: counts are integers >= 0."""
    if not isinstance(saved, Mapping):
        raise StateError("totals", f"expected a dict, got {type(saved).__name__}")
    out: dict[str, Any] = {}
    for name, value in saved.items():
        if name not in known:  # a newer guard's figure: this one does not report it
            continue
        field = f"totals.{name}"
        if name == "violations":
            if not isinstance(value, Mapping):
                raise StateError(field, f"expected a dict, got {type(value).__name__}")
            for check, actions in value.items():
                if check not in CHECKS:
                    raise StateError(f"{field}.{check}", "not a check")
                _counts(actions, f"{field}.{check}", _ACTIONS)
        elif isinstance(value, Mapping):
            _counts(value, field, None)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StateError(field, f"expected a count >= 0, got {value!r}")
        out[name] = value
    return out


def _counts(value: Any, field: str, keys: frozenset[str] | None) -> None:
    if not isinstance(value, Mapping):
        raise StateError(field, f"expected a dict of counts, got {type(value).__name__}")
    for k, n in value.items():
        if not isinstance(k, str) or (keys is not None and k not in keys):
            raise StateError(f"{field}.{k}", "not a known name")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise StateError(f"{field}.{k}", f"expected a count >= 0, got {n!r}")
