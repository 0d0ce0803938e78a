"""A rank's recent reports as its page draws them: the last TRAIL_POINTS (step, loss, padding
mass) of its current attach, oldest first, in a ring of floats allocated once, so the bytes a
rank holds are known before its ring fills (guard_server/budget.py counts them)."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

from guard_server.wire import StepReport

__all__ = ["Point", "TRAIL_POINTS", "Trail"]  # noqa: RUF022 - sorted() order, as tests/server/test_isolation.py checks

# A minute of reports at the push sink's one a second, and one sparkline 120 pixels wide at
# two pixels a point: enough to see a trend or a spike, and 1.4 KiB a rank.
TRAIL_POINTS = 60
_NAN = float("nan")

# (step, loss, padding mass); None: that report had none.
Point = tuple[int, float | None, float | None]


class Trail:
    """The ring: each slot three float64 (a step, up to the wire's 2**53, is exact in one)."""

    __slots__ = ("_count", "_next", "_ring", "last")

    def __init__(self) -> None:
        self._ring = array("d", [_NAN]) * (3 * TRAIL_POINTS)
        self._next = 0  # the slot the next point goes in
        self._count = 0
        self.last = -1  # the highest step held: an older report adds nothing

    def extend(self, reports: Iterable[StepReport]) -> None:
        """Add the reports past the last step held, in step order."""
        for r in sorted(reports, key=lambda r: r.step):
            if r.step > self.last:
                self._add(r.step, r.loss, r.padding_mass)

    def _add(self, step: int, loss: float | None, padding_mass: float | None) -> None:
        i = 3 * self._next
        self._ring[i] = float(step)
        self._ring[i + 1] = _NAN if loss is None else loss
        self._ring[i + 2] = _NAN if padding_mass is None else padding_mass
        self._next = (self._next + 1) % TRAIL_POINTS
        self._count = min(self._count + 1, TRAIL_POINTS)
        self.last = step

    def points(self) -> list[Point]:
        """The points held, oldest first."""
        first = (self._next - self._count) % TRAIL_POINTS
        out = []
        for k in range(self._count):
            i = 3 * ((first + k) % TRAIL_POINTS)
            step, loss, mass = self._ring[i:i + 3]
            out.append((int(step), None if math.isnan(loss) else loss,
                        None if math.isnan(mass) else mass))
        return out
