"""The pages against the text trainers may send and the clients that ask for them and never
read, on one real `python -m guard_server` (issue 41, item 3): every page within
GUARD_SERVER_MAX_PAGE_BYTES whatever its text (escaping grows a `"` five-fold), the rest
reachable (the next page, the JSON), and what the server holds for readers that never read
within the room its budget keeps for reads (docs/server.md, "Memory and scrape time"), their
turns back within GUARD_SERVER_WRITE_STALL_S; no 5xx, no traceback."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx

from tests.server.conftest import MakeBatch
from tests.server.helpers import cpu_seconds, proc_status, server_subprocess

JSON = {"Content-Type": "application/json"}
MiB = 1 << 20
RUNS, READERS = 63, 12
# docs/server.md: two reads answered at once, each holding at most 4 MiB (a page's render);
# more wait (a request each), the rest are refused (429). Measured: ~5 MiB.
MAX_GROWTH = 16 * MiB
MAX_CPU_S = 10.0  # the twelve reads and the pages below (measured: ~1.5 s)


def _fill(client: httpx.Client, make_batch: MakeBatch, wire_example: dict[str, object]) -> None:
    # Each run: one rank halted, 32 events of 4,096 quotes and a module of 256 (6x escaped).
    event = wire_example["reports"][0]["events"][0]  # type: ignore[index]
    heavy = [event | {"message": '"' * 4096, "module": '"' * 256, "action": "fail"}] * 32
    for run in range(RUNS):
        batch = make_batch(f"run-{run:02d}", steps=(1,), events=heavy, halted="token_range",
                           grad_norm_top='"' * 256)
        assert client.post("/v1/reports", content=json.dumps(batch), headers=JSON,
                           ).status_code == 202


def _never_reads(url: str, path: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


def _ended(sock: socket.socket, within_s: float) -> bool:
    """Whether the server ends the connection within `within_s` (what it sent, taken now)."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 20):
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


def test_pages_are_bounded_and_slow_readers_count_in_the_budget(
        tmp_path: Path, make_batch: MakeBatch, wire_example: dict[str, object]) -> None:
    env = {"GUARD_SERVER_WRITE_STALL_S": "1"}
    with server_subprocess(tmp_path, env, 256 * MiB) as (url, process, log), \
            httpx.Client(base_url=url, timeout=60) as client:
        _fill(client, make_batch, wire_example)
        bound = 1 * MiB  # GUARD_SERVER_MAX_PAGE_BYTES' default
        runs = client.get("/")
        assert runs.status_code == 200 and len(runs.content) <= bound, len(runs.content)
        assert "more runs not shown" in runs.text and 'href="v1/runs"' in runs.text
        run = client.get("/runs/run-00")
        assert run.status_code == 200 and len(run.content) <= bound, len(run.content)
        rss, cpu = proc_status(process.pid, "VmRSS"), cpu_seconds(process.pid)
        readers = [_never_reads(url, "/") for _ in range(READERS)]
        try:
            time.sleep(3.0)  # each answered in its turn, or refused (429) after 5 s of waiting
            grown = proc_status(process.pid, "VmHWM") - rss
            answered = client.get("/")
            assert answered.status_code in (200, 429), answered.status_code
            deadline = time.monotonic() + 60
            while answered.status_code == 429 and time.monotonic() < deadline:
                time.sleep(0.5)
                answered = client.get("/")
            assert answered.status_code == 200
            assert all(_ended(r, 30) for r in readers)  # each cut, none held forever
        finally:
            for reader in readers:
                reader.close()
        grown = max(grown, proc_status(process.pid, "VmHWM") - rss)
        spent = cpu_seconds(process.pid) - cpu
        assert client.get("/v1/runs").json()["runs"][RUNS - 1]["run_id"] == f"run-{RUNS - 1:02d}"
    assert grown <= MAX_GROWTH, f"grew {grown / MiB:.1f} MiB"
    assert spent <= MAX_CPU_S, f"{spent:.2f} s of CPU"
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
