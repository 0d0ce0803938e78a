"""The server against careless and hostile clients, over real sockets to a real uvicorn:
cross-site simple POSTs, reads without the token, stalled, slow and vanishing clients, a
flood of connections, a forger ratcheting a step, bodies past the in-flight limit, reads and
scrapes at the caps. Each test is bounded in time and uses loopback only."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard_server import CapacityError, EmbeddedServer, ReportBatch, Settings, Store
from guard_server.families import MAX_SERIES_PER_RANK
from guard_server.limits import Turns
from guard_server.responses import RunDetail
from guard_server.routes.runs import MAX_PAGE_BYTES
from guard_server.settings import WAITING_PER_SLOT
from guard_server.testing import self_signed
from guard_server.wire import ACTIONS, CHECKS, MAX_COUNT
from tests.server.helpers import closed_by_peer, split_ingest_counters

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[EmbeddedServer]:
    """A real uvicorn; `@pytest.mark.parametrize("server", [{...}], indirect=True)` sets it up."""
    values: dict[str, Any] = {"port": 0, "read_timeout_s": 1.0, **getattr(request, "param", {})}
    with EmbeddedServer(port=0, settings=Settings(**values)) as running:
        yield running


def _address(server: EmbeddedServer) -> tuple[str, int]:
    return server.host, server.port


def _rejected(server: EmbeddedServer) -> dict[str, float]:
    return split_ingest_counters(httpx.get(f"{server.url}/metrics").text)[1]


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


def test_cross_site_simple_posts_store_nothing(
    server: EmbeddedServer, make_batch: Any
) -> None:
    # What any web page can make a browser send to 127.0.0.1:9400 without a CORS preflight.
    body = json.dumps(make_batch())
    forms = {
        "text/plain": body,
        "application/x-www-form-urlencoded": "x=" + body,
        "multipart/form-data; boundary=b": f"--b\r\nContent-Disposition: form-data; "
        f'name="x"\r\n\r\n{body}\r\n--b--\r\n',
    }
    for content_type, content in forms.items():
        reply = httpx.post(f"{server.url}/v1/reports", content=content,
                           headers={"Content-Type": content_type, "Origin": "https://evil.test"})
        assert reply.status_code == 415, content_type
    assert server.store.size() == (0, 0)
    assert _rejected(server)["not_json"] == 3
    assert httpx.post(f"{server.url}/v1/reports", content=body, headers=JSON).status_code == 202


def test_the_trainers_endpoint_takes_no_reports(make_batch: Any) -> None:
    with EmbeddedServer.for_trainer(port=0) as endpoint:
        reply = httpx.post(f"{endpoint.url}/v1/reports", json=make_batch())
        assert reply.status_code in (404, 405)
        assert endpoint.store.size() == (0, 0)
        assert httpx.get(f"{endpoint.url}/metrics").status_code == 200
        assert "/v1/reports" not in httpx.get(f"{endpoint.url}/openapi.json").text


@pytest.mark.parametrize("server", [{"token": TOKEN}], indirect=True)
def test_with_a_token_reads_need_it_too(server: EmbeddedServer, make_batch: Any) -> None:
    url = server.url
    assert httpx.post(f"{url}/v1/reports", json=make_batch(), headers=AUTH).status_code == 202
    for path in ("/v1/runs", "/v1/runs/run-1", "/docs", "/redoc", "/openapi.json"):
        reply = httpx.get(f"{url}{path}")
        assert reply.status_code == 401, path
        assert reply.headers["www-authenticate"] == "Bearer"
        assert "run-1" not in reply.text
        assert httpx.get(f"{url}{path}", headers=AUTH).status_code == 200, path
    assert httpx.get(f"{url}/v1/runs", headers={"Authorization": "Bearer nope"}).status_code == 401
    # /metrics stays open unless asked (GUARD_SERVER_METRICS_TOKEN); probes always are.
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/healthz").status_code == 200


@pytest.mark.parametrize("server", [{"token": TOKEN, "metrics_token": True}], indirect=True)
def test_metrics_behind_the_token_when_asked(server: EmbeddedServer) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/metrics", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "server", [{"max_connections": 16, "read_timeout_s": 1.0}], indirect=True
)
def test_stalled_connections_are_capped_and_timed_out(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    stalled = [socket.create_connection(_address(server)) for _ in range(48)]
    try:
        # Past the cap, connections are closed at once; the rest when their head is late.
        closed_at_once = sum(closed_by_peer(s, 0.3) for s in stalled)
        assert closed_at_once >= 48 - 16
        assert all(closed_by_peer(s, 30.0) for s in stalled)
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
    finally:
        for s in stalled:
            s.close()
    _no_tracebacks(caplog)
    warnings = [r.getMessage() for r in caplog.records if r.name == "guard_server"]
    assert any("GUARD_SERVER_MAX_CONNECTIONS=16" in w for w in warnings)


def test_a_partial_head_is_timed_out(server: EmbeddedServer) -> None:
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        assert closed_by_peer(sock, 30.0)


def test_a_slow_body_gets_408_and_is_counted(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 1000\r\n\r\n{\"run_id\": ")
        sock.settimeout(5.0)
        assert sock.recv(4096).startswith(b"HTTP/1.1 408")
    assert _rejected(server)["timeout"] == 1 and server.store.size() == (0, 0)
    _no_tracebacks(caplog)


def test_a_client_leaving_mid_body_is_counted_quietly(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(3):
        with socket.create_connection(_address(server)) as sock:
            sock.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"run_id\": ")
            time.sleep(0.1)
    deadline = time.monotonic() + 5
    while _rejected(server)["disconnected"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rejected(server)["disconnected"] == 3 and server.store.size() == (0, 0)
    _no_tracebacks(caplog)


@pytest.mark.parametrize("server", [{"max_runs": 1}], indirect=True)
def test_429_says_when_to_retry(server: EmbeddedServer, make_batch: Any) -> None:
    assert httpx.post(f"{server.url}/v1/reports", json=make_batch("a")).status_code == 202
    reply = httpx.post(f"{server.url}/v1/reports", json=make_batch("b"))
    assert reply.status_code == 429 and int(reply.headers["retry-after"]) > 0


def test_run_state_is_paged(server: EmbeddedServer, make_batch: Any) -> None:
    with httpx.Client(base_url=server.url) as client:  # one connection for the 250 posts
        for rank in range(250):
            assert client.post("/v1/reports", json=make_batch(rank=rank)).status_code == 202
        ranks, offset = [], 0
        while offset is not None:
            page = client.get("/v1/runs/run-1", params={"offset": offset}).json()
            assert page["total"] == 250 and len(page["ranks"]) <= 100
            ranks += [r["rank"] for r in page["ranks"]]
            offset = page["next_offset"]
        assert ranks == list(range(250))
        too_big = client.get("/v1/runs/run-1", params={"limit": 100_000})
    assert too_big.status_code == 422


def test_tls_is_passed_to_uvicorn(tmp_path: Path, make_batch: Any) -> None:
    if subprocess.run(["which", "openssl"], capture_output=True).returncode != 0:
        pytest.skip("openssl not installed: no certificate to serve")
    cert, key = self_signed(tmp_path)
    settings = Settings(port=0, ssl_certfile=cert, ssl_keyfile=key)
    with EmbeddedServer(port=0, settings=settings) as tls:
        https = f"https://127.0.0.1:{tls.port}"
        trust = ssl.create_default_context(cafile=str(cert))
        reply = httpx.post(f"{https}/v1/reports", json=make_batch(), verify=trust)
        assert reply.status_code == 202
        with pytest.raises(httpx.TransportError):  # plain HTTP to a TLS port
            httpx.get(f"http://127.0.0.1:{tls.port}/healthz", timeout=3)


def test_tls_settings_name_the_missing_half(tmp_path: Path) -> None:
    from guard_server import SettingsError

    with pytest.raises(SettingsError) as info:
        Settings(ssl_certfile=tmp_path / "nope.pem")
    assert "GUARD_SERVER_SSL_KEYFILE" in info.value.problems
    (tmp_path / "k.pem").write_text("x")
    with pytest.raises(SettingsError) as info:
        Settings(ssl_certfile=tmp_path / "nope.pem", ssl_keyfile=tmp_path / "k.pem")
    assert "does not exist" in info.value.problems["GUARD_SERVER_SSL_CERTFILE"]


def test_a_forger_cannot_ratchet_the_step(make_batch: Any, clock: Any) -> None:
    # The attach_id is readable (GET /v1/runs/{id}); a forger posting +burst again and again
    # must not move the step faster than the bound over the whole window, not just per post:
    # STEP_BURST at once, then MAX_STEP_RATE a second of the store's clock (frozen here, so
    # no wall time enters the test).
    settings = Settings(port=0, step_burst=100, max_step_rate=20.0, log_level="warning")
    with EmbeddedServer(port=0, settings=settings, store=Store(settings, clock=clock)) as server:
        url = f"{server.url}/v1/reports"
        assert httpx.post(url, json=make_batch(steps=(6,))).status_code == 202
        run = f"{server.url}/v1/runs/run-1"
        attach = httpx.get(run).json()["ranks"][0]["latest"]["attach_id"]
        with httpx.Client(timeout=30) as client:

            def forge(step: int) -> int:
                batch = make_batch(steps=(step,), attach_id=attach)
                return client.post(url, json=batch).status_code

            codes = [forge(6 + 100 * i) for i in range(1, 61)]
            assert codes == [202] + [409] * 59
            assert httpx.get(run).json()["ranks"][0]["step"] == 106  # the burst, once
            clock.advance(5.0)  # 5 s at 20 steps a second: room for one more +100
            assert (forge(206), forge(306)) == (202, 409)
        assert httpx.get(run).json()["ranks"][0]["step"] == 206
        assert _rejected(server)["implausible_step"] == 59 + 1


def test_a_page_of_run_state_is_bounded_in_bytes(
    server: EmbeddedServer, make_batch: Any, wire_example: Any
) -> None:
    # Ranks at the wire's limits: ~0.5 MiB of JSON each, so 1000 a page would be ~0.5 GiB.
    event = wire_example["reports"][0]["events"][0]
    heavy = [event | {"message": "\U0001f600" * 4096, "module": "m" * 256}] * 32
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for rank in range(24):
            body = json.dumps(make_batch(rank=rank, events=heavy), ensure_ascii=False)
            assert client.post("/v1/reports", content=body, headers=JSON).status_code == 202
        ranks, offset, pages = [], 0, 0
        while offset is not None:
            reply = client.get("/v1/runs/run-1", params={"offset": offset, "limit": 1000})
            assert reply.status_code == 200 and len(reply.content) <= MAX_PAGE_BYTES
            page = RunDetail.model_validate_json(reply.content)
            assert page.total == 24 and page.ranks and page.limit == 1000
            ranks += [r.rank for r in page.ranks]
            assert all(len(r.recent_events) == 32 for r in page.ranks)
            offset, pages = page.next_offset, pages + 1
    assert ranks == list(range(24)) and pages >= 3


@pytest.mark.slow
def test_a_scrape_at_the_caps_holds_at_most_max_series(make_batch: Any) -> None:
    # Ranks that cost a scrape the most: every check with every action, a halt, every optional
    # value, a 128-character run_id and counts at 2**53; fed in-process until a cap says no.
    # GUARD_SERVER_MAX_SERIES is what keeps this scrape inside Prometheus' default 10 s
    # scrape_timeout; how long it takes is bench/ingest.py's "worst case" row
    # (docs/benchmarks.md), never a test's: a busy machine makes any duration.
    settings = Settings(port=0, log_level="warning")
    every = {check: dict.fromkeys(ACTIONS, MAX_COUNT) for check in CHECKS}
    worst = make_batch(steps=(MAX_COUNT,), violations=every, halted="nonfinite",
                       skipped_steps=MAX_COUNT, dropped_reports=MAX_COUNT)
    refused: CapacityError | None = None
    with EmbeddedServer(port=0, settings=settings) as server:
        try:
            for n in range(settings.max_ranks):
                run_id = f"r{n // settings.max_ranks_per_run:03d}".ljust(128, "x")
                report = worst["reports"][0] | {"attach_id": uuid.uuid4().hex}
                server.store.ingest(ReportBatch.model_validate(
                    {"run_id": run_id, "rank": n % settings.max_ranks_per_run,
                     "reports": [report]}))
        except CapacityError as exc:
            refused = exc
        held = server.store.size()[1]
        accept = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"}
        reply = httpx.get(f"{server.url}/metrics", headers=accept, timeout=600)
    assert refused is not None and refused.scope == "series"  # the series cap, not the ranks'
    assert reply.status_code == 200
    series = sum(line.startswith("guard_") for line in reply.text.splitlines())
    # Every rank held is on the page, and the page stays within the cap (plus the server's
    # own families, a few dozen).
    assert series >= held * MAX_SERIES_PER_RANK
    assert series <= settings.max_series + 64


def _slow_post(server: EmbeddedServer, body: bytes, sent: int) -> socket.socket:
    # A POST whose body stops after `sent` bytes, until the caller sends the rest.
    sock = socket.create_connection(_address(server))
    sock.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:sent]))
    return sock


def _reply(sock: socket.socket, within_s: float) -> bytes:
    # One whole response (head and Content-Length body), or what came before the deadline.
    deadline, data = time.monotonic() + within_s, b""
    while (left := deadline - time.monotonic()) > 0:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head.lower())
        if length is not None and len(rest) >= int(length.group(1)):
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("server", [{"max_inflight_bodies": 1, "read_timeout_s": 2.0}],
                         indirect=True)
def test_bodies_past_the_inflight_limit_wait_their_turn_or_get_429(
    server: EmbeddedServer, make_batch: Any
) -> None:
    body = json.dumps(make_batch()).encode()
    with contextlib.ExitStack() as open_sockets:

        def post(sent: int) -> socket.socket:
            return open_sockets.enter_context(_slow_post(server, body, sent))

        # One body read at a time, one waiting: a waiter has its turn when the reader is done.
        reading = post(10)
        time.sleep(0.1)
        waiting = post(len(body))
        time.sleep(0.1)
        reading.sendall(body[10:])
        assert _reply(reading, 30.0).startswith(b"HTTP/1.1 202")
        assert _reply(waiting, 30.0).startswith(b"HTTP/1.1 202")
        # While one stalls (until its read timeout, 2 s), WAITING_PER_SLOT (8) wait their turn
        # (1 s at most) and get a 429 that says when to retry; the stalled one a 408.
        stalled = post(10)
        time.sleep(0.1)
        waiters = [post(len(body)) for _ in range(WAITING_PER_SLOT)]
        for waiting in waiters:
            late = _reply(waiting, 30.0)
            assert late.startswith(b"HTTP/1.1 429") and b"retry-after: 2" in late.lower()
            assert b"GUARD_SERVER_MAX_INFLIGHT_BODIES" in late
        assert _reply(stalled, 30.0).startswith(b"HTTP/1.1 408")
    assert httpx.post(f"{server.url}/v1/reports", json=make_batch(steps=(2,))).status_code == 202
    rejected = _rejected(server)
    assert (rejected["busy"], rejected["timeout"]) == (WAITING_PER_SLOT, 1)


@pytest.mark.parametrize("server", [{"max_inflight_bodies": 1, "read_timeout_s": 600.0}],
                         indirect=True)
def test_past_the_waiting_room_a_body_is_refused_before_the_waiters_are_answered(
    server: EmbeddedServer, make_batch: Any
) -> None:
    # The waiters wait as long as the stalled body holds the slot (no timer can answer them
    # first, however busy the machine), so the order of the answers says what a clock would.
    server.app.state.body_slots = Turns(1, wait_s=600.0)
    body = json.dumps(make_batch()).encode()
    with contextlib.ExitStack() as open_sockets:

        def post(sent: int) -> socket.socket:
            return open_sockets.enter_context(_slow_post(server, body, sent))

        stalled = post(10)
        assert _waits_in_line(server, 0)  # the stalled one holds the slot
        waiters = [post(len(body)) for _ in range(WAITING_PER_SLOT)]
        assert _waits_in_line(server, WAITING_PER_SLOT)
        refused = _reply(post(len(body)), 30.0)
        assert refused.startswith(b"HTTP/1.1 429") and b"retry-after: 2" in refused.lower()
        assert not any(_answered(waiting) for waiting in waiters)  # still in line
        stalled.sendall(body[10:])
        assert _reply(stalled, 30.0).startswith(b"HTTP/1.1 202")
        for waiting in waiters:  # each in its turn
            assert _reply(waiting, 30.0).startswith(b"HTTP/1.1 202")
    assert _rejected(server)["busy"] == 1


def _waits_in_line(server: EmbeddedServer, n: int) -> bool:
    # Until n bodies wait for the slot (and one holds it), within a deadline for a busy machine.
    slots: Turns = server.app.state.body_slots
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if slots.waiting == n and slots.taken:
            return True
        time.sleep(0.01)
    return False


def _answered(sock: socket.socket) -> bool:
    # Whether any byte of an answer has arrived, without waiting for one.
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)