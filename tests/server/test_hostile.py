"""The server against careless and hostile clients, over real sockets to a real uvicorn:
cross-site simple POSTs, reads without the token, stalled, slow and vanishing clients, a
flood of connections. Each test is bounded in time and uses loopback only."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer, Settings
from tests.server.helpers import split_ingest_counters

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


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    # recv returns b"" (or resets) once the server has closed its end.
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


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
        closed_at_once = sum(_closed_by_server(s, 0.3) for s in stalled)
        assert closed_at_once >= 48 - 16
        assert all(_closed_by_server(s, 3.0) for s in stalled)
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
        assert _closed_by_server(sock, 3.0)


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
    for rank in range(250):
        assert httpx.post(f"{server.url}/v1/reports", json=make_batch(rank=rank)).status_code == 202
    ranks, offset = [], 0
    while offset is not None:
        page = httpx.get(f"{server.url}/v1/runs/run-1", params={"offset": offset}).json()
        assert page["total"] == 250 and len(page["ranks"]) <= 100
        ranks += [r["rank"] for r in page["ranks"]]
        offset = page["next_offset"]
    assert ranks == list(range(250))
    too_big = httpx.get(f"{server.url}/v1/runs/run-1", params={"limit": 100_000})
    assert too_big.status_code == 422


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def test_tls_is_passed_to_uvicorn(tmp_path: Path, make_batch: Any) -> None:
    if subprocess.run(["which", "openssl"], capture_output=True).returncode != 0:
        pytest.skip("openssl not installed: no certificate to serve")
    cert, key = _self_signed(tmp_path)
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
