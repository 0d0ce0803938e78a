"""One read of the flags, from reading to consequence: record, judge, localise, repair, skip,
emit, raise. The step clock calls it at attach, at each read boundary and at detach."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from guard.device.reading import Reading
from guard.policy import Action, Policy
from guard.step.episodes import Episodes
from guard.step.record import Record
from guard.step.verdict import judge
from guard.vocab.resolve import Sizes

__all__ = ["Names", "Reader", "When"]

log = logging.getLogger("guard")

# attach: the weights before step 1 (a fail stops the attach); step: a read boundary (skip
# may drop the update, the report goes out, a fail raises); detach: what is left unread (a
# fail is logged: the job is ending anyway, and one rank may detach alone).
When = Literal["attach", "step", "detach"]


@dataclass(frozen=True)
class Names:
    """What the messages call the guarded modules."""

    head: str  # the lm_head's name in the model
    weights: str  # the weights whose padding rows are checked


class Reader:
    """Turns each reading into its consequences for one guard."""

    def __init__(self, policy: Policy, sizes: Sizes, names: Names, record: Record,
                 episodes: Episodes | None,
                 repairs: Mapping[str, Callable[[], None]] | None = None,
                 details: Mapping[str, Callable[[Reading, bool], str]] | None = None) -> None:
        self._policy, self._sizes, self._names = policy, sizes, names
        self._record, self._episodes = record, episodes
        self._repairs = dict(repairs or {})  # check -> what its `repair` action does
        self._details = dict(details or {})  # check -> what the host adds to its message

    def read(self, reading: Reading, step: int, *, when: When, now: int = 0,
             in_step: bool = False, closure: bool = False) -> bool:
        """Act on `reading`, the figures of step `step` (`now`: the clock's step, later than
        `step` when the read lags); True: drop this optimizer step.

        `in_step`: the figures are this step's, read in the optimizer's step pre-hook, before
        the update (a NaN can then be localised by a re-run, and skip can drop the update);
        `closure`: that step was given a closure, which recomputes the gradients.
        """
        record = self._record
        record.update(reading.local, step)
        # Combined over ranks unless read at detach (one rank may detach alone).
        details = {c: add(reading, when != "detach") for c, add in self._details.items()
                   if reading.fired_on(c) is not None}
        verdict = judge(reading, self._policy, step=step, real=self._sizes.real_rows,
                        rows=self._sizes.rows, head=self._names.head, weights=self._names.weights,
                        real_from=self._sizes.found.source, details=details)
        if self._episodes is not None:
            verdict, note = self._episodes.annotate(verdict, rerun_now=in_step, step=now,
                                                    rank=record.rank)
            if note is not None:
                record.note(note)
        record.add(verdict)
        # No repair at detach: nothing trains after it, and a repair may be a collective
        # that a rank detaching alone would wait on forever.
        # The violations' order (the table's), never a set's: repairs may be collectives, and
        # str hashing differs per process, so a set could order them apart across ranks.
        for check in dict.fromkeys(v.check for v in verdict.violations
                                   if v.action is Action.REPAIR):
            if (repair := self._repairs.get(check)) is not None and when != "detach":
                repair()
        skip = False
        if when == "step":
            # Every rank reads the same all-reduced values, so every rank skips the same step.
            skip = in_step and verdict.skip
            if skip and closure:
                log.error("guard: optimizer.step(closure) recomputes the gradients, so skip "
                          "cannot drop step %d; it is applied", step)
                skip = False
            if skip:
                record.skipped()
            record.emit()
        if (error := verdict.error()) is not None:
            if when == "detach":
                log.error("%s", error)
            else:
                raise error
        return skip
