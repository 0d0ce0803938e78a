"""The stateful checks' states of one guard, as one collection: the only owner of their
lifecycle. Each verb (what attach found, the hooks' id counts, end of step, the reductions
before a read, stats, details, repair) is written here once; the façade (guard/parts.py,
guard/guard.py), the device side (guard/device/probe.py, ids.py, through their `Watched`) and
the reader (guard/step/reader.py) call the verbs instead of looping over the states.

The order is the verdict's (guard/checks/table.py), fixed here (`make` makes them in it, the
constructor sorts whatever it is given): a collective may be among the verbs, so every rank
runs them in one order (never a set's, whose order may differ across processes: str
hashing)."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping

import torch
from torch import nn

from guard.checks import CHECKS
from guard.checks.spec import Stats
from guard.device.hooks import Handle
from guard.device.reading import Reading
from guard.policy import Action, Policy
from guard.stateful.state import Attaching, CheckState, Finding
from guard_server.wire import ID_KINDS, CheckName, IdKind

__all__ = ["States"]

_ORDER: dict[CheckName, int] = {spec.check: i for i, spec in enumerate(CHECKS)}


class States:
    """The states of the enabled stateful checks, in the table's order."""

    def __init__(self, states: Iterable[CheckState] = ()) -> None:
        given = list(states)
        names = [s.check_name for s in given]
        if unknown := [n for n in names if n not in _ORDER]:
            raise ValueError(f"stateful check {unknown[0]!r} is not in guard/checks/table.py")
        if len(set(names)) < len(names):
            raise ValueError(f"one state per check, got {sorted(names)}")
        self._states = tuple(sorted(given, key=lambda s: _ORDER[s.check_name]))
        # Per kind of id, the states that count it (none: the id hooks ask nothing).
        self._counting = {k: tuple(s for s in self._states if s.watches(k)) for k in ID_KINDS}

    @classmethod
    def make(cls, makers: Mapping[CheckName, Callable[[Attaching], CheckState | None]],
             at: Attaching) -> States:
        """The state of each enabled check that `makers` has a maker for (None: nothing to
        watch on this model), made in the table's order too: making one may be a collective."""
        made = (make(at) for spec in CHECKS if at.policy.enabled(spec.check)
                and (make := makers.get(spec.check)) is not None)
        return cls(state for state in made if state is not None)

    def __iter__(self) -> Iterator[CheckState]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    # -- at attach ---------------------------------------------------------------------------

    def findings(self) -> tuple[Finding, ...]:
        """The rows each found at attach (`Guard.findings`)."""
        return tuple(f for s in self._states for f in s.findings())

    def unread(self) -> list[tuple[CheckName, str]]:
        """The weights whose rows a check cannot read between steps, and why (coverage)."""
        return [(s.check_name, u) for s in self._states if (u := s.unread()) is not None]

    def install(self) -> list[Handle]:
        """What each puts on besides the probe's hooks."""
        return [h for s in self._states for h in s.install()]

    def attach_notes(self, rank: int) -> list[tuple[CheckName, str]]:
        """What each found at attach, said once."""
        return [(s.check_name, said) for s in self._states
                if (said := s.attach_note(rank)) is not None]

    def after_attach(self, model: nn.Module) -> None:
        """Once the attach read passed: what each changes besides the weights."""
        for s in self._states:
            s.after_attach(model)

    @property
    def reads_at_attach(self) -> bool:
        """Something is checked before step 1 (the attach read)."""
        return any(s.reads_at_attach for s in self._states)

    # -- in the hooks and at a boundary (device ops only) ------------------------------------

    def watches(self, kind: IdKind) -> bool:
        """Some state counts this kind of id in the id hooks."""
        return len(self._counting[kind]) > 0

    def count(self, kind: IdKind, ids: torch.Tensor) -> None:
        """A training forward's ids of `kind`, to the states that count them."""
        for s in self._counting[kind]:
            s.count(kind, ids)

    def end_step(self) -> None:
        """A step boundary: each one's reductions into the flags (the gradients)."""
        for s in self._states:
            s.end_step()

    def check(self, *, weights: bool = True) -> None:
        """Before a read of the flags: each one's reductions into them (not `weights`: the
        read of detach, only those that run there)."""
        for s in self._states:
            if weights or s.at_detach:
                s.check()

    # -- at a read (the host) ----------------------------------------------------------------

    def stats(self, reading: Reading) -> list[Stats]:
        """Each one's figures for the record."""
        return [s.stats(reading) for s in self._states]

    def details(self, reading: Reading, *, reduce: bool) -> dict[str, str]:
        """What the host adds to the message of each check that fired in `reading`; `reduce`:
        combined over ranks (a collective may follow), every rank asking the same states."""
        return {s.check_name: s.detail(reading, reduce=reduce) for s in self._states
                if reading.fired_on(s.check_name) is not None}

    def repair(self, checks: Container[str]) -> None:
        """The repair of each state whose check is in `checks` (a set is fine: the order is
        this collection's)."""
        for s in self._states:
            if s.check_name in checks:
                s.repair()

    def repair_under(self, policy: Policy) -> None:
        """The repair of every check under the `repair` action (`Guard.repair()`)."""
        self.repair({s.check_name for s in self._states
                     if policy.action(s.check_name) is Action.REPAIR})
