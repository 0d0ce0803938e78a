"""The store keeps the highest step per rank, caps runs and ranks, and evicts on time."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from guard_server import CapacityError, ReportBatch, Settings, Store


def _batch(make_batch: Any, **kwargs: Any) -> ReportBatch:
    return ReportBatch.model_validate(make_batch(**kwargs))


def test_keeps_the_highest_step_whatever_the_order(make_batch: Any, clock: Any) -> None:
    store = Store(Settings(), clock=clock)
    store.ingest(_batch(make_batch, steps=(5, 9, 7)))
    store.ingest(_batch(make_batch, steps=(3,), skipped_steps=99))  # late and stale
    (view,) = store.snapshot().ranks
    assert view.latest.step == 9 and view.latest.skipped_steps == 0
    assert view.last_seen == clock.now
    assert store.snapshot().reports_total == 4


def test_after_a_final_report_a_later_attach_starts_over(make_batch: Any, clock: Any) -> None:
    store = Store(Settings(), clock=clock)
    store.ingest(_batch(make_batch, steps=(50,), final=True, timestamp=100.0))
    store.ingest(_batch(make_batch, steps=(40,), timestamp=90.0))  # stale retry: ignored
    assert store.snapshot().ranks[0].latest.step == 50
    store.ingest(_batch(make_batch, steps=(1,), timestamp=200.0))  # new attach
    (view,) = store.snapshot().ranks
    assert (view.latest.step, view.finished_at) == (1, None)


def test_keeps_the_last_events_in_step_order(make_batch: Any, wire_example: Any) -> None:
    event = wire_example["reports"][0]["events"][0]
    store = Store(Settings(events_per_rank=3))
    batch = make_batch(steps=(2, 1))
    for i, report in enumerate(batch["reports"]):
        report["events"] = [
            event | {"step": report["step"], "message": f"m{i}-{j}"} for j in range(2)
        ]
    store.ingest(ReportBatch.model_validate(batch))
    events = store.snapshot().ranks[0].events
    assert [e.message for e in events] == ["m1-1", "m0-0", "m0-1"]


def test_over_the_run_cap_nothing_is_stored(make_batch: Any) -> None:
    store = Store(Settings(max_runs=2))
    store.ingest(_batch(make_batch, run_id="a"))
    store.ingest(_batch(make_batch, run_id="b"))
    before = store.snapshot()
    with pytest.raises(CapacityError) as info:
        store.ingest(_batch(make_batch, run_id="c", steps=(1, 2, 3)))
    assert (info.value.scope, info.value.limit, info.value.run_id) == ("runs", 2, "c")
    after = store.snapshot()
    assert after.ranks == before.ranks and after.reports_total == before.reports_total
    assert after.rejected["over_capacity"] == 1
    store.ingest(_batch(make_batch, run_id="a", rank=0, steps=(8,)))  # known ranks still report


def test_over_the_rank_cap_nothing_is_stored(make_batch: Any) -> None:
    store = Store(Settings(max_ranks_per_run=2))
    for rank in (0, 1):
        store.ingest(_batch(make_batch, rank=rank))
    with pytest.raises(CapacityError, match="GUARD_SERVER_MAX_RANKS_PER_RUN") as info:
        store.ingest(_batch(make_batch, rank=2))
    assert info.value.scope == "ranks"
    assert [v.rank for v in store.snapshot().ranks] == [0, 1]
    store.ingest(_batch(make_batch, run_id="other", rank=2))  # the cap is per run


def test_silent_ranks_expire_after_the_ttl(make_batch: Any, clock: Any) -> None:
    store = Store(Settings(rank_ttl_s=60), clock=clock)
    store.ingest(_batch(make_batch, rank=0))
    clock.advance(30)
    store.ingest(_batch(make_batch, rank=1))
    clock.advance(30)  # rank 0 silent for 60 s, rank 1 for 30 s
    assert [v.rank for v in store.snapshot().ranks] == [1]
    clock.advance(30)
    assert store.snapshot().ranks == [] and store.size() == (0, 0)


def test_finished_ranks_expire_after_the_finished_ttl(make_batch: Any, clock: Any) -> None:
    store = Store(Settings(finished_ttl_s=10), clock=clock)
    store.ingest(_batch(make_batch, rank=0, steps=(5,), final=True))
    store.ingest(_batch(make_batch, rank=1, steps=(5,)))
    clock.advance(9)
    assert store.snapshot().ranks[0].finished_at is not None
    clock.advance(1)
    assert [v.rank for v in store.snapshot().ranks] == [1]


def test_expired_ranks_free_their_place_under_the_cap(make_batch: Any, clock: Any) -> None:
    store = Store(Settings(max_runs=1, rank_ttl_s=60), clock=clock)
    store.ingest(_batch(make_batch, run_id="old"))
    clock.advance(60)
    store.ingest(_batch(make_batch, run_id="new"))  # no scrape in between: ingest must sweep
    assert [v.run_id for v in store.snapshot().ranks] == ["new"]


def test_counts_rejects_by_reason() -> None:
    store = Store(Settings())
    store.reject("invalid")
    store.reject("invalid")
    store.reject("unauthorized")
    rejected = store.snapshot().rejected
    assert rejected == {"unauthorized": 1, "too_large": 0, "invalid": 2, "over_capacity": 0}


def test_concurrent_ingest_from_many_threads(make_batch: Any) -> None:
    store = Store(Settings())
    batches = [[_batch(make_batch, rank=r, steps=(s,)) for s in range(50)] for r in range(8)]

    def push(rank: int) -> None:
        for batch in batches[rank]:
            store.ingest(batch)
            store.snapshot()

    threads = [threading.Thread(target=push, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = store.snapshot()
    assert [v.latest.step for v in snap.ranks] == [49] * 8
    assert snap.reports_total == 400
