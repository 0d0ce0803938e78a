"""Thread-safe in-memory state: the latest report of every rank of every run, held within a
budget in bytes as well as in count.

Per (run, rank) the store keeps the state of one attach (`attach_id` on every report): a
report of another attach replaces it at once, so a restarted trainer is visible on the next
scrape whatever step the old one had reached. Within one attach the highest step wins, and a
step moves ahead no faster than a token bucket allows (guard_server/allowance.py). What it may
hold in all is the budget's (guard_server/budget.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from guard_server.allowance import StepAllowance
from guard_server.batches import events_after, latest_of, without_events
from guard_server.budget import Budget, Over, event_bytes, report_bytes, run_bytes
from guard_server.errors import CapacityError, StepJumpError
from guard_server.families import series_of
from guard_server.rejections import Rejections, RejectReason
from guard_server.settings import Settings
from guard_server.trail import Point, Trail
from guard_server.unknown_fields import UnknownFields
from guard_server.wire import Event, ReportBatch, StepReport

__all__ = ["RankView", "Row", "Snapshot", "Store"]

log = logging.getLogger("guard_server")

# Ingest sweeps for expired ranks at most this often; scrapes and reads always sweep.
_SWEEP_EVERY_S = 1.0


# What a scrape writes of a rank: run_id, rank, its latest report, when it was last heard from.
Row = tuple[str, int, StepReport, float]


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
    allowance: StepAllowance  # how far `latest.step` may still move ahead
    warned: bool = False  # two writers on this rank were logged (kept with the rank, no longer)
    trail: Trail = field(default_factory=Trail)  # its recent points, for its page


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
    unknown: dict[str, int] = field(default_factory=dict)


class Store:
    """Latest values per (run, rank), capped, budgeted and evicted; fed by HTTP or in-process."""

    def __init__(self, settings: Settings | None = None, *, clock: Callable[[], float] = time.time):
        self.settings = settings if settings is not None else Settings()
        self.rejections = Rejections()  # the ingest route counts its refusals here too
        self.unknown = UnknownFields()  # and the fields of a newer guard's reports
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, dict[int, _Rank]] = {}
        self._budget = Budget(self.settings)
        self._reports_total = 0
        self._last_sweep = float("-inf")

    def ingest(self, batch: ReportBatch) -> None:
        """Store a validated batch, or raise (storing nothing and counting the reason):
        CapacityError beyond the caps (runs, ranks, series) or the byte budget, StepJumpError
        for a step further ahead than the rank's allowance."""
        latest = latest_of(batch)
        now = self._clock()
        with self._lock:
            self._sweep(now, force=False)
            over = self._store(batch, latest, now)
            if over is not None:
                # Expired ranks may be all that fills a cap; only a full sweep can tell.
                self._sweep(now, force=True)
                over = self._store(batch, latest, now)
            if over is not None:
                self.rejections.count(over.reason)
                raise CapacityError(batch.run_id, batch.rank, over.limit, scope=over.scope)
            self._reports_total += len(batch.reports)

    def snapshot(self, run_id: str | None = None) -> Snapshot:
        """Copy the live state (of one run, or all), sorted by run and rank."""
        with self._lock:
            self._sweep(self._clock(), force=True)
            runs = self._runs.items() if run_id is None else [(run_id, self._runs.get(run_id, {}))]
            ranks = [RankView(rid, rank, s.latest, s.last_seen, s.finished_at, tuple(s.events))
                     for rid, by_rank in runs for rank, s in by_rank.items()]
            total, held = self._reports_total, self._budget.bytes
        ranks.sort(key=lambda v: (v.run_id, v.rank))
        return Snapshot(ranks, total, self.rejections.snapshot(), held, self.unknown.snapshot())

    def rank_keys(self) -> list[tuple[str, int]]:
        """Every (run_id, rank) held now, sorted, expired ones swept first: the order a scrape
        writes them in, a piece at a time (`latest`)."""
        with self._lock:
            self._sweep(self._clock(), force=True)
            keys = [(rid, rank) for rid, by_rank in self._runs.items() for rank in by_rank]
        keys.sort()
        return keys

    def latest(self, keys: Iterable[tuple[str, int]]) -> list[Row]:
        """(run_id, rank, latest report, last seen) of each of `keys` still held now: a scrape
        reads the state a piece at a time and so pins no report a newer one replaced."""
        with self._lock:  # latest and last_seen of one update, not of two
            held = [(rid, rank, self._runs.get(rid, {}).get(rank)) for rid, rank in keys]
            return [(rid, rank, s.latest, s.last_seen) for rid, rank, s in held if s is not None]

    def trails(self, run_id: str, ranks: Iterable[int]) -> dict[int, list[Point]]:
        """The recent (step, loss, padding mass) of each of `ranks` of `run_id` held now."""
        with self._lock:
            held = self._runs.get(run_id, {})
            return {r: held[r].trail.points() for r in ranks if r in held}

    def now(self) -> float:
        """The store's clock: what report ages are measured against."""
        return self._clock()

    def totals(self) -> tuple[int, int]:
        """(reports accepted since start, estimated bytes of state held now)."""
        with self._lock:
            return self._reports_total, self._budget.bytes

    def size(self) -> tuple[int, int]:
        """(runs, ranks) held now, expired ones included until the next sweep."""
        with self._lock:
            return len(self._runs), self._budget.ranks

    @property
    def held_bytes(self) -> int:
        """Estimated bytes of state held now (what GUARD_SERVER_MAX_BYTES bounds)."""
        with self._lock:
            return self._budget.bytes

    @property
    def held_series(self) -> int:
        """Series the ranks held now put on /metrics (what GUARD_SERVER_MAX_SERIES bounds)."""
        with self._lock:
            return self._budget.series

    # -- under the lock ----------------------------------------------------------------------

    def _store(self, batch: ReportBatch, latest: StepReport, now: float) -> Over | None:
        """Store the batch, or return the cap it would pass (nothing stored)."""
        ranks = self._runs.get(batch.run_id)
        state = ranks.get(batch.rank) if ranks is not None else None
        own = batch.reports
        if any(r.attach_id != latest.attach_id for r in own):  # rare: a sender that re-attached
            own = [r for r in own if r.attach_id == latest.attach_id]
        if state is None or state.attach_id != latest.attach_id:
            return self._replace(batch, own, state, latest, now)
        rate, burst = self.settings.max_step_rate, float(self.settings.step_burst)
        left = state.allowance.left_after(latest.step - state.latest.step, now, rate, burst)
        if left is None:
            self.rejections.count("implausible_step")
            bound = state.latest.step + state.allowance.bound(now, rate=rate, burst=burst)
            raise StepJumpError(batch.run_id, batch.rank, batch.reports.index(latest),
                                latest.step, bound)
        over = self._update(own, state, latest, now)
        if over is None:
            state.allowance.keep(left, now)
        return over

    def _update(self, own: list[StepReport], state: _Rank, latest: StepReport,
                now: float) -> Over | None:
        """A batch of the attach the rank already has: the highest step wins."""
        events = events_after(state.events, own, self.settings.events_per_rank)
        superseded = latest.step >= state.latest.step
        nbytes, series = state.nbytes, state.series
        if superseded:
            nbytes += report_bytes(latest) - report_bytes(state.latest)
            series = series_of(latest)
        if events is not None:
            nbytes += sum(map(event_bytes, events)) - sum(map(event_bytes, state.events))
        if (over := self._budget.take(nbytes - state.nbytes, series - state.series)) is not None:
            return over
        if superseded:
            state.latest = without_events(latest)
        if events is not None:
            state.events.clear()
            state.events.extend(events)
        state.nbytes, state.series = nbytes, series
        state.last_seen = now
        state.finished_at = now if state.latest.final else None
        state.trail.extend(own)
        return None

    def _replace(self, batch: ReportBatch, own: list[StepReport], old: _Rank | None,
                 latest: StepReport, now: float) -> Over | None:
        """A rank never seen, or a new attach of it: its state starts over from this batch."""
        keep = self.settings.events_per_rank
        events = events_after((), own, keep) or []
        nbytes = report_bytes(latest) + sum(map(event_bytes, events))
        series = series_of(latest)
        growth = nbytes - (old.nbytes if old is not None else 0)
        new_series = series - (old.series if old is not None else 0)
        ranks = self._runs.get(batch.run_id)
        growth += run_bytes(batch.run_id) if ranks is None else 0
        if old is None and (over := self._budget.over_cap(
                len(self._runs), None if ranks is None else len(ranks))) is not None:
            return over
        if (over := self._budget.take(growth, new_series, ranks=old is None)) is not None:
            return over
        previous, warned = None, False
        if old is not None:
            previous, warned = old.attach_id, self._note_replaced(batch, old, latest)
        state = self._runs.setdefault(batch.run_id, {})[batch.rank] = _Rank(
            attach_id=latest.attach_id, previous=previous, latest=without_events(latest),
            last_seen=now, finished_at=now if latest.final else None,
            events=deque(events, maxlen=keep), nbytes=nbytes, series=series,
            allowance=StepAllowance(float(self.settings.step_burst), now), warned=warned,
        )
        state.trail.extend(own)
        return None

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
                self._budget.add(-gone.nbytes, -gone.series, ranks=-1)
            if not ranks:
                del self._runs[run_id]
                self._budget.add(-run_bytes(run_id), 0)
