"""The push sink against receivers of other kinds, over loopback HTTP (the standard library's
server): a server of the first release (its own wire models, no version header) gets every
report lowered; a receiver that sets cookies gets none back; after close, the sink's thread
says nothing more."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

from guard.sinks.push import PushSink
from guard_server import EmbeddedServer, Settings
from tests.guard.sinks.helpers import one_report, wait_until
from tests.wire_versions import released_models, todays_report

# (request headers, body) -> (status, extra headers, body); every request is kept.
Reply = Callable[[dict[str, str], bytes], tuple[int, list[tuple[str, str]], bytes]]


@contextmanager
def receiver(reply: Reply) -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    seen: list[tuple[dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # the standard library names it
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            headers = {k.lower(): v for k, v in self.headers.items()}
            seen.append((headers, body))
            status, extra, text = reply(headers, body)
            self.send_response(status)
            for name, value in [*extra, ("Content-Length", str(len(text)))]:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def first_release(headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]],
                                                                  bytes]:
    """What the server of wire version 1 answers: its models, no Guard-Wire-Version."""
    try:
        released_models(1).ReportBatch.model_validate_json(body)
    except ValidationError as exc:
        return 422, [], json.dumps({"detail": exc.errors(include_url=False)}, default=str).encode()
    return 202, [], b'{"accepted": 1}'


def test_a_server_of_the_first_release_gets_every_report(
        caplog: pytest.LogCaptureFixture) -> None:
    with receiver(first_release) as (url, seen), caplog.at_level(logging.WARNING, "guard"):
        sink = PushSink(url, flush_interval_s=0.05, backoff_s=(0.05, 0.1))
        for n in range(1, 4):
            sink.emit(todays_report())
            assert wait_until(lambda n=n: sink.sent + sink.dropped == n)
        sink.close(timeout=2)
    assert (sink.sent, sink.dropped) == (3, 0)  # before: all three dropped on a 422
    # The first went whole, was refused, and went again lowered; the rest went lowered.
    assert len(seen) == 4 and b"untrained" in seen[0][1]
    assert all(b"untrained" not in body for _, body in seen[1:])
    said = [r.getMessage() for r in caplog.records if "reads wire version 1" in r.getMessage()]
    assert len(said) == 1 and "reports.untrained_rows" in said[0], said


def test_a_current_server_gets_every_field() -> None:
    with EmbeddedServer(port=0, settings=Settings(port=0, log_level="warning")) as server:
        assert server.url is not None
        sink = PushSink(server.url, flush_interval_s=0.05)
        sink.emit(todays_report())
        assert wait_until(lambda: sink.sent == 1)
        sink.close(timeout=2)
        latest = server.store.snapshot("today").ranks[0].latest
    assert latest.untrained_tokens is not None and latest.untrained_tokens.input == 2


def test_cookies_a_receiver_sets_are_never_kept_or_sent() -> None:
    cookies = [("Set-Cookie", f"c{i}={'x' * 40}; Path=/") for i in range(1500)]
    with receiver(lambda h, b: (202, cookies, b"{}")) as (url, seen):
        sink = PushSink(url, flush_interval_s=0.05)
        for step in range(1, 6):
            sink.emit(one_report(step))
            assert wait_until(lambda s=step: sink.sent == s)
        assert len(sink._client.cookies) == 0  # type: ignore[attr-defined]
        sink.close(timeout=2)
    assert len(seen) == 5 and not [h for h, _ in seen if "cookie" in h]


def test_nothing_is_said_after_close(caplog: pytest.LogCaptureFixture) -> None:
    # A receiver that answers after close has given up: the thread outlives close() and its
    # failure used to log "reports wait in the queue and are retried".
    release = threading.Event()

    def slow(headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        release.wait(10)
        return 503, [], b"{}"

    with receiver(slow) as (url, _), caplog.at_level(logging.DEBUG, logger="guard"):
        sink = PushSink(url, flush_interval_s=0.05)
        sink.emit(one_report(final=True))
        time.sleep(0.3)  # in flight
        sink.close(timeout=0.2)
        closed = len(caplog.records)
        release.set()
        time.sleep(1.5)
        after = [r.getMessage() for r in caplog.records[closed:]]
    assert after == []
    assert not [r for r in caplog.records if "are retried" in r.getMessage()]
    assert any("not pushed" in r.getMessage() for r in caplog.records)  # close said it


def test_what_an_answer_says_of_the_servers_version() -> None:
    from guard.sinks.wire_version import ServerVersion
    from guard_server.wire import WIRE_VERSION

    server = ServerVersion("http://x/v1/reports")
    assert server.heard(502, None) is None and server.version == WIRE_VERSION  # a proxy's
    said = server.heard(422, None)  # a first-release server's refusal
    assert server.version == 1 and said is not None and "reads wire version 1" in said
    assert server.heard(202, None) is None and server.version == 1  # its 202s say nothing
    assert server.heard(202, str(WIRE_VERSION)) is None and server.version == WIRE_VERSION  # up
    said = server.heard(202, "2")  # one version back: its fields named once
    assert server.version == 2 and said is not None and "reports.grad_norm" in said
    server.heard(202, str(WIRE_VERSION))
    assert server.heard(202, "99") is None and server.version == WIRE_VERSION  # newer: ours
    server.heard(202, "two")
    assert server.version == 1 and server.heard(422, None) is None  # said once per version
