"""How far a rank's step may move ahead: a token bucket per rank.

It holds up to GUARD_SERVER_STEP_BURST steps, refills at GUARD_SERVER_MAX_STEP_RATE a second,
and each accepted move spends its size. Over any t seconds a rank's step moves at most
STEP_BURST + MAX_STEP_RATE * t, however many reports carry it: a bound that started over at
each report let 200 reports of +10,000 (with the attach_id any reader sees) take a rank to
step 2,000,006 in 5 s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepAllowance"]


@dataclass(slots=True)
class StepAllowance:
    """Steps the rank's step may still move ahead, as of `at` (unix seconds)."""

    steps: float
    at: float

    def left_after(self, move: int, now: float, rate: float | None,
                   burst: float) -> float | None:
        """What is left once `move` steps are spent at `now`, or None when the bucket (refilled
        since `at`) does not hold them. Spends nothing: `keep` does, once the move is stored."""
        if rate is None:
            return burst
        available = min(self.steps + rate * max(now - self.at, 0.0), burst)
        return None if move > available else available - max(move, 0)

    def keep(self, left: float, now: float) -> None:
        self.steps, self.at = left, max(now, self.at)

    def bound(self, now: float, *, rate: float | None, burst: float) -> int:
        """The furthest the step may move now (for the message of a refused move)."""
        if rate is None:
            return int(burst)
        return int(min(self.steps + rate * max(now - self.at, 0.0), burst))
