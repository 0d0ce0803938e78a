"""Readings made by hand, slot by slot, read through the library's own layout."""

from __future__ import annotations

from collections.abc import Mapping

from guard.checks import Slot
from guard.device.reading import LAYOUT, Reading, Values


def raw(slots: Mapping[Slot, float] | None = None) -> list[float]:
    """The flags vector, as the host reads it, with `slots` set and every other slot 0."""
    out = [0.0] * len(LAYOUT)
    for slot, value in (slots or {}).items():
        out[LAYOUT.index[slot]] = value
    return out


def values(slots: Mapping[Slot, float] | None = None) -> Values:
    return LAYOUT.values(raw(slots))


def reading(glob: Mapping[Slot, float] | None = None, over: Mapping[Slot, int] | None = None,
            local: Mapping[Slot, float] | None = None) -> Reading:
    """`glob` the all-rank slots (and this rank's, unless `local`); `over`: the slots past
    their threshold, and the highest rank on which they are."""
    who = raw({slot: rank + 1.0 for slot, rank in (over or {}).items()})
    return LAYOUT.reading(raw(glob if local is None else local), raw(glob), who)
