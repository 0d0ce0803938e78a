"""What the push sink does with what comes back: an answer read only up to its bound, a
refusal quoted and cut in the log, a certificate for another name said once and not retried,
reports given up at close said. Loopback only; every server stops by itself."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from guard.sinks.push import PushSink
from guard_server import EmbeddedServer, Settings
from guard_server.testing import free_port, self_signed
from tests.guard.sinks.helpers import one_report, raw_server, wait_until


def test_an_answer_is_read_only_up_to_its_bound() -> None:
    # A 202 that goes on for 64 MiB (an upstream answering 256 MiB grew the trainer by ~580
    # MiB in 2 s: the deadline bounds time, not bytes). The sink reads 4 KiB and hangs up; the
    # server manages to send what the two sockets' buffers hold, no more.
    size, sent = 64 << 20, []

    def endless(n: int, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n" % size)
        total, chunk = 0, b"x" * (1 << 20)
        try:
            while total < size:
                conn.sendall(chunk)
                total += len(chunk)
        finally:
            sent.append(total)

    with raw_server(endless) as (url, _):
        sink = PushSink(url, flush_interval_s=0.05, backoff_s=(0.05, 0.1))
        sink.emit(one_report(final=True))
        assert wait_until(lambda: sink.sent == 1 and bool(sent), timeout_s=20)
        sink.close(timeout=1)
    assert sent[0] < 24 << 20, f"the server sent {sent[0] >> 20} MiB before the sink hung up"


def test_a_refusing_servers_answer_is_quoted_and_cut_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A body that would write log lines of its own, and go on for 10 kB.
    forged = b"bad batch\n2026-01-01 ERROR guard: all is well\n" + b"x" * 10_000

    def refuse(n: int, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 422 Unprocessable Entity\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(forged), forged))

    with raw_server(refuse) as (url, _), caplog.at_level(logging.ERROR, logger="guard"):
        sink = PushSink(url, flush_interval_s=0.05)
        sink.emit(one_report(final=True))
        assert wait_until(lambda: sink.dropped == 1, timeout_s=10)
        sink.close(timeout=1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and len(line) < 500, line
    assert "the server said 'bad batch\\n2026-01-01 ERROR guard: all is well\\nxxx" in line


def test_a_certificate_for_another_name_is_said_once_and_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A trusted certificate for the wrong name: refused, as it should be, and retried silently
    # at DEBUG for the whole run. It will not heal; say it once, loudly, and drop.
    try:
        cert, key = self_signed(tmp_path, "wrong.example")
    except FileNotFoundError:
        pytest.skip("openssl not installed: no certificate to serve")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted: only the name is wrong
    settings = Settings(port=0, ssl_certfile=cert, ssl_keyfile=key, log_level="critical")
    with EmbeddedServer(port=0, settings=settings) as server, \
            caplog.at_level(logging.ERROR, logger="guard"):
        sink = PushSink(f"https://127.0.0.1:{server.port}", flush_interval_s=0.05,
                        backoff_s=(0.05, 0.1))
        for step in (1, 2, 3):
            sink.emit(one_report(step, final=True))
            assert wait_until(lambda s=step: sink.dropped == s, timeout_s=10)
        sink.close(timeout=1)
        assert server.store.snapshot().reports_total == 0
    (line,) = [r.getMessage() for r in caplog.records]
    assert "TLS certificate is refused" in line and "will not heal" in line
    assert "127.0.0.1" in line and "SSL_CERT_FILE" in line


def test_reports_given_up_at_close_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    # During an outage close() gives up: the reports were counted, never said.
    sink = PushSink(f"http://127.0.0.1:{free_port()}", flush_interval_s=0.05,
                    backoff_s=(0.05, 0.1))
    for step in (1, 2, 3):
        sink.emit(one_report(step))
    with caplog.at_level(logging.WARNING, logger="guard"):
        sink.close(timeout=0.5)
    assert sink.dropped == 3 and sink.sent == 0
    # Said at the first failure (with its cause), and at close what was given up.
    (line,) = [r.getMessage() for r in caplog.records if "not pushed" in r.getMessage()]
    assert "3 reports not pushed to http://127.0.0.1:" in line
    assert "within the 0.5 s of close (last try: ConnectError: " in line
    assert "dropped, 3 in all" in line
