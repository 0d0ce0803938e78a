"""The real HTTP path: uvicorn on a loopback port, and `python -m guard_server`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer, Settings
from guard_server.testing import free_port
from tests.server.helpers import split_ingest_counters

LIMIT = 64 * 1024
AUTH = {"Authorization": "Bearer t0ken"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def small_server() -> Iterator[EmbeddedServer]:
    """A live server with a token and a 64 KiB body limit."""
    settings = Settings(port=0, token="t0ken", max_body_bytes=LIMIT)
    with EmbeddedServer(port=0, settings=settings) as server:
        yield server


def _chunks(total: int, size: int = 16 * 1024) -> Iterator[bytes]:
    # A generator body makes httpx send Transfer-Encoding: chunked, with no Content-Length.
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_oversize_bodies_are_refused(
    small_server: EmbeddedServer, make_batch: Any, framing: str
) -> None:
    body: Any = b" " * (LIMIT + 1) if framing == "content-length" else _chunks(LIMIT + 1)
    assert small_server.url is not None
    with httpx.Client(base_url=small_server.url, headers=AUTH, timeout=10) as client:
        assert client.post("/v1/reports", json=make_batch()).status_code == 202
        before, rejected = split_ingest_counters(client.get("/metrics").text)
        reply = client.post("/v1/reports", content=body, headers=JSON)
        assert reply.status_code == 413
        assert "65536 bytes" in reply.json()["detail"]
        after, rejected_after = split_ingest_counters(client.get("/metrics").text)
    assert after == before
    assert rejected_after == rejected | {"too_large": 1}


def test_a_chunked_body_under_the_limit_is_read_whole(
    small_server: EmbeddedServer, make_batch: Any
) -> None:
    body = json.dumps(make_batch(steps=tuple(range(20)))).encode()
    assert len(body) < LIMIT

    def chunks() -> Iterator[bytes]:
        yield from (body[i : i + 100] for i in range(0, len(body), 100))

    reply = httpx.post(
        f"{small_server.url}/v1/reports",
        content=chunks(),
        headers=AUTH | JSON,
    )
    assert (reply.status_code, reply.json()) == (202, {"accepted": 20})


def test_token_over_http(small_server: EmbeddedServer, make_batch: Any) -> None:
    url = f"{small_server.url}/v1/reports"
    assert httpx.post(url, json=make_batch()).status_code == 401
    assert httpx.post(url, json=make_batch(), headers=AUTH).status_code == 202


def _wait_healthy(url: str, process: subprocess.Popen[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s} s")


def test_python_m_guard_server_serves_until_sigterm(make_batch: Any) -> None:
    port = free_port()
    env = os.environ | {"GUARD_TOKEN": "t0ken"}
    process = subprocess.Popen(
        [sys.executable, "-m", "guard_server", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, process)
        assert httpx.post(f"{url}/v1/reports", json=make_batch(), headers=AUTH).status_code == 202
        assert 'guard_step{rank="0",run_id="run-1"} 1.0' in httpx.get(f"{url}/metrics").text
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells.
        assert process.wait(timeout=10) == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate()
    assert "Finished server process" in stderr


def test_python_m_guard_server_names_a_bad_variable() -> None:
    env = os.environ | {"GUARD_SERVER_MAX_RUNS": "lots"}
    out = subprocess.run(
        [sys.executable, "-m", "guard_server"], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
    assert "GUARD_SERVER_MAX_RUNS" in out.stderr and "'lots'" in out.stderr
