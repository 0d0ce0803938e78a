"""What the guard logs of its violations, so that its log never goes quiet unannounced.

Per check: every one of the first few violations, then one in a hundred, with two exceptions
that always break through: a change of severity (a value ten times the largest logged, or a
new kind: another tensor, another kind of id, a fused head) and a violation logged once by
its key (coverage's first blind step). When a check's messages start being thinned out, its
last full message says so, and where every one is counted. At detach, one summary line per
check that fired.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from guard.policy import Action
from guard.step.verdict import Violation

__all__ = ["Messages"]

log = logging.getLogger("guard")

# Every one of the first few, then one in this many: a run that warns every step still shows
# its first occurrences without flooding the log.
FIRST, EVERY = 5, 100
# A value this many times the largest logged is a change of severity (a jump of an order of
# magnitude: a padding mass from 0.03 to 1, a NaN count from 1 to 1000).
WORSE = 10.0


@dataclass
class _Check:
    """What was logged of one check's violations."""

    count: int = 0  # training steps its violations stand for
    logged: int = 0
    unlogged: int = 0  # violations not logged one by one
    largest: float = 0.0  # the largest value logged
    kinds: set[str] = field(default_factory=set)
    worst: tuple[float, int] = (0.0, 0)  # (value, step) of the worst violation
    last_step: int = 0
    actions: set[str] = field(default_factory=set)
    kinds_once: set[str] = field(default_factory=set)  # the once-keys logged


class Messages:
    """Decides which violations reach the log, and says what it left out."""

    def __init__(self) -> None:
        self._checks: dict[str, _Check] = {}

    def violation(self, v: Violation, n: int) -> None:
        """Log `v` (the `n`-th of its check and action) if it is due. A fail is not logged
        here: the error it raises carries the message."""
        c = self._checks.setdefault(v.check, _Check())
        c.count += v.count
        c.last_step = v.step
        c.actions.add(v.action.value)
        if v.value >= c.worst[0]:
            c.worst = (v.value, v.step)
        if v.action is Action.FAIL:
            return
        worse = self._worse(c, v)
        if v.once is not None and v.once in c.kinds_once:
            c.unlogged += 1
            return
        if not (v.once is not None or n <= FIRST or n % EVERY == 0 or worse):
            c.unlogged += 1
            return
        notes = [f"occurrence {n}"] if n > 1 else []
        if worse:
            notes.append(worse)
        if n == FIRST and v.once is None:
            notes.append(f"from here on 1 in {EVERY} is logged, and any that is worse; every "
                         "one is counted in g.stats['violations'] and guard_violations_total")
        log.warning("%s%s", v.message, f" ({'; '.join(notes)})" if notes else "")
        c.logged += 1
        c.largest = max(c.largest, v.value)
        c.kinds.add(v.kind)
        if v.once is not None:
            c.kinds_once.add(v.once)

    @staticmethod
    def _worse(c: _Check, v: Violation) -> str | None:
        """Why `v` is worse than what was logged of its check, or None."""
        if not c.logged:
            return None
        if v.kind not in c.kinds:
            return f"a new kind: {v.kind}" if v.kind else "a new kind"
        if v.value > 0 and c.largest > 0 and v.value >= WORSE * c.largest:
            return f"{v.value / c.largest:.3g}x the largest value logged before"
        return None

    def summary(self) -> None:
        """One line per check that fired, at detach."""
        for check, c in self._checks.items():
            quiet = c.unlogged
            log.warning(
                "%s at detach: %d violation step(s) (%s), the worst %.4g at step %d, the "
                "last at step %d%s", check, c.count, ", ".join(sorted(c.actions)), c.worst[0],
                c.worst[1], c.last_step,
                f"; {quiet} not logged one by one" if quiet > 0 else "")
