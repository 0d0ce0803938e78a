"""The whole battery against one real `python -m guard_server` process: cross-site POSTs, a
forged step, a byte-budget flood, stalled, slow and vanishing clients, a restart; then a flood
of bodies in flight. After each: no 5xx, no traceback in the server's log, resident memory
grown within the byte budget, `promtool check metrics` clean, valid data still accepted."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard_server.families import MAX_SERIES_PER_RANK
from guard_server.wire import ACTIONS, CHECKS, MAX_COUNT
from tests.server.helpers import proc_status, server_subprocess

# 29 MiB of it kept for bodies in flight, 7 MiB for one scrape (the default caps), 4 MiB for
# one read (a page being answered), 4 MiB of state.
BUDGET = 44 << 20
ONE_SCRAPE = {"GUARD_SERVER_MAX_INFLIGHT_SCRAPES": "1", "GUARD_SERVER_MAX_INFLIGHT_READS": "1"}
JSON = {"Content-Type": "application/json"}
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"


def _rss_bytes(pid: int) -> int:
    return proc_status(pid, "VmRSS")


@contextlib.contextmanager
def _server(
    tmp_path: Path, env: dict[str, str], budget: int = BUDGET
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A real `python -m guard_server` with a byte budget and `env` on top; its log file."""
    with server_subprocess(tmp_path, env, budget) as running:
        yield running


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    env = {"GUARD_SERVER_READ_TIMEOUT_S": "1", "GUARD_SERVER_MAX_CONNECTIONS": "64", **ONE_SCRAPE}
    with _server(tmp_path, env) as running:
        yield running


def _promtool_clean(metrics: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is not None:
        check = subprocess.run([promtool, "check", "metrics"], input=metrics, text=True,
                               capture_output=True, timeout=30)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def _raw(url: str, data: bytes, *, close_after_s: float = 0.0) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(data)
        time.sleep(close_after_s)


def test_the_battery_leaves_the_server_whole(
    server_process: tuple[str, subprocess.Popen[bytes], Path], make_batch: Any,
    wire_example: Any,
) -> None:
    url, process, log = server_process
    statuses: list[int] = []

    def post(body: dict[str, Any] | str | bytes, headers: dict[str, str] | None = None) -> int:
        content = body if isinstance(body, str | bytes) else json.dumps(body, ensure_ascii=False)
        reply = httpx.post(f"{url}/v1/reports", content=content, headers=headers or JSON,
                           timeout=30)
        statuses.append(reply.status_code)
        return reply.status_code

    assert post(make_batch("before", 0, steps=(5,))) == 202
    assert post(make_batch("restarted", 0, steps=(300,), attach_id="first-attach")) == 202
    rss_before = _rss_bytes(process.pid)

    # Cross-site "simple" POSTs, and a forged step.
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        assert post(json.dumps(make_batch("xsite")), {"Content-Type": kind}) == 415
    assert post(make_batch("before", 0, steps=(2**53,))) == 409
    # A flood of ranks, each at the wire's limits, until the budget says no.
    event = wire_example["reports"][0]["events"][0]
    heavy = [event | {"message": "\U0001f600" * 4000, "module": "m" * 256}] * 32
    codes = [post(make_batch("flood", rank, events=heavy)) for rank in range(120)]
    assert codes.count(429) > 0 and set(codes) <= {202, 429}
    # Stalled connections past the limit, a slow body, clients leaving mid-body.
    host, port = url.removeprefix("http://").split(":")
    stalled = [socket.create_connection((host, int(port))) for _ in range(200)]
    head = (b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n{\"run_id\":")
    for _ in range(20):
        _raw(url, head, close_after_s=0.01)
    time.sleep(2.5)  # past the read timeout: the stalled ones are closed
    for sock in stalled:
        sock.close()
    # The restart: a new attach of the same run and rank halts at step 6.
    restart = make_batch("restarted", 0, steps=(6,), attach_id="second-attach", halted="nonfinite")
    assert post(restart) == 202
    assert post(make_batch("after", 0, steps=(7,))) == 202

    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'guard_step{rank="0",run_id="before"} 5.0' in metrics
    assert 'guard_step{rank="0",run_id="after"} 7.0' in metrics
    assert 'guard_halted{check="nonfinite",rank="0",run_id="restarted"} 1.0' in metrics
    assert 'guard_step{rank="0",run_id="restarted"} 6.0' in metrics
    assert "xsite" not in metrics
    assert 'guard_ingest_rejected_total{reason="over_budget"}' in metrics
    assert not [s for s in statuses if s >= 500]
    grown = _rss_bytes(process.pid) - rss_before
    assert grown <= BUDGET, f"resident memory grew {grown >> 20} MiB, budget {BUDGET >> 20} MiB"
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    _promtool_clean(metrics)


def test_bodies_in_flight_stay_within_the_budget(tmp_path: Path, make_batch: Any) -> None:
    # 150 clients send their heads, then all but the last byte of a 1 MiB body each: were
    # every body read, the server would hold ~150 MiB under its 44 MiB budget.
    size, clients = 1 << 20, 150
    head = (b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size)
    env = {"GUARD_SERVER_READ_TIMEOUT_S": "3", **ONE_SCRAPE}
    with _server(tmp_path, env) as (url, process, log):
        host, port = url.removeprefix("http://").split(":")
        rss_before = _rss_bytes(process.pid)
        with contextlib.ExitStack() as open_sockets:
            socks = [open_sockets.enter_context(socket.create_connection((host, int(port))))
                     for _ in range(clients)]
            for sock in socks:
                sock.sendall(head)
            peak = 0
            for sock in socks:
                sock.settimeout(0.5)
                with contextlib.suppress(OSError):  # a body the server is not reading yet
                    sock.sendall(b" " * (size - 1))
                peak = max(peak, _rss_bytes(process.pid))
            time.sleep(0.5)
            grown = max(peak, _rss_bytes(process.pid)) - rss_before
            assert grown <= BUDGET, f"resident memory grew {grown >> 20} MiB, budget 44 MiB"
            busy = 0
            for sock in socks:
                sock.settimeout(0.1)
                with contextlib.suppress(OSError):
                    reply = sock.recv(4096)
                    busy += reply.startswith(b"HTTP/1.1 429") and b"retry-after" in reply
        assert busy >= clients // 2
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert f'guard_ingest_rejected_total{{reason="busy"}} {float(busy)}' in metrics
        _promtool_clean(metrics)
        body = json.dumps(make_batch("after"))
        assert httpx.post(f"{url}/v1/reports", content=body, headers=JSON).status_code == 202
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]


def test_concurrent_scrapes_at_the_caps_stay_within_the_budget(
    tmp_path: Path, make_batch: Any
) -> None:
    # The costliest ranks until the series cap says no, then 12 scrapes at once: built whole
    # in the thread pool, each held ~30x its text (8 at once grew a server by ~200 MiB under
    # an 8 MiB budget). The defaults of the scrape settings, so that the old tree runs it too.
    # 64 MiB, and 8 for the two reads (pages) the default settings keep room for.
    budget, every = 72 << 20, {check: dict.fromkeys(ACTIONS, MAX_COUNT) for check in CHECKS}
    # 500 of them: the cap counts each rank at its most series (families.MAX_SERIES_PER_RANK).
    env = {"GUARD_SERVER_MAX_RANKS": "1024",
           "GUARD_SERVER_MAX_SERIES": str(500 * MAX_SERIES_PER_RANK)}
    with _server(tmp_path, env, budget) as (url, process, log):
        rss_before = _rss_bytes(process.pid)
        with httpx.Client(base_url=url, timeout=30) as client:
            for rank in range(600):
                batch = make_batch("r".ljust(128, "x"), rank, steps=(MAX_COUNT,),
                                   violations=every, halted="nonfinite",
                                   skipped_steps=MAX_COUNT, dropped_reports=MAX_COUNT)
                if client.post("/v1/reports", json=batch).status_code == 429:
                    break
        assert rank == 500
        peak, bodies, statuses = [0], [], []

        def scrape() -> None:
            reply = httpx.get(f"{url}/metrics", headers={"Accept": OPENMETRICS}, timeout=120)
            statuses.append(reply.status_code)
            bodies.append(reply.content)

        scrapers = [threading.Thread(target=scrape) for _ in range(12)]
        for thread in scrapers:
            thread.start()
        while any(thread.is_alive() for thread in scrapers):
            peak[0] = max(peak[0], _rss_bytes(process.pid))
            time.sleep(0.005)
        _promtool_clean(httpx.get(f"{url}/metrics", timeout=120).text)  # the text format
    grown = peak[0] - rss_before
    assert statuses == [200] * 12 and len(set(bodies)) == 1 and len(bodies[0]) > 6_000_000
    assert grown <= budget, f"resident memory grew {grown >> 20} MiB, budget {budget >> 20} MiB"
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
