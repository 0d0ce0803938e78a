"""One read of the flags, from reading to consequence: record, judge, localise, repair, skip,
emit, raise. The step clock calls it at attach, at each read boundary and at detach."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Literal

from guard.device.reading import Reading
from guard.policy import Action, Policy
from guard.stateful.states import States
from guard.step.episodes import Episodes
from guard.step.record import Record
from guard.step.verdict import judge
from guard.vocab.resolve import Sizes

__all__ = ["Names", "Reader", "When"]

log = logging.getLogger("guard")

# attach: the weights before step 1 (a fail stops the attach); step: a read boundary (skip
# may drop the update, the report goes out, a fail raises); detach: what is left unread (a
# fail is logged: the job is ending anyway, and one rank may detach alone); last: the lagged
# read still queued at a detach without an exception (a fail raises, nothing else is done).
When = Literal["attach", "step", "detach", "last"]


@dataclass(frozen=True)
class Names:
    """What the messages call the guarded modules."""

    head: str  # the lm_head's name in the model


class Reader:
    """Turns each reading into its consequences for one guard."""

    def __init__(self, policy: Policy, sizes: Sizes, names: Names, record: Record,
                 episodes: Episodes | None, states: States | None = None) -> None:
        self._policy, self._sizes, self._names = policy, sizes, names
        self._record, self._episodes = record, episodes
        self._states = States() if states is None else states

    def read(self, reading: Reading, step: int, *, when: When, now: int = 0,
             in_step: bool = False, closure: bool = False, dropped: bool = False) -> bool:
        """Act on `reading`, the figures of step `step` (`now`: the clock's step, later than
        `step` when the read lags); True: drop this optimizer step.

        `in_step`: the figures are this step's, read in the optimizer's step pre-hook, before
        the update (a NaN can then be localised by a re-run, and skip can drop the update);
        `closure`: that step was given a closure, which recomputes the gradients; `dropped`: the
        optimizer dropped that step's update on the device already where fail or skip fired
        (guard/step/skip.py), so a skip is only counted here.
        """
        record = self._record
        record.update(reading.local, step, *self._states.stats(reading))
        # What each state whose check fired adds to its message, combined over ranks unless
        # read at detach (one rank may detach alone).
        reading = replace(reading, details=self._states.details(
            reading, reduce=when in ("attach", "step")))
        verdict = judge(reading, self._policy, step=step, real=self._sizes.real_rows,
                        rows=self._sizes.rows, head=self._names.head,
                        real_from=self._sizes.found.source, mass=self._sizes.mass_over)
        if self._episodes is not None:
            verdict, note = self._episodes.annotate(verdict, rerun_now=in_step, step=now,
                                                    rank=record.rank)
            if note is not None:
                record.note(note)
        record.add(verdict)
        # No repair at detach: nothing trains after it, and a repair may be a collective
        # that a rank detaching alone would wait on forever.
        if when in ("attach", "step"):
            self._states.repair({v.check for v in verdict.violations
                                 if v.action is Action.REPAIR})
        skip = False
        if when == "step":
            # Every rank reads the same all-reduced values, so every rank skips the same step.
            skip = in_step and verdict.skip
            if skip and closure:
                log.error("optimizer.step(closure) recomputes the gradients, so skip "
                          "cannot drop step %d; it is applied", step)
                skip = False
            if skip or (dropped and verdict.skip):
                record.skipped()
            record.emit()
        if (error := verdict.error()) is not None:
            if when == "detach":
                log.error("%s", error)
            else:
                raise error
        return skip
