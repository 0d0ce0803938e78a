"""The push thread cannot be stopped (issue 41, item 5): a push URL no request can go to is a
PolicyError naming export.push at attach, and nothing a receiver answers (a wire version of
5,000 digits, a Retry-After date past any calendar) ends the thread: later reports still go,
and close() says what the last try saw. Loopback only; every server stops by itself."""

from __future__ import annotations

import functools
import logging
import socket
import threading

import pytest

import guard
from guard.sinks.push import PushSink
from tests.conftest import policy, tiny_gpt
from tests.guard.sinks.helpers import one_report, raw_server, wait_until


@pytest.mark.parametrize(("url", "says"), [
    ("http://127.0.0.1:99999", "port"),
    ("http://127.0.0.1:9400/\x00", "control character"),
    ("http://127.0.0.1:9400/a\x07b", "control character"),
    ("http://:9400", "names no host"),
    ("http://xn--:9400", "no URL a request can go to"),
    ("http://alice:s3cret@127.0.0.1:0", "port"),
])
def test_a_push_url_no_request_can_go_to_is_refused_at_attach(url: str, says: str) -> None:
    p = policy() | {"export": {"serve": None, "push": url}}
    threads = set(threading.enumerate())
    with pytest.raises(guard.PolicyError) as info:
        guard.attach(tiny_gpt(), policy=p)
    message = str(info.value)
    assert "export.push" in message and says in message and "s3cret" not in message
    assert not [t for t in set(threading.enumerate()) - threads if t.name == "guard-push"]
    with pytest.raises(ValueError, match=says):
        PushSink(url)  # the sink's own check, for a sink made by hand


HOSTILE = {
    # Past int()'s 4,300-digit bound: it raised outside the handler and ended the thread.
    "a wire version of 5,000 digits": b"HTTP/1.1 202 Accepted\r\nGuard-Wire-Version: "
                                      + b"9" * 5000 + b"\r\n",
    # A year of 20 digits: email.utils raised OverflowError, caught by nothing.
    "a Retry-After past any calendar": b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: Mon, "
                                       b"01 Jan 99999999999999999999 00:00:00 GMT\r\n",
}


def _settled(sink: PushSink, reports: int) -> bool:
    return sink.sent + sink.dropped >= reports


@pytest.mark.parametrize("answer", HOSTILE.values(), ids=HOSTILE.keys())
def test_nothing_a_receiver_answers_ends_the_push_thread(
        answer: bytes, caplog: pytest.LogCaptureFixture) -> None:
    def hostile_first(n: int, conn: socket.socket) -> None:
        head = answer if n == 1 else b"HTTP/1.1 202 Accepted\r\n"
        conn.sendall(head + b"Content-Length: 0\r\nConnection: close\r\n\r\n")

    with raw_server(hostile_first) as (url, arrivals), \
            caplog.at_level(logging.WARNING, logger="guard"):
        threads = set(threading.enumerate())
        sink = PushSink(url, batch_size=1, backoff_s=(0.05, 0.1), flush_interval_s=0.05)
        (pusher,) = [t for t in set(threading.enumerate()) - threads if t.name == "guard-push"]
        for step in (1, 2, 3):
            sink.emit(one_report(step))
            assert wait_until(functools.partial(_settled, sink, step)), step
        assert pusher.is_alive()
        sink.close(timeout=1)
    assert sink.sent == 3 and sink.dropped == 0 and len(arrivals) >= 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
