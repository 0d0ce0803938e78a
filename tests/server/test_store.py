"""The store keeps one attach per rank (the highest plausible step of it), caps runs, ranks
and bytes, and evicts on time."""

from __future__ import annotations

import json
import logging
import threading
import tracemalloc
from typing import Any

import pytest

from guard_server import CapacityError, ReportBatch, Settings, StepJumpError, Store
from guard_server.families import series_of
from guard_server.rejections import REJECT_REASONS
from guard_server.trail import TRAIL_POINTS
from guard_server.wire import CHECKS


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


def test_a_new_attach_replaces_the_state_at_once(make_batch: Any, clock: Any) -> None:
    # A trainer restarted after a crash (same run_id and rank, steps from zero) that halts at
    # step 6 is visible at once, not hidden behind the old attach's step 300.
    store = Store(Settings(), clock=clock)
    store.ingest(_batch(make_batch, steps=(300,), attach_id="old-attach", skipped_steps=9))
    clock.advance(5)
    store.ingest(_batch(make_batch, steps=(6,), attach_id="new-attach", halted="nonfinite"))
    (view,) = store.snapshot().ranks
    assert (view.latest.step, view.latest.halted, view.latest.skipped_steps) == (6, "nonfinite", 0)
    store.ingest(_batch(make_batch, steps=(5,), attach_id="new-attach"))  # stale retry: ignored
    assert store.snapshot().ranks[0].latest.step == 6


def test_after_a_final_report_a_new_attach_starts_over(make_batch: Any, clock: Any) -> None:
    store = Store(Settings(), clock=clock)
    store.ingest(_batch(make_batch, steps=(50,), final=True, attach_id="first-attach"))
    assert store.snapshot().ranks[0].finished_at is not None
    store.ingest(_batch(make_batch, steps=(1,), attach_id="second-attach"))
    (view,) = store.snapshot().ranks
    assert (view.latest.step, view.finished_at) == (1, None)


def test_a_forged_step_cannot_freeze_a_rank(make_batch: Any, clock: Any, caplog: Any) -> None:
    store = Store(Settings(max_step_rate=100, step_burst=50), clock=clock)
    store.ingest(_batch(make_batch, steps=(10,)))
    before = store.snapshot()
    with pytest.raises(StepJumpError, match="MAX_STEP_RATE") as info:
        store.ingest(_batch(make_batch, steps=(11, 2**53)))
    assert (info.value.index, info.value.bound) == (1, 60)
    after = store.snapshot()
    assert after.ranks == before.ranks and after.reports_total == before.reports_total
    assert after.rejected["implausible_step"] == 1
    clock.advance(2)  # the allowance refills to its burst of 50, and no further
    with pytest.raises(StepJumpError):
        store.ingest(_batch(make_batch, steps=(61,)))
    store.ingest(_batch(make_batch, steps=(60,)))
    # A forged report under another attach takes the rank over only until the real one
    # reports again (and two writers on one rank are named in the log, once).
    store.ingest(_batch(make_batch, steps=(2**53,), attach_id="forged-attach"))
    assert store.snapshot().ranks[0].latest.step == 2**53
    wire_attach = make_batch()["reports"][0]["attach_id"]
    with caplog.at_level("WARNING", logger="guard_server"):
        store.ingest(_batch(make_batch, steps=(61,)))
        store.ingest(_batch(make_batch, steps=(2**53,), attach_id="forged-attach"))
        store.ingest(_batch(make_batch, steps=(62,)))
    assert store.snapshot().ranks[0].latest.step == 62
    assert [r.message.count("two guards report") for r in caplog.records] == [1]
    assert wire_attach[:8] in caplog.records[0].message


def test_the_step_allowance_holds_over_any_window(make_batch: Any, clock: Any) -> None:
    # A forger with the rank's attach_id (any reader sees it) posts as far ahead as the server
    # lets it, every 10 ms for a second: the step moves 50 + 100 * 1 s, not 50 per post.
    store = Store(Settings(max_step_rate=100, step_burst=50), clock=clock)
    store.ingest(_batch(make_batch, steps=(0,)))
    refused = 0
    for _ in range(100):
        clock.advance(0.01)
        step = store.snapshot().ranks[0].latest.step
        try:
            store.ingest(_batch(make_batch, steps=(step + 50,)))
        except StepJumpError as exc:
            refused += 1
            store.ingest(_batch(make_batch, steps=(exc.bound,)))  # a refusal spends nothing
    assert 145 <= store.snapshot().ranks[0].latest.step <= 150 and refused >= 98
    # After a silence the allowance is the burst, not the burst plus the silence.
    clock.advance(60)
    step = store.snapshot().ranks[0].latest.step
    with pytest.raises(StepJumpError):
        store.ingest(_batch(make_batch, steps=(step + 51,)))
    store.ingest(_batch(make_batch, steps=(step - 5,)))  # stale: moves nothing, spends nothing
    store.ingest(_batch(make_batch, steps=(step + 50,)))
    assert store.snapshot().rejected["implausible_step"] == refused + 1


def test_no_step_bound_when_the_rate_is_none(make_batch: Any) -> None:
    store = Store(Settings(max_step_rate=None))  # the trainer's own in-process endpoint
    store.ingest(_batch(make_batch, steps=(1,)))
    store.ingest(_batch(make_batch, steps=(10**9,)))
    assert store.snapshot().ranks[0].latest.step == 10**9


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


def test_the_trail_holds_the_last_points_of_the_attach_in_step_order(make_batch: Any) -> None:
    store = Store(Settings())
    for first, last in ((1, 20), (31, 60), (11, 30), (61, 80)):  # 11-30 come late: dropped
        steps = tuple(range(first, last + 1))
        store.ingest(_batch(make_batch, steps=steps, loss=None if first == 61 else 2.5))
    points = store.trails("run-1", [0, 7])[0]  # rank 7 holds nothing: left out
    assert len(points) == TRAIL_POINTS and store.trails("run-1", [7]) == {}
    assert [p[0] for p in points] == [*range(11, 21), *range(31, 81)]  # the last 60 held
    assert points[0][1:] == (2.5, 1.2e-09) and points[-1][1] is None
    store.ingest(_batch(make_batch, steps=(3,), attach_id="another-attach"))
    assert [p[0] for p in store.trails("run-1", [0])[0]] == [3]  # a new attach starts over


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
    store.rejections.count("invalid")
    store.rejections.count("invalid")
    store.rejections.count("unauthorized")
    rejected = store.snapshot().rejected
    assert rejected == dict.fromkeys(REJECT_REASONS, 0) | {"unauthorized": 1, "invalid": 2}


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


def _events(wire_example: Any, n: int, text: str) -> list[dict[str, Any]]:
    event = wire_example["reports"][0]["events"][0]
    return [event | {"message": f"{i} {text}", "module": "m" * 256} for i in range(n)]


def test_the_byte_estimate_bounds_what_is_held(make_batch: Any, wire_example: Any) -> None:
    # The budget is only as good as the estimate: it must not under-count what a rank holds,
    # nor over-count it so far that the budget means nothing.
    full = {c: dict.fromkeys(("fail", "warn", "skip", "mask", "repair"), 7) for c in CHECKS}
    cases = {
        "plain": {},
        "every count": {"violations": full},
        "ascii events": {"events": _events(wire_example, 32, "x" * 4000)},
        "astral events": {"events": _events(wire_example, 32, "\U0001f600" * 4000)},
    }
    steps = {"a full trail": tuple(range(1, TRAIL_POINTS + 1))}  # its ring is allocated whole
    cases["a full trail"] = {}
    for name, fields in cases.items():
        # Parsed inside the measurement, as the server parses each body: what stays after
        # the bodies are gone is what the store holds.
        bodies = [json.dumps(make_batch(rank=r, steps=steps.get(name, (1,)), **fields))
                  for r in range(200)]
        store = Store(Settings(max_ranks_per_run=1000))
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for body in bodies:
            store.ingest(ReportBatch.model_validate_json(body))
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        estimate = store.held_bytes
        assert held <= estimate <= 2.5 * held, (name, held, estimate)


def test_a_flood_past_the_byte_budget_is_refused(make_batch: Any, wire_example: Any) -> None:
    settings = Settings(max_bytes=34 << 20, max_body_bytes=512 << 10, max_inflight_scrapes=1,
                        max_inflight_reads=1, max_ranks=8192)
    # 19 MiB kept for bodies in flight, 6 for a scrape, 4 for a read (a page answered)
    assert settings.state_bytes == 5 << 20
    store = Store(settings)
    heavy = _events(wire_example, 32, "\U0001f600" * 4000)  # ~0.5 MiB a rank
    with pytest.raises(CapacityError, match="GUARD_SERVER_MAX_BYTES") as info:
        for rank in range(4096):
            store.ingest(ReportBatch.model_validate_json(json.dumps(
                make_batch(rank=rank, events=heavy))))
    assert info.value.scope == "bytes"
    snap = store.snapshot()
    assert snap.held_bytes <= settings.state_bytes and snap.rejected["over_budget"] == 1
    assert 2 <= len(snap.ranks) < 16  # of the 4096 the flood tried
    # A light rank still fits in what is left; known ranks go on reporting.
    store.ingest(_batch(make_batch, rank=5000))
    store.ingest(_batch(make_batch, rank=0, steps=(2,)))
    assert store.snapshot().held_bytes <= settings.state_bytes


def test_only_the_last_events_are_held(make_batch: Any, wire_example: Any) -> None:
    # A rank keeps its last 32 events, whichever reports brought them (docs/server.md: most
    # reports bring none, and a violation must stay readable after them), never more: one
    # report's worth however many reports arrive.
    store = Store(Settings())
    for step in range(1, 20):
        store.ingest(_batch(make_batch, steps=(step,), events=_events(wire_example, 32, "x")))
    view = store.snapshot().ranks[0]
    assert len(view.events) == 32 and view.latest.events == []
    assert store.held_bytes < 64 * 1024
    store.ingest(_batch(make_batch, steps=(20,)))  # no events: the last ones stay
    assert store.snapshot().ranks[0].events == view.events
    store.ingest(_batch(make_batch, steps=(1,), attach_id="restart-attach"))
    assert store.snapshot().ranks[0].events == ()  # a new attach starts with none


def test_the_total_rank_cap_holds_across_runs(make_batch: Any) -> None:
    store = Store(Settings(max_ranks=3))
    for run_id in ("a", "b", "c"):
        store.ingest(_batch(make_batch, run_id=run_id))
    with pytest.raises(CapacityError, match="GUARD_SERVER_MAX_RANKS ") as info:
        store.ingest(_batch(make_batch, run_id="d"))
    assert info.value.scope == "ranks_total" and store.size() == (3, 3)


def test_ranks_with_two_writers_leave_nothing_behind(
    make_batch: Any, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Two attaches taking turns on one rank are logged once; that note must go with the rank,
    # or rounds of such ranks that finish and expire grow the server outside its budget.
    store = Store(Settings(finished_ttl_s=10), clock=clock)

    def churn(round_: int) -> None:
        for n in range(500):
            run_id = f"x{round_}-{n // 250}".ljust(100, "y")
            for attach, final in (("attach-aaaa", False), ("attach-bbbb", False),
                                  ("attach-aaaa", True)):
                store.ingest(_batch(make_batch, run_id=run_id, rank=n % 250, attach_id=attach,
                                    final=final))
        clock.advance(10)
        assert store.snapshot().ranks == []

    caplog.set_level(logging.ERROR, logger="guard_server")  # not 500 warnings a round
    churn(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for round_ in range(1, 5):
            churn(round_)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.size() == (0, 0) and store.held_bytes == 0
    assert grown < 64 << 10, f"{grown} bytes left behind by 2000 expired ranks"


def test_the_series_cap_holds_for_new_ranks_and_for_growth(make_batch: Any, clock: Any) -> None:
    # What a scrape costs is its series: a new rank, or a report that adds series to a known
    # one (a violation counter, a halt), is refused past GUARD_SERVER_MAX_SERIES.
    per = series_of(_batch(make_batch).reports[0])
    store = Store(Settings(max_series=4 * per + 2, rank_ttl_s=60), clock=clock)
    for rank in range(4):
        store.ingest(_batch(make_batch, rank=rank))
    with pytest.raises(CapacityError, match="GUARD_SERVER_MAX_SERIES") as info:
        store.ingest(_batch(make_batch, rank=4))
    assert (info.value.scope, info.value.limit) == ("series", 4 * per + 2)
    two_more = {"padding_mass": {"warn": 1}, "nonfinite": {"fail": 0}}
    violations = make_batch()["reports"][0]["violations"] | two_more
    store.ingest(_batch(make_batch, rank=0, steps=(2,), violations=violations))
    assert store.held_series == 4 * per + 2
    with pytest.raises(CapacityError):
        store.ingest(_batch(make_batch, rank=1, steps=(2,), halted="nonfinite"))
    store.ingest(_batch(make_batch, rank=1, steps=(3,)))  # the same series: still fine
    snap = store.snapshot()
    assert snap.rejected["over_capacity"] == 2 and [v.rank for v in snap.ranks] == [0, 1, 2, 3]
    clock.advance(60)
    store.ingest(_batch(make_batch, rank=4))  # the expired ranks gave their series back
    assert store.held_series == per


def test_a_resumed_attach_is_taken_at_its_checkpoints_step(make_batch: Any, clock: Any) -> None:
    """A run resumed from a checkpoint (g.load_state_dict) is a new attach that starts at the
    checkpoint's step, far past the step burst, with the checkpoint's totals: taken at once,
    on a server that held the rank and on one that restarted too (docs/wire.md)."""
    settings = Settings()
    far = settings.step_burst * 5
    store = Store(settings, clock=clock)
    store.ingest(_batch(make_batch, steps=(far + 900,), attach_id="before-resume", skipped_steps=4))
    clock.advance(3600)  # preempted, resumed from the checkpoint of step `far`
    store.ingest(_batch(make_batch, steps=(far + 1,), attach_id="resumed-attach", skipped_steps=3))
    (view,) = store.snapshot().ranks
    assert (view.latest.step, view.latest.skipped_steps) == (far + 1, 3)
    fresh = Store(settings, clock=clock)
    fresh.ingest(_batch(make_batch, steps=(far + 1,), attach_id="resumed-attach", skipped_steps=3))
    assert fresh.snapshot().ranks[0].latest.step == far + 1
