"""The guard's host-side record: stats, violation counts, events and the reports they make.

Fed once per read boundary with the values read off the flags; never touches a tensor.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from guard.decide import Violation
from guard.flags import Slot
from guard.report import build_report, empty_stats
from guard.sinks import Sink

__all__ = ["Ledger"]

log = logging.getLogger("guard")

# Warnings per check: every one of the first few, then one in this many, so a run that warns
# every step still shows its first occurrences without flooding the log.
_LOG_FIRST, _LOG_EVERY = 5, 100


class Ledger:
    """What `g.stats` shows and what the sinks receive."""

    def __init__(self, vocab: dict[str, int], enabled: dict[str, str]) -> None:
        self.vocab = vocab
        self.enabled = enabled  # check -> action, for zero counts in reports
        self.sinks: list[Sink] = []
        self.halted: str | None = None
        self._stats = empty_stats()
        self._violations: dict[str, Counter[str]] = {}
        self._events: list[Violation] = []

    @property
    def stats(self) -> dict[str, Any]:
        """A plain-dict copy (DESIGN.md, Public API)."""
        s = dict(self._stats)
        s["nonfinite"] = dict(s["nonfinite"])
        s["out_of_range"] = dict(s["out_of_range"])
        s["violations"] = {c: dict(a) for c, a in self._violations.items()}
        return s

    def update(self, local: list[float], step: int) -> None:
        """This rank's values of one read: the gauges as of now, the counters added."""
        s = self._stats
        s["step"] = step
        if local[Slot.LOSS_SEEN]:
            s["loss"] = local[Slot.LOSS]
        if local[Slot.PM_COUNT]:
            s["padding_mass"] = local[Slot.PM_SUM] / local[Slot.PM_COUNT]
            s["padding_mass_max"] = local[Slot.PM_MAX]
        for key, slot in (("logits", Slot.NF_LOGITS), ("hidden", Slot.NF_HIDDEN),
                          ("loss", Slot.NF_LOSS)):
            s["nonfinite"][key] += int(local[slot])
        s["out_of_range"]["input"] += int(local[Slot.OOR_INPUT])
        s["out_of_range"]["label"] += int(local[Slot.OOR_LABEL])

    def skipped(self) -> None:
        self._stats["skipped_steps"] += 1

    def record(self, v: Violation) -> None:
        """Count a violation, keep it for the next report, log it (rate-limited)."""
        counts = self._violations.setdefault(v.check, Counter())
        counts[v.action] += 1
        self._events.append(v)
        n = counts[v.action]
        if v.action != "fail" and (n <= _LOG_FIRST or n % _LOG_EVERY == 0):
            suffix = f" (occurrence {n})" if n > 1 else ""
            log.warning("%s%s", v.message, suffix)

    def note(self, v: Violation) -> None:
        """An event for the next report that is not a violation of its own (no count)."""
        log.warning("%s", v.message)
        self._events.append(v)

    def emit(self, *, final: bool = False) -> None:
        """One report to every sink; a sink that fails is logged and training goes on."""
        if not self.sinks:
            self._events.clear()
            return
        report = build_report(self.stats, events=self._events, halted=self.halted,
                              vocab=self.vocab, final=final, zeros=self.enabled)
        self._events = []
        for sink in self.sinks:
            try:
                sink.emit(report)
            except Exception:  # a sink must never stop training
                log.exception("guard: sink %r failed; continuing", sink)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
