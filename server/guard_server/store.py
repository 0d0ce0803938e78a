"""Thread-safe in-memory state: the latest report of every rank of every run, held within a
budget in bytes as well as in count.

Per (run, rank) the store keeps the state of one attach (`attach_id` on every report): a
report of another attach replaces it at once, so a restarted trainer is visible on the next
scrape whatever step the old one had reached. Within one attach the highest step wins, and a
step moves ahead no faster than a token bucket allows (`_step_allowance`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

from guard_server.errors import CapacityError, StepJumpError
from guard_server.series import series_of
from guard_server.settings import Settings
from guard_server.wire import Event, ReportBatch, StepReport

__all__ = ["REJECT_REASONS", "RankView", "RejectReason", "Snapshot", "Store", "event_bytes"]

log = logging.getLogger("guard_server")

RejectReason = Literal[
    "unauthorized",
    "not_json",
    "too_large",
    "busy",
    "timeout",
    "disconnected",
    "invalid",
    "implausible_step",
    "over_capacity",
    "over_budget",
]
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)
# Ingest sweeps for expired ranks at most this often; scrapes and reads always sweep.
_SWEEP_EVERY_S = 1.0

# Estimated bytes held, upper bounds measured with tracemalloc on CPython 3.11 / pydantic 2
# (tests/server/test_store.py checks them against tracemalloc): a stored report is ~3.0 KiB
# plus its violation counts, an event ~1 KiB plus its strings.
_RANK_BYTES = 3200 + 1024  # the report, the rank's slot, its event deque
_CHECK_BYTES = 250  # one check's dict of actions in `violations`
_COUNT_BYTES = 100  # one (action, count) entry
_EVENT_BYTES = 1100
_RUN_BYTES = 512  # the run's dict of ranks


def event_bytes(event: Event) -> int:
    """Estimated bytes one stored event holds (its strings measured, not guessed)."""
    module = 0 if event.module is None else sys.getsizeof(event.module)
    return _EVENT_BYTES + sys.getsizeof(event.message) + module


def _report_bytes(report: StepReport) -> int:
    counts = sum(len(by_action) for by_action in report.violations.values())
    return _RANK_BYTES + _CHECK_BYTES * len(report.violations) + _COUNT_BYTES * counts


def _run_bytes(run_id: str) -> int:
    return _RUN_BYTES + sys.getsizeof(run_id)


class _Full(Exception):
    """A cap or the budget is reached before a full sweep: sweep, then try once more."""


@dataclass(slots=True)
class _Rank:
    attach_id: str
    previous: str | None  # the attach this one replaced, to tell two live writers apart
    latest: StepReport  # without its events: those live in `events`, once
    last_seen: float  # server receive time of the last accepted batch, unix seconds
    finished_at: float | None  # receive time of the final report, if it came
    events: deque[Event]
    nbytes: int
    series: int  # what `latest` puts on /metrics
    allowance: float  # steps `latest.step` may still move ahead, as of `allowance_at`
    allowance_at: float
    warned: bool = False  # two writers on this rank were logged (kept with the rank, no longer)


@dataclass(frozen=True, slots=True)
class RankView:
    """A read-only copy of one rank's state."""

    run_id: str
    rank: int
    latest: StepReport
    last_seen: float
    finished_at: float | None
    events: tuple[Event, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a scrape or a read needs, copied under the lock."""

    ranks: list[RankView]
    reports_total: int
    rejected: dict[RejectReason, int] = field(default_factory=dict)
    held_bytes: int = 0


class Store:
    """Latest values per (run, rank), capped, budgeted and evicted; fed by HTTP or in-process."""

    def __init__(self, settings: Settings | None = None, *, clock: Callable[[], float] = time.time):
        self.settings = settings if settings is not None else Settings()
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, dict[int, _Rank]] = {}
        self._nranks = 0
        self._bytes = 0
        self._series = 0
        self._reports_total = 0
        self._rejected: dict[RejectReason, int] = dict.fromkeys(REJECT_REASONS, 0)
        self._last_sweep = float("-inf")

    def ingest(self, batch: ReportBatch) -> None:
        """Store a validated batch, or raise (storing nothing and counting the reason):
        CapacityError beyond the caps (runs, ranks, series) or the byte budget, StepJumpError
        for a step further ahead than the rank's allowance."""
        latest = _latest_of(batch)
        now = self._clock()
        with self._lock:
            self._sweep(now, force=False)
            try:
                self._store(batch, latest, now, swept=False)
            except _Full:
                # Expired ranks may be all that fills a cap; only a full sweep can tell.
                self._sweep(now, force=True)
                self._store(batch, latest, now, swept=True)
            self._reports_total += len(batch.reports)

    def reject(self, reason: RejectReason) -> None:
        """Count a request rejected before it reached `ingest`."""
        with self._lock:
            self._rejected[reason] += 1

    def snapshot(self, run_id: str | None = None) -> Snapshot:
        """Copy the live state (of one run, or all), sorted by run and rank."""
        with self._lock:
            self._sweep(self._clock(), force=True)
            runs = self._runs.items() if run_id is None else [(run_id, self._runs.get(run_id, {}))]
            ranks = [
                RankView(rid, rank, s.latest, s.last_seen, s.finished_at, tuple(s.events))
                for rid, by_rank in runs
                for rank, s in by_rank.items()
            ]
            counts = (self._reports_total, dict(self._rejected), self._bytes)
        ranks.sort(key=lambda v: (v.run_id, v.rank))
        return Snapshot(ranks, counts[0], counts[1], counts[2])

    def size(self) -> tuple[int, int]:
        """(runs, ranks) held now, expired ones included until the next sweep."""
        with self._lock:
            return len(self._runs), self._nranks

    @property
    def held_bytes(self) -> int:
        """Estimated bytes of state held now (what GUARD_SERVER_MAX_BYTES bounds)."""
        with self._lock:
            return self._bytes

    @property
    def held_series(self) -> int:
        """Series the ranks held now put on /metrics (what GUARD_SERVER_MAX_SERIES bounds)."""
        with self._lock:
            return self._series

    # -- under the lock ----------------------------------------------------------------------

    def _store(self, batch: ReportBatch, latest: StepReport, now: float, *, swept: bool) -> None:
        ranks = self._runs.get(batch.run_id)
        state = ranks.get(batch.rank) if ranks is not None else None
        attach = latest.attach_id
        own = batch.reports
        if any(r.attach_id != attach for r in own):  # rare: a sender that re-attached
            own = [r for r in own if r.attach_id == attach]
        if state is not None and state.attach_id == latest.attach_id:
            allowance = self._step_allowance(batch, state, latest, now)
            self._update(batch, own, state, latest, now, swept=swept)
            state.allowance, state.allowance_at = allowance, max(now, state.allowance_at)
        else:
            self._replace(batch, own, state, latest, now, swept=swept)

    def _update(
        self, batch: ReportBatch, own: list[StepReport], state: _Rank, latest: StepReport,
        now: float, *, swept: bool,
    ) -> None:
        """A batch of the attach the rank already has: the highest step wins."""
        events = _events_after(state.events, own, self.settings.events_per_rank)
        superseded = latest.step >= state.latest.step
        nbytes, series = state.nbytes, state.series
        if superseded:
            nbytes += _report_bytes(latest) - _report_bytes(state.latest)
            series = series_of(latest)
        if events is not None:
            nbytes += sum(map(event_bytes, events)) - sum(map(event_bytes, state.events))
        self._admit(batch, nbytes - state.nbytes, series - state.series, swept=swept)
        if superseded:
            state.latest = _without_events(latest)
        if events is not None:
            state.events.clear()
            state.events.extend(events)
        self._bytes += nbytes - state.nbytes
        self._series += series - state.series
        state.nbytes, state.series = nbytes, series
        state.last_seen = now
        state.finished_at = now if state.latest.final else None

    def _replace(
        self, batch: ReportBatch, own: list[StepReport], old: _Rank | None, latest: StepReport,
        now: float, *, swept: bool,
    ) -> None:
        """A rank never seen, or a new attach of it: its state starts over from this batch."""
        keep = self.settings.events_per_rank
        events = _events_after((), own, keep) or []
        nbytes = _report_bytes(latest) + sum(map(event_bytes, events))
        series = series_of(latest)
        growth = nbytes - (old.nbytes if old is not None else 0)
        new_series = series - (old.series if old is not None else 0)
        new_run = batch.run_id not in self._runs
        growth += _run_bytes(batch.run_id) if new_run else 0
        if old is None:
            self._check_capacity(batch, swept=swept)
        self._admit(batch, growth, new_series, swept=swept)
        previous, warned = None, False
        if old is not None:
            previous, warned = old.attach_id, self._note_replaced(batch, old, latest)
        self._runs.setdefault(batch.run_id, {})[batch.rank] = _Rank(
            attach_id=latest.attach_id, previous=previous, latest=_without_events(latest),
            last_seen=now, finished_at=now if latest.final else None,
            events=deque(events, maxlen=keep), nbytes=nbytes, series=series,
            allowance=float(self.settings.step_burst), allowance_at=now, warned=warned,
        )
        self._nranks += old is None
        self._bytes += growth
        self._series += new_series

    def _admit(self, batch: ReportBatch, growth: int, new_series: int, *, swept: bool) -> None:
        """Refuse `growth` more bytes, or `new_series` more series, past GUARD_SERVER_MAX_BYTES
        or GUARD_SERVER_MAX_SERIES."""
        over_bytes = growth > 0 and self._bytes + growth > self.settings.state_bytes
        over_series = new_series > 0 and self._series + new_series > self.settings.max_series
        if not (over_bytes or over_series):
            return
        if not swept:
            raise _Full
        if over_bytes:
            self._rejected["over_budget"] += 1
            raise CapacityError(batch.run_id, batch.rank, self.settings.max_bytes, scope="bytes")
        self._rejected["over_capacity"] += 1
        raise CapacityError(batch.run_id, batch.rank, self.settings.max_series, scope="series")

    def _step_allowance(
        self, batch: ReportBatch, state: _Rank, latest: StepReport, now: float
    ) -> float:
        """What is left of the rank's step allowance once this batch moves its step; refuse a
        step further ahead than the allowance (StepJumpError).

        A token bucket per rank: it holds up to GUARD_SERVER_STEP_BURST steps, refills at
        GUARD_SERVER_MAX_STEP_RATE a second, and each accepted move spends its size. Over any
        t seconds a rank's step moves at most STEP_BURST + MAX_STEP_RATE * t, however many
        reports carry it: a bound that started over at each report let 200 reports of +10,000
        (with the attach_id any reader sees) take a rank to step 2,000,006 in 5 s.
        """
        rate, burst = self.settings.max_step_rate, float(self.settings.step_burst)
        if rate is None:
            return burst
        refill = rate * max(now - state.allowance_at, 0.0)
        allowance = min(state.allowance + refill, burst)
        move = latest.step - state.latest.step
        if move > allowance:
            self._rejected["implausible_step"] += 1
            index = batch.reports.index(latest)
            bound = state.latest.step + int(allowance)
            raise StepJumpError(batch.run_id, batch.rank, index, latest.step, bound)
        return allowance - max(move, 0)

    def _note_replaced(self, batch: ReportBatch, old: _Rank, latest: StepReport) -> bool:
        """Log two live writers on one rank, once while the rank is held; True once logged."""
        # An attach that comes back after another replaced it means two live writers: two
        # trainers (or guards) share this run_id and rank, and the state flips between them.
        if latest.attach_id == old.previous and not old.warned:
            log.warning(
                "run %r rank %d: reports alternate between two attaches (%s..., %s...): two "
                "guards report under this run_id and rank; give each its own run_id",
                batch.run_id, batch.rank, old.attach_id[:8], latest.attach_id[:8],
            )
            return True
        return old.warned

    def _check_capacity(self, batch: ReportBatch, *, swept: bool) -> None:
        # Caller holds the lock and has found no state for this rank.
        over = self._over_cap(batch)
        if over is not None and not swept:
            raise _Full
        if over is not None:
            self._rejected["over_capacity"] += 1
            scope, limit = over
            raise CapacityError(batch.run_id, batch.rank, limit, scope=scope)

    def _over_cap(self, batch: ReportBatch) -> tuple[str, int] | None:
        if self._nranks >= self.settings.max_ranks:
            return "ranks_total", self.settings.max_ranks
        ranks = self._runs.get(batch.run_id)
        if ranks is None:
            limit = self.settings.max_runs
            return ("runs", limit) if len(self._runs) >= limit else None
        limit = self.settings.max_ranks_per_run
        return ("ranks", limit) if len(ranks) >= limit else None

    def _sweep(self, now: float, *, force: bool) -> None:
        # Caller holds the lock. O(ranks), hence rate-limited on the ingest path.
        if not force and now - self._last_sweep < _SWEEP_EVERY_S:
            return
        self._last_sweep = now
        rank_ttl, finished_ttl = self.settings.rank_ttl_s, self.settings.finished_ttl_s
        for run_id in list(self._runs):
            ranks = self._runs[run_id]
            for rank in [
                rank
                for rank, s in ranks.items()
                if now - s.last_seen >= rank_ttl
                or (s.finished_at is not None and now - s.finished_at >= finished_ttl)
            ]:
                gone = ranks.pop(rank)
                self._bytes -= gone.nbytes
                self._series -= gone.series
                self._nranks -= 1
            if not ranks:
                del self._runs[run_id]
                self._bytes -= _run_bytes(run_id)


def _latest_of(batch: ReportBatch) -> StepReport:
    # A sender switches attach only forward, so the batch's last report names the newest one;
    # within it, ties on step go to the final report, so a detach at a boundary marks it done.
    attach = batch.reports[-1].attach_id
    own = [r for r in batch.reports if r.attach_id == attach]
    return max(own, key=lambda r: (r.step, r.final))


def _without_events(report: StepReport) -> StepReport:
    return report.model_copy(update={"events": []}) if report.events else report


def _events_after(
    held: Iterable[Event], reports: list[StepReport], keep: int
) -> list[Event] | None:
    """The rank's last `keep` events once `reports` are added (step order), or None when
    the batch brings no events."""
    carrying = [r for r in reports if r.events]
    if not carrying or keep == 0:
        return None
    new = [e for r in sorted(carrying, key=lambda r: r.step) for e in r.events]
    return [*held, *new][-keep:]
