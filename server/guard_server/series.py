"""How many series one rank's latest report puts on /metrics, counted at ingest so that the
store bounds a scrape's size (GUARD_SERVER_MAX_SERIES) before any scrape happens."""

from __future__ import annotations

from guard_server.wire import StepReport

__all__ = ["MAX_SERIES_PER_RANK", "series_of"]

# Series every rank has (collector.build_families): step, last report time, three non-finite
# tensors, two out-of-range kinds, skipped steps, three vocabulary sizes, dropped reports.
_ALWAYS = 12
# The most one rank can have: every check with every action (8 x 5), a halt, loss and both
# padding-mass ratios.
MAX_SERIES_PER_RANK = 56


def series_of(report: StepReport) -> int:
    """The series `report` adds to a scrape (what `build_families` emits for its rank)."""
    optional = (report.loss, report.padding_mass, report.padding_mass_max, report.halted)
    counts = sum(len(by_action) for by_action in report.violations.values())
    return _ALWAYS + sum(value is not None for value in optional) + counts
