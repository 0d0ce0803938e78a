"""Plain helpers shared by the server tests (fixtures live in conftest.py)."""

from __future__ import annotations

import socket


def split_ingest_counters(text: str) -> tuple[str, dict[str, float]]:
    """A /metrics text without the ingest counters' samples, and the rejects by reason."""
    kept = "".join(line for line in text.splitlines(True) if not line.startswith("guard_ingest_"))
    rejected = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("guard_ingest_rejected_total{")
    }
    return kept, rejected


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the other end closed `sock` within `within_s`: recv returns b"" (or resets)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
