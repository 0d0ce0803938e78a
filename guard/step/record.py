"""The guard's host-side record: `g.stats`, violation counts, events, and the one report per
read that goes to the sinks, built with the wire's own models (guard_server/wire.py) and
clipped to its limits, so a sink never sees a report the server would reject."""

from __future__ import annotations

import functools
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any, cast, get_args

from annotated_types import Ge, Le
from pydantic import ValidationError

from guard.checks import SPECS
from guard.checks.spec import Gauges, Stats, Total
from guard.device.reading import LAYOUT, Values
from guard.policy import CHECKS, Action, Policy, default_run_id
from guard.quote import quote
from guard.sinks import Sink
from guard.step.messages import Messages
from guard.step.verdict import Note, Verdict, Violation
from guard.vocab.sizes import Audit
from guard_server.wire import (
    MAX_COUNT,
    MAX_EVENTS,
    MAX_MESSAGE,
    MAX_MODULE,
    ActionName,
    CheckName,
    Event,
    ReportBatch,
    StepReport,
    VocabSizes,
)

__all__ = ["LOG_PREFIX", "Record", "empty_stats"]

log = logging.getLogger("guard")

# The prefix of the guard's figures in a training framework's own logs (Record.scalars).
LOG_PREFIX = "guard/"
# Figures a trainer's loggers get from the trainer itself.
_NOT_LOGGED = frozenset({"loss"})


def _figures(values: Values) -> dict[str, Any]:
    """Every spec's figures for `g.stats` and the wire, named as there (guard/checks/)."""
    out: dict[str, Any] = {}
    for spec in SPECS:
        out.update(spec.stats(values[spec]))
    return out


def empty_stats() -> dict[str, Any]:
    """`g.stats` before the first read (README.md, "Use"): gauges None, counts 0."""
    zero = _figures(LAYOUT.values([0.0] * len(LAYOUT)))
    gauges = {k: None for k, v in zero.items() if not isinstance(v, Mapping)}
    counts = {k: dict(v) for k, v in zero.items() if isinstance(v, Mapping)}
    return {"step": 0, **gauges, **counts, "violations": {}, "skipped_steps": 0}


def _count(n: int) -> int:
    return min(n, MAX_COUNT)


@functools.cache
def _bounds(name: str) -> tuple[float, float]:
    """The bounds the wire puts on the float field `name` of a StepReport (a ratio's [0, 1])."""
    field = StepReport.model_fields[name]
    # `Annotated[float, Field(ge=..)] | None`: the constraints sit on the Annotated member.
    metadata = [*field.metadata, *(m for arg in get_args(field.annotation)
                                   for info in getattr(arg, "__metadata__", ())
                                   for m in getattr(info, "metadata", ()))]
    lo = next((m.ge for m in metadata if isinstance(m, Ge)), -math.inf)
    hi = next((m.le for m in metadata if isinstance(m, Le)), math.inf)
    return float(cast(float, lo)), float(cast(float, hi))


def _gauge(name: str, x: float | None) -> float | None:
    """A gauge for the wire: None unless finite, clipped to the field's bounds."""
    if x is None or not math.isfinite(x):
        return None
    lo, hi = _bounds(name)
    return min(max(x, lo), hi)


def _event(n: Note) -> Event:
    """The wire's event for a note or a violation, clipped to the wire's limits."""
    return Event(check=cast(CheckName, n.check), action=cast(ActionName, n.action.value),
                 step=_count(n.step), message=n.message[:MAX_MESSAGE],
                 module=None if n.module is None else n.module[:MAX_MODULE])


class Record:
    """What `g.stats` shows and what the sinks receive, for one guard on one rank."""

    def __init__(self, run_id: str, rank: int, vocab: dict[str, int],
                 enabled: Mapping[CheckName, Action]) -> None:
        self.run_id, self.rank = run_id, rank
        # A fresh id per attach: the server replaces a (run, rank)'s state when it changes, so
        # a restart is visible at once instead of hiding behind the old attach's higher steps.
        self.attach_id = uuid.uuid4().hex
        self.vocab = VocabSizes(**{k: _count(n) for k, n in vocab.items()})
        self.enabled = enabled  # check -> action: a 0 count in every report until it fires
        self.sinks: list[Sink] = []
        self.halted: str | None = None
        self._stats = empty_stats()
        # The names of g.stats that add up (counts, counts per kind), as against gauges.
        self.counted = {k for k, v in self._stats.items()
                         if isinstance(v, Mapping) and k != "violations"} | {"skipped_steps"}
        self._violations: dict[str, Counter[str]] = {}
        self._events: list[Event] = []
        self._once: set[str] = set()  # keys of violations reported already
        self._messages = Messages()  # what of them reaches the log
        self.unbuilt = 0  # reports that could not be built (logged once, counted here)
        self.mass_bound: float | None = None  # padding_mass.reported_bound, on the wire

    @classmethod
    def from_policy(cls, policy: Policy, audit: Audit, rank: int) -> Record:
        enabled = {c: policy.action(c) for c in CHECKS if policy.enabled(c)}
        vocab = {"real": audit.real, "rows": audit.rows, "aligned": audit.aligned}
        return cls(policy.run_id or default_run_id(), rank, vocab, enabled)

    @property
    def stats(self) -> dict[str, Any]:
        """A plain-dict copy (README.md, "Use")."""
        s = {k: dict(v) if isinstance(v, dict) else v for k, v in self._stats.items()}
        s["violations"] = {c: dict(a) for c, a in self._violations.items()}
        return s

    def update(self, values: Values, step: int, *extra: Stats) -> None:
        """This rank's figures of one read: the gauges as of now (unless the window measured
        none), the counts added; `extra`, what the stateful checks add (names)."""
        s = self._stats
        s["step"] = step
        for name, value in [*_figures(values).items(), *(i for e in extra for i in e.items())]:
            if isinstance(value, Gauges):  # a state per kind: as of now
                s[name] = dict(value)
            elif isinstance(value, Total):  # a count: added up, from the first reported
                s[name] = (s.get(name) or 0) + value
                self.counted.add(name)
            elif isinstance(value, Mapping):
                self.counted.add(name)
                held = s.setdefault(name, {})
                for kind, n in value.items():
                    held[kind] = held.get(kind, 0) + n
            elif value is not None:
                s[name] = value

    def add(self, verdict: Verdict) -> None:
        """Count each violation, keep it for the next report, log it (rate-limited)."""
        for v in verdict.violations:
            self._add(v)
        if verdict.fail is not None:
            self.halted = verdict.fail.check

    def _add(self, v: Violation) -> None:
        counts = self._violations.setdefault(v.check, Counter())
        counts[v.action.value] += v.count
        first = v.once is None or v.once not in self._once
        if v.once is not None:
            self._once.add(v.once)
        if first:
            self._events.append(_event(v))
        self._messages.violation(v, counts[v.action.value])

    def note(self, n: Note) -> None:
        """An event for the next report that is not a violation of its own (no count)."""
        log.warning("%s", n.message)
        self._events.append(_event(n))

    def totals(self) -> dict[str, Any]:
        """What adds up since attach (counts, counts per kind, `violations`), as plain data."""
        out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in self._stats.items()
               if k in self.counted and v is not None}
        return {**out, "violations": {c: dict(a) for c, a in self._violations.items()}}

    def add_totals(self, totals: Mapping[str, Any], step: int) -> None:
        """A resumed run's `totals()` added to this attach's, from step `step` on (checked by
        guard/step/resume.py)."""
        self._stats["step"] = step
        for name, value in totals.items():
            if name == "violations":
                for check, actions in value.items():
                    self._violations.setdefault(check, Counter()).update(actions)
            elif isinstance(value, Mapping):
                held = self._stats.setdefault(name, {})
                for kind, n in value.items():
                    held[kind] = held.get(kind, 0) + n
            else:
                self._stats[name] = (self._stats.get(name) or 0) + value
            self.counted.add(name)

    def skipped(self) -> None:
        self._stats["skipped_steps"] += 1

    def report(self, *, final: bool = False) -> StepReport:
        """The report of the last read (and the events since the previous report)."""
        s = self._stats
        violations = {c: {a: _count(n) for a, n in actions.items()}
                      for c, actions in self._violation_counts().items()}
        events, self._events = self._events[-MAX_EVENTS:], []
        figures: dict[str, Any] = {
            name: {k: _count(n) for k, n in value.items()} if isinstance(value, Mapping)
            else value[:MAX_MODULE] if isinstance(value, str)
            else _count(value) if isinstance(value, int) and not isinstance(value, bool)
            else _gauge(name, value) for name, value in self._figures_held().items()}
        return StepReport(
            attach_id=self.attach_id, step=_count(s["step"]), timestamp=time.time(), **figures,
            violations=cast(dict[CheckName, dict[ActionName, int]], violations),
            skipped_steps=_count(s["skipped_steps"]),
            halted=cast(CheckName | None, self.halted), vocab=self.vocab, dropped_reports=0,
            final=final, events=events, padding_mass_bound=self.mass_bound)

    def _figures_held(self) -> dict[str, Any]:
        """The specs' figures as of now: g.stats less its own keys."""
        return {k: v for k, v in self._stats.items()
                if k not in ("step", "violations", "skipped_steps")}

    def scalars(self) -> dict[str, float]:
        """The last read as one flat dict for a trainer's loggers: `guard/<name>` named as on
        the wire (`guard/nonfinite/logits`, `guard/violations/<check>/<action>`), gauges as of
        the last read, counters as running totals since attach; {} before the first training
        read (step 0 is attach's own read of the weights: no step's figures yet).

        Plain numbers the host already holds: building it reads nothing from the device, so
        a callback may call it at every log (docs/integrations.md, trainer loggers)."""
        s = self._stats
        if s["step"] < 1:
            return {}
        out: dict[str, float] = {"step": s["step"]}
        for name, value in self._figures_held().items():
            if isinstance(value, Mapping):
                out.update({f"{name}/{k}": n for k, n in value.items()})
            elif isinstance(value, int | float) and name not in _NOT_LOGGED:
                out[name] = value  # None: nothing measured (check off, or no padding); text
        for check, actions in self._violation_counts().items():
            out.update({f"violations/{check}/{a}": n for a, n in actions.items()})
        out["skipped_steps"] = s["skipped_steps"]
        return {LOG_PREFIX + k: float(v) for k, v in out.items()}

    def _violation_counts(self) -> dict[str, dict[str, int]]:
        """check -> action -> count; each enabled check shows its action at 0 until it fires,
        so its series starts with the run, not with its first violation."""
        counts: dict[str, dict[str, int]] = {c: {a.value: 0} for c, a in self.enabled.items()}
        for check, actions in self._violations.items():
            counts.setdefault(check, {}).update(actions)
        return counts

    def emit(self, *, final: bool = False) -> None:
        """One report to every sink; a report that cannot be built, or a sink that fails, is
        logged and training goes on."""
        if not self.sinks:
            self._events.clear()
            return
        try:
            batch = ReportBatch(run_id=self.run_id, rank=self.rank,
                                reports=[self.report(final=final)])
        except Exception as e:  # a report must never stop training
            self._unbuilt(e)
            return
        for sink in self.sinks:
            try:
                sink.emit(batch)
            except Exception:  # a sink must never stop training
                log.exception("sink %r failed; continuing", sink)

    def _unbuilt(self, e: Exception) -> None:
        """Log the first report that cannot be built (every later one fails alike), count all."""
        self.unbuilt += 1
        if self.unbuilt == 1:
            log.error("the report of step %d cannot be built (%s); no report reaches "
                      "the sinks while this lasts, training goes on", self._stats["step"],
                      _why(e))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def summarise(self) -> None:
        """One log line per check that fired (at detach), and the reports never built."""
        self._messages.summary()
        if self.unbuilt:
            log.error("%d reports could not be built and were not sent", self.unbuilt)


def _why(e: Exception) -> str:
    """What is wrong, bounded: a ValidationError by field, without the values it quotes."""
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                         for err in e.errors(include_url=False, include_input=False)[:3])
    return f"{type(e).__name__}: {quote(str(e), 200)}"
