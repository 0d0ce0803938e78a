"""Thread-safe in-memory state: the latest report of every rank of every run."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from guard_server.errors import CapacityError
from guard_server.settings import Settings
from guard_server.wire import Event, ReportBatch, StepReport

__all__ = ["REJECT_REASONS", "RankView", "RejectReason", "Snapshot", "Store"]

RejectReason = Literal["unauthorized", "too_large", "invalid", "over_capacity"]
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)
# Ingest sweeps for expired ranks at most this often; scrapes and reads always sweep.
_SWEEP_EVERY_S = 1.0


@dataclass(slots=True)
class _Rank:
    latest: StepReport
    last_seen: float  # server receive time of the last accepted batch, unix seconds
    finished_at: float | None  # receive time of the final report, if it came
    events: deque[Event]


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


def _supersedes(new: StepReport, old: StepReport) -> bool:
    # The highest step wins (ties go to the newcomer: a retry carries the same values). After
    # a final report, a later-stamped report is a new attach whose steps restart from zero.
    return new.step >= old.step or (old.final and new.timestamp > old.timestamp)


class Store:
    """Latest values per (run, rank), capped and evicted; fed by HTTP or in-process."""

    def __init__(self, settings: Settings | None = None, *, clock: Callable[[], float] = time.time):
        self.settings = settings if settings is not None else Settings()
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, dict[int, _Rank]] = {}
        self._reports_total = 0
        self._rejected: dict[RejectReason, int] = dict.fromkeys(REJECT_REASONS, 0)
        self._last_sweep = float("-inf")

    def ingest(self, batch: ReportBatch) -> None:
        """Store a validated batch; raise CapacityError (storing nothing) beyond the caps."""
        # Ties on step go to the final report, so a detach at a boundary marks the rank done.
        latest = max(batch.reports, key=lambda r: (r.step, r.final))
        now = self._clock()
        with self._lock:
            self._sweep(now, force=False)
            ranks = self._runs.get(batch.run_id)
            state = ranks.get(batch.rank) if ranks is not None else None
            if state is None:
                self._check_capacity(batch, now)
                state = _Rank(latest, now, None, deque(maxlen=self.settings.events_per_rank))
                self._runs.setdefault(batch.run_id, {})[batch.rank] = state
            elif _supersedes(latest, state.latest):
                state.latest = latest
            state.last_seen = now
            state.finished_at = now if state.latest.final else None
            with_events = [r for r in batch.reports if r.events]
            if with_events and state.events.maxlen:
                for report in sorted(with_events, key=lambda r: r.step):
                    state.events.extend(report.events)
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
            counts = (self._reports_total, dict(self._rejected))
        ranks.sort(key=lambda v: (v.run_id, v.rank))
        return Snapshot(ranks, *counts)

    def size(self) -> tuple[int, int]:
        """(runs, ranks) held now, expired ones included until the next sweep."""
        with self._lock:
            return len(self._runs), sum(len(ranks) for ranks in self._runs.values())

    def _check_capacity(self, batch: ReportBatch, now: float) -> None:
        # Caller holds the lock and has found no state for this rank.
        over = self._over_cap(batch)
        if over is not None:
            # Expired ranks may be all that fills the cap; only a full sweep can tell.
            self._sweep(now, force=True)
            over = self._over_cap(batch)
        if over is not None:
            self._rejected["over_capacity"] += 1
            scope, limit = over
            raise CapacityError(batch.run_id, batch.rank, limit, scope=scope)

    def _over_cap(self, batch: ReportBatch) -> tuple[str, int] | None:
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
                del ranks[rank]
            if not ranks:
                del self._runs[run_id]
