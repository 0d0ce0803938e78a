"""A sparkline of a rank's recent points as inline SVG coordinates, drawn by the server: no
script, no image request (the page's CSP allows neither)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HEIGHT", "Spark", "WIDTH", "sparkline"]  # noqa: RUF022 - sorted() order, as tests/server/test_isolation.py checks

WIDTH, HEIGHT = 120, 24  # pixels: two a point of a full trail (guard_server/trail.py)
_PAD = 2  # keeps the stroke inside the box at the extremes


@dataclass(frozen=True)
class Spark:
    """What one sparkline draws: polylines (one per stretch of reported values), lone dots,
    the range it spans, or why there is nothing to draw."""

    lines: tuple[str, ...] = ()  # each an SVG `points` attribute: "x,y x,y ..."
    dots: tuple[tuple[float, float], ...] = ()  # a value with no neighbour to join
    low: float = 0.0
    high: float = 0.0
    steps: tuple[int, int] = (0, 0)
    why: str = ""  # set when nothing is drawn

    @property
    def drawn(self) -> bool:
        return not self.why


def sparkline(points: Sequence[tuple[int, float | None]], what: str) -> Spark:
    """`points` (step, value), oldest first; a None value (not reported) breaks the line."""
    if not points:
        return Spark(why="no reports held")
    values = [v for _, v in points if v is not None]
    if not values:
        return Spark(why=f"no {what} in the last {len(points)} reports")
    if len(points) == 1:
        return Spark(why="one report so far: a line needs two")
    first, last = points[0][0], points[-1][0]
    low, high = min(values), max(values)

    def xy(step: int, value: float) -> tuple[float, float]:
        x = _PAD + (WIDTH - 2 * _PAD) * (step - first) / max(last - first, 1)
        y = _PAD + (HEIGHT - 2 * _PAD) * (1.0 - _height(value, low, high))
        return round(x, 1), round(y, 1)

    stretches: list[list[tuple[float, float]]] = [[]]
    for step, value in points:
        if value is None:
            stretches.append([])
        else:
            stretches[-1].append(xy(step, value))
    lines = tuple(" ".join(f"{x},{y}" for x, y in s) for s in stretches if len(s) > 1)
    dots = tuple(s[0] for s in stretches if len(s) == 1)
    return Spark(lines, dots, low, high, (first, last))


def _height(value: float, low: float, high: float) -> float:
    """Where `value` lies from `low` (0) to `high` (1); 0.5 when they are equal. Every finite
    value the wire takes: two denormals' difference is exact and non-zero (halving them first
    rounded 5e-324 to 0, a ZeroDivisionError), and -1e308 to 1e308 spans past float's range,
    so those are halved instead (then the span is finite and far from zero)."""
    span = high - low
    if math.isinf(span):
        return (value / 2 - low / 2) / (high / 2 - low / 2)
    return (value - low) / span if span > 0 else 0.5
