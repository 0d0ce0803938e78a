"""What the store may hold: the bytes its state takes (estimated), the series it puts on
/metrics, and the caps on runs and ranks. A batch that would pass one is refused whole."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from guard_server.rejections import RejectReason
from guard_server.settings import Settings
from guard_server.trail import TRAIL_POINTS
from guard_server.wire import Event, StepReport

__all__ = ["Budget", "Over", "event_bytes", "report_bytes", "run_bytes"]

# Estimated bytes held, upper bounds measured with tracemalloc on CPython 3.11 / pydantic 2
# (tests/server/test_store.py checks them against tracemalloc): a stored report is ~5.8 KiB
# plus its violation counts and its parameter's name, an event ~1 KiB plus its strings, a
# rank's trail of recent points (guard_server/trail.py) 1.5 KiB, allocated whole when the
# rank arrives.
_TRAIL_BYTES = 64 + 3 * 8 * TRAIL_POINTS + 96  # the array, its floats, the Trail and its ints
_RANK_BYTES = 6000 + 1024 + _TRAIL_BYTES  # the report, the rank's slot, its events, its trail
_CHECK_BYTES = 250  # one check's dict of actions in `violations`
_COUNT_BYTES = 100  # one (action, count) entry
_EVENT_BYTES = 1100
_RUN_BYTES = 512  # the run's dict of ranks


def event_bytes(event: Event) -> int:
    """Estimated bytes one stored event holds (its strings measured, not guessed)."""
    module = 0 if event.module is None else sys.getsizeof(event.module)
    return _EVENT_BYTES + sys.getsizeof(event.message) + module


def report_bytes(report: StepReport) -> int:
    counts = sum(len(by_action) for by_action in report.violations.values())
    top = 0 if report.grad_norm_top is None else sys.getsizeof(report.grad_norm_top)
    return _RANK_BYTES + _CHECK_BYTES * len(report.violations) + _COUNT_BYTES * counts + top


def run_bytes(run_id: str) -> int:
    return _RUN_BYTES + sys.getsizeof(run_id)


@dataclass(frozen=True)
class Over:
    """The cap a batch would pass: its scope (CapacityError's) and its limit."""

    scope: str  # "runs", "ranks", "ranks_total", "series" or "bytes"
    limit: int

    @property
    def reason(self) -> RejectReason:
        return "over_budget" if self.scope == "bytes" else "over_capacity"


class Budget:
    """The running totals of what the store holds, against the settings' caps (under the
    store's lock)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bytes = 0
        self.series = 0
        self.ranks = 0

    def take(self, growth: int, new_series: int, ranks: int = 0) -> Over | None:
        """Hold `growth` more bytes and `new_series` more series (and `ranks` more ranks), or
        return the cap that would pass, holding nothing."""
        s = self.settings
        if growth > 0 and self.bytes + growth > s.state_bytes:
            return Over("bytes", s.max_bytes)
        if new_series > 0 and self.series + new_series > s.max_series:
            return Over("series", s.max_series)
        self.add(growth, new_series, ranks)
        return None

    def over_cap(self, runs: int, ranks_in_run: int | None) -> Over | None:
        """The cap a new rank would pass: of all ranks, of runs (a new run: `ranks_in_run`
        None) or of the run's ranks."""
        s = self.settings
        if self.ranks >= s.max_ranks:
            return Over("ranks_total", s.max_ranks)
        if ranks_in_run is None:
            return Over("runs", s.max_runs) if runs >= s.max_runs else None
        return Over("ranks", s.max_ranks_per_run) if ranks_in_run >= s.max_ranks_per_run \
            else None

    def add(self, nbytes: int, series: int, ranks: int = 0) -> None:
        self.bytes += nbytes
        self.series += series
        self.ranks += ranks
