"""The fleet of rank endpoints (fleet.py) bounds what it holds open: connections per endpoint,
idle connections, and in a child process the descriptors themselves."""

from __future__ import annotations

import re
import resource
import socket
from pathlib import Path

import httpx

from tests.dashboards.fleet import Render, files_bound, fleet_process, serve_fleet
from tests.server.helpers import closed_by_peer


def _scrape(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(30)
    return sock.recv(65536)


def test_a_new_connection_past_the_cap_closes_the_oldest() -> None:
    with serve_fleet(2, lambda i, n, now: f"rank {i} scrape {n}\n".encode(),
                     max_connections=2, idle_s=600) as targets:
        host, port = targets[0].split(":")
        first, second, third = (socket.create_connection((host, int(port))) for _ in range(3))
        with first, second, third:
            assert _scrape(third).endswith(b"rank 0 scrape 1\n")  # handled: the cap applied
            assert closed_by_peer(first, within_s=30)  # what a timed-out scraper left behind
            assert _scrape(second).endswith(b"rank 0 scrape 2\n")


def test_an_idle_connection_isclosed_by_peer() -> None:
    with serve_fleet(1, lambda i, n, now: b"x\n", idle_s=0.2) as targets:
        host, port = targets[0].split(":")
        with socket.create_connection((host, int(port))) as idle:
            assert closed_by_peer(idle, within_s=30)


def plain() -> Render:
    """A scenario for fleet_process: every rank serves one line."""
    return lambda rank, scrape, now: f"rank {rank} scrape {scrape}\n".encode()


def test_a_fleet_process_holds_its_sockets_under_a_limit_of_its_own() -> None:
    with fleet_process(3, "tests.dashboards.test_fleet:plain", max_connections=2) as fleet:
        limits = Path(f"/proc/{fleet.process.pid}/limits").read_text()
        found = re.search(r"^Max open files\s+(\d+)\s+(\d+|unlimited)", limits, re.M)
        assert found is not None
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        assert int(found.group(1)) == min(files_bound(3, 2), hard)  # the child's, not ours
        reply = httpx.get(f"http://{fleet.targets[2]}/metrics", timeout=30)
        assert reply.text == "rank 2 scrape 1\n"
        assert 3 <= fleet.open_sockets() <= 3 * (1 + 2)
    assert fleet.process.returncode == 0  # stopped when the context closed its stdin
