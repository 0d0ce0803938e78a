"""Connections over real sockets to a real uvicorn: a request framed two ways (Content-Length
and Transfer-Encoding: chunked, the shape of request smuggling) is answered and its connection
closed, so nothing hidden behind it runs; a request answered before its body came (a 401 to a
client trickling it) closes its connection at once."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer, Settings
from tests.server.helpers import split_ingest_counters


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A real uvicorn with a token and the default timeouts (10 s for a request's head)."""
    with EmbeddedServer(port=0, settings=Settings(port=0, token="t0ken")) as running:
        yield running


def _until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """What the server sends within `within_s`, and whether it closed the connection."""
    deadline, data = time.monotonic() + within_s, b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def _post(body: bytes, *, framing: bytes) -> bytes:
    return (b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0ken\r\n"
            b"Content-Type: application/json\r\n%s\r\n%s" % (framing, body))


def _two_ways(chunked: bytes, hidden: bytes) -> bytes:
    """Headers that frame the body by its chunks (h11) and by a length that covers `hidden`
    too (what a proxy in front going by Content-Length forwards as one request)."""
    return (b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n"
            % (len(chunked) + len(hidden)))


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def test_a_request_framed_two_ways_stores_nothing_and_runs_nothing_behind_it(
    server: EmbeddedServer, make_batch: Any
) -> None:
    first = _chunked(json.dumps(make_batch("first")).encode())
    hidden_body = json.dumps(make_batch("smuggled")).encode()
    hidden = _post(hidden_body, framing=b"Content-Length: %d\r\n" % len(hidden_body))
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(_post(first, framing=_two_ways(first, hidden)) + hidden)
        answers, closed = _until_closed(sock, 5.0)
    assert answers.startswith(b"HTTP/1.1 400") and answers.count(b"HTTP/1.1 ") == 1, answers
    assert b"Content-Length and Transfer-Encoding" in answers and closed
    assert server.store.size() == (0, 0)
    text = httpx.get(f"{server.url}/metrics").text
    assert split_ingest_counters(text)[1]["bad_framing"] == 1


def test_the_trainers_endpoint_closes_after_a_request_framed_two_ways() -> None:
    # Reads only, but the same protocol: a GET hiding another GET behind its chunked "body".
    hidden = b"GET /v1/runs HTTP/1.1\r\nHost: x\r\n\r\n"
    body = _chunked(b"x")
    with EmbeddedServer.for_trainer(port=0) as endpoint, \
            socket.create_connection((endpoint.host, endpoint.port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + _two_ways(body, hidden)
                     + b"\r\n" + body + hidden)
        answers, closed = _until_closed(sock, 5.0)
    assert answers.count(b"HTTP/1.1 ") == 1 and b"guard_server_ranks" in answers and closed


def test_a_refusal_before_the_body_closes_a_connection_that_trickles_it(
    server: EmbeddedServer,
) -> None:
    # Without the token the answer is 401 before a byte of the body is read; reading the rest
    # to keep the connection let a client trickling it hold the connection until the read
    # timeout (10 s here), however long its body.
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100000\r\n\r\n{")
        sock.settimeout(5.0)
        assert sock.recv(4096).startswith(b"HTTP/1.1 401")
        closed, started = False, time.monotonic()
        while not closed and time.monotonic() - started < 3.0:
            try:
                sock.sendall(b" ")
            except OSError:
                closed = True
                break
            closed = _until_closed(sock, 0.1)[1]
    assert closed, "the server kept reading a body it had refused"
    assert server.store.size() == (0, 0)
