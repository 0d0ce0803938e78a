"""What one read of the flags returns, as the host sees it, and the slot layout it is read in:
every spec's slots, one position each (guard/checks/)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from guard.checks import SPECS, Slot, Spec

__all__ = ["LAYOUT", "Layout", "Reading", "Values"]

F = TypeVar("F")


class Layout:
    """The position of every slot of `specs` in the flags vector, and how each reduces."""

    def __init__(self, specs: Iterable[Spec[Any]]) -> None:
        self.specs = tuple(specs)
        self.slots = tuple(slot for spec in self.specs for slot in spec.slots)
        self.index: Mapping[Slot, int] = {slot: i for i, slot in enumerate(self.slots)}
        if len(self.index) != len(self.slots):
            raise ValueError("a slot is listed by two specs")
        # Each check's slots, a slice of the vector (a spec's slots are laid out together).
        self._checks: list[tuple[str, slice]] = []
        first = 0
        for spec in self.specs:
            if spec.is_check:
                self._checks.append((spec.name, slice(first, first + len(spec.slots))))
            first += len(spec.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def positions(self, checks: Iterable[str]) -> list[int]:
        """The positions of the slots of `checks` in the vector."""
        wanted = set(checks)
        return [i for name, sl in self._checks if name in wanted
                for i in range(sl.start, sl.stop)]

    def combine(self, old: Sequence[float], new: Sequence[float]) -> list[float]:
        """Two consecutive windows as one: sums add, maxima max, a last value the newer one
        where the newer window wrote it."""
        out = []
        for slot, a, b in zip(self.slots, old, new, strict=True):
            if slot.reduce == "sum":
                out.append(a + b)
            elif slot.reduce == "max":
                out.append(max(a, b))
            else:  # "last"
                written = slot.written is None or new[self.index[slot.written]]
                out.append(b if written else a)
        return out

    def values(self, raw: Sequence[float]) -> Values:
        view = dict(zip(self.slots, raw, strict=True))  # slot -> value, for the specs
        return Values({spec.name: spec.figures(view) for spec in self.specs})

    def reading(self, local: Sequence[float], glob: Sequence[float],
                who: Sequence[float]) -> Reading:
        """From the host lists of one read: per slot the local value, the max over ranks and
        1 + the highest rank past the slot's threshold (0: none)."""
        crossed = frozenset(slot for slot, w in zip(self.slots, who, strict=True) if w > 0)
        over: dict[str, int | None] = {}
        for name, slots in self._checks:
            top = max(who[slots], default=0.0)
            over[name] = int(top) - 1 if top > 0 else None
        mine = self.values(local)
        # One process (or every rank alike): the all-rank figures are this rank's.
        return Reading(mine, mine if glob == local else self.values(glob), over, crossed)


class Values:
    """Every spec's figures of one read window, typed per spec: `values[padding_mass.SPEC]`.
    Counts are those of the window, not cumulative."""

    def __init__(self, figures: Mapping[str, object]) -> None:
        self._figures = dict(figures)

    def __getitem__(self, spec: Spec[F]) -> F:
        return cast(F, self._figures[spec.name])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Values) and other._figures == self._figures

    def __repr__(self) -> str:
        return f"Values({self._figures!r})"


@dataclass(frozen=True)
class Reading:
    """This rank's figures, the figures max-combined over all ranks, per check the highest
    rank past its threshold (None: no rank), and the slots past theirs on any rank. Every
    rank reads the same `glob`, `over` and `crossed`, so every rank takes the same decision;
    on a single process `glob` is `local`."""

    local: Values
    glob: Values
    over: Mapping[str, int | None]
    crossed: frozenset[Slot]
    # Per check that fired, what its state adds to the message on the host (the reader fills
    # it in, guard/step/reader.py): the ids and tokens, the weights read.
    details: Mapping[str, str] = field(default_factory=dict)

    def fired_on(self, check: str) -> int | None:
        """The highest rank on which `check` crossed its threshold, or None."""
        return self.over.get(check)


LAYOUT = Layout(SPECS)
