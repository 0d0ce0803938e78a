"""The push sink against servers that misbehave: one that trickles its answer, one that asks
to retry later, one that wants a token, and a URL with credentials in it. Loopback only;
every server stops by itself."""

from __future__ import annotations

import email.utils
import logging
import socket
import threading
import time

import httpx
import pytest

from guard.sinks.push import PushSink
from guard.sinks.replies import redact, retry_after
from guard_server.embedded import EmbeddedServer
from guard_server.settings import Settings
from guard_server.testing import free_port
from tests.guard.sinks.helpers import one_report, raw_server, wait_until


def test_a_trickling_server_cannot_hold_the_push_thread() -> None:
    # 100 bytes at one every 0.3 s: each read is within the 2 s read timeout, the whole
    # answer would take 30 s. The 1 s deadline ends each try; close() ends the thread.
    def trickle(n: int, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Length: 100\r\n\r\n")
        for _ in range(100):
            conn.sendall(b"x")
            time.sleep(0.3)

    with raw_server(trickle) as (url, arrivals):
        before = set(threading.enumerate())
        sink = PushSink(url, timeout_s=2.0, deadline_s=1.0, backoff_s=(0.05, 0.1),
                        flush_interval_s=0.05)
        (pusher,) = [t for t in set(threading.enumerate()) - before if t.name == "guard-push"]
        for step in (1, 2, 3):
            sink.emit(one_report(step, final=step == 3))
        assert wait_until(lambda: len(arrivals) >= 2, timeout_s=10)  # a retry: it gave up
        sink.close(timeout=1.5)
        assert not pusher.is_alive()  # not held by the trickle
        assert sink.sent == 0 and sink.dropped == 3  # the batch in flight is counted


def test_retry_after_is_honoured() -> None:
    def busy_then_ok(n: int, conn: socket.socket) -> None:
        if n == 1:
            conn.sendall(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\n"
                         b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        else:
            conn.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")

    with raw_server(busy_then_ok) as (url, arrivals):
        sink = PushSink(url, backoff_s=(0.05, 0.1), flush_interval_s=0.05)
        sink.emit(one_report(1, final=True))
        assert wait_until(lambda: sink.sent == 1, timeout_s=10)
        sink.close(timeout=1)
    # Backoff alone would have retried after 0.05 s.
    assert len(arrivals) == 2 and arrivals[1] - arrivals[0] >= 0.9


def test_reports_emitted_meanwhile_do_not_cut_the_wait_short() -> None:
    # A server shedding load, a trainer emitting a report every 50 ms (each one fills a batch
    # and notifies the push thread): still one try per Retry-After.
    def always_busy(n: int, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\n"
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n")

    with raw_server(always_busy) as (url, arrivals):
        sink = PushSink(url, batch_size=1, backoff_s=(0.05, 0.1), flush_interval_s=0.05)
        for step in range(1, 41):
            sink.emit(one_report(step))
            time.sleep(0.05)
        sink.close(timeout=0.1)
    assert 1 <= len(arrivals) <= 3, f"{len(arrivals)} tries in 2 s against Retry-After: 1"


@pytest.mark.parametrize(("header", "seconds"), [
    ("2", 2.0), ("0.5", 0.5), ("-3", 0.0), ("86400", 60.0), ("soon", None), (None, None),
])
def test_retry_after_values(header: str | None, seconds: float | None) -> None:
    headers = {} if header is None else {"Retry-After": header}
    assert retry_after(httpx.Response(429, headers=headers)) == seconds


def test_retry_after_as_an_http_date() -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    found = retry_after(httpx.Response(503, headers={"Retry-After": when}))
    assert found is not None and 25 <= found <= 31


def test_a_missing_token_is_one_error_that_names_guard_token(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("GUARD_TOKEN", raising=False)
    server = EmbeddedServer("127.0.0.1", free_port(),
                            settings=Settings(token="right", log_level="warning"))
    url = server.start()
    try:
        sink = PushSink(url, flush_interval_s=0.05)
        with caplog.at_level(logging.ERROR, logger="guard"):
            for step in range(1, 6):  # five pushes, each refused
                sink.emit(one_report(step, final=True))
                assert wait_until(lambda s=step: sink.dropped >= s)
            sink.close(timeout=1)
    finally:
        server.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "GUARD_TOKEN" in errors[0] and "sent none" in errors[0] and "401" in errors[0]
    assert sink.dropped == 5 and server.store.snapshot().reports_total == 0


def test_credentials_in_the_push_url_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://alice:hunter2@127.0.0.1:{free_port()}"  # nothing listens
    with caplog.at_level(logging.DEBUG, logger="guard"):
        sink = PushSink(url, backoff_s=(0.05, 0.1), timeout_s=0.5)
        sink.emit(one_report(final=True))
        time.sleep(0.3)  # a few failed tries, each logged at debug
        sink.close(timeout=0.3)
    assert sink.dropped == 1
    assert "hunter2" not in caplog.text and "alice" not in caplog.text
    assert "http://***@127.0.0.1:" in caplog.text


@pytest.mark.parametrize(("url", "shown"), [
    ("http://u:p@host:9400/v1/reports", "http://***@host:9400/v1/reports"),
    ("https://token@host/v1/reports", "https://***@host/v1/reports"),
    ("http://u:p@[::1]:9400/x", "http://***@[::1]:9400/x"),
    ("http://host:9400/v1/reports", "http://host:9400/v1/reports"),
])
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown
