"""The HTTP push sink against a real server: absent, killed, restarted, wrong token."""

from __future__ import annotations

import logging

import pytest

import guard
from guard.sinks.push import PushSink
from guard_server.embedded import EmbeddedServer
from guard_server.testing import free_port
from tests.conftest import tiny_gpt
from tests.guard.sinks.helpers import one_report, serving, train_steps, wait_until


def test_policy_push_sends_with_the_token_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from guard_server.settings import Settings

    monkeypatch.setenv("GUARD_TOKEN", "s3cret")
    server = EmbeddedServer("127.0.0.1", free_port(),
                            settings=Settings(token="s3cret", log_level="warning"))
    url = server.start()
    try:
        m = tiny_gpt()
        with guard.attach(m, policy=serving(push=url), vocab_size=100) as g:
            (sink,) = g.sinks
            assert isinstance(sink, PushSink)
            train_steps(g, m, 2)
        assert sink.sent == 3 and sink.dropped == 0  # two steps and the final report
        assert server.store.snapshot("sink-test").ranks[0].latest.final
    finally:
        server.stop()


def ranks_step(server: EmbeddedServer, run_id: str = "sink-test") -> int | None:
    snap = server.store.snapshot(run_id)
    return snap.ranks[0].latest.step if snap.ranks else None


def test_push_survives_absent_killed_and_restarted_server() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    m = tiny_gpt(garbage=0.5)
    sink = PushSink(url, max_queue=4, batch_size=2, flush_interval_s=0.05,
                    backoff_s=(0.05, 0.2), timeout_s=1.0)
    with guard.attach(m, policy=serving(), vocab_size=100) as g:
        g.add_sink(sink)
        train_steps(g, m, 10)  # server absent: nothing raised, the queue overflows
        assert wait_until(lambda: sink.dropped >= 4)  # 10 - one in flight - 4 queued
        server = EmbeddedServer("127.0.0.1", port)
        server.start()
        try:
            assert wait_until(lambda: ranks_step(server) == 10)  # the newest reports arrive
            dropped_seen = server.store.snapshot("sink-test").ranks[0].latest.dropped_reports
            assert dropped_seen >= 4
        finally:
            server.stop()
        train_steps(g, m, 10)  # killed mid-run: training goes on
        assert g.stats["step"] == 20
        restarted = EmbeddedServer("127.0.0.1", port)
        restarted.start()
        try:
            train_steps(g, m, 2)
            assert wait_until(lambda: ranks_step(restarted) == 22)
        finally:
            g.detach()
            restarted.stop()
    assert sink.dropped >= 4 + 4


def test_push_close_is_time_bounded_when_the_server_is_gone() -> None:
    sink = PushSink(f"http://127.0.0.1:{free_port()}", backoff_s=(0.05, 0.1), timeout_s=0.5)
    sink.emit(one_report(final=True))
    sink.close(timeout=0.5)
    # close() waits at most timeout + 1 s for the thread by construction; what it must leave
    # is a thread that gave up retrying and the report counted as dropped.
    assert not sink._thread.is_alive()
    assert sink.dropped == 1


def test_push_with_the_wrong_token_drops_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard_server.settings import Settings

    port = free_port()
    settings = Settings(token="right", log_level="warning")
    server = EmbeddedServer("127.0.0.1", port, settings=settings)
    server.start()
    try:
        sink = PushSink(server.url or "", token="wrong", flush_interval_s=0.05)
        m = tiny_gpt()
        with guard.attach(m, policy=serving(), vocab_size=100) as g:
            g.add_sink(sink)
            train_steps(g, m, 2)
        assert sink.dropped >= 2 and sink.sent == 0
        assert server.store.snapshot().reports_total == 0
    finally:
        server.stop()




def test_one_sink_sends_each_run_and_rank_as_its_own_batch_within_the_body_limit() -> None:
    from guard.policy import Action
    from guard.step.record import Record
    from guard.step.verdict import Verdict, Violation
    from guard_server.wire import ReportBatch
    from tests.guard.readings import values

    server = EmbeddedServer("127.0.0.1", free_port())
    url = server.start()
    sink = PushSink(url, batch_size=100, flush_interval_s=0.05)
    try:
        # 20 reports of 32 events of 4096 characters: ~2.6 MB, over the 1 MiB body limit.
        long = Verdict(tuple(Violation("padding_mass", Action.WARN, 1, "x" * 4096, rank=0,
                                       value=0.5, threshold=1e-6) for _ in range(32)))
        for i in range(20):
            record = Record("big", 0, {"real": 100, "rows": 128, "aligned": 128}, {})
            record.update(values(), i + 1)
            record.add(long)
            sink.emit(ReportBatch(run_id="big", rank=0, reports=[record.report()]))
            sink.emit(one_report(i + 1, run_id="small", rank=5))
        sink.close(timeout=10.0)
        assert sink.dropped == 0 and sink.sent == 40
        steps = {(v.run_id, v.rank): v.latest.step for v in server.store.snapshot().ranks}
        assert steps == {("big", 0): 20, ("small", 5): 20}
    finally:
        server.stop()


def test_an_unreachable_push_url_is_said_at_the_first_failure_with_the_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    sink = PushSink(url, backoff_s=(0.05, 0.1), timeout_s=0.5)
    try:
        with caplog.at_level(logging.DEBUG, logger="guard"):
            sink.emit(one_report(final=True))
            # Three tries at least (each retry is a debug line), before any close.
            assert wait_until(lambda: sum("retrying" in r.getMessage()
                                          for r in caplog.records) >= 3)
    finally:
        sink.close(timeout=0.5)
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    first = said[0]
    assert f"cannot push to {url}/v1/reports (ConnectError: " in first.getMessage()
    assert "(Connection refused)" in first.getMessage()  # the cause, at the first failure
    assert not any("cannot push" in r.getMessage() for r in said[1:])  # once, not per try
