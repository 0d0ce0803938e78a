"""Plain helpers shared by the server tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from guard_server.testing import free_port
from tests.served import wait_healthy


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


def proc_status(pid: int, field: str) -> int:
    """A memory figure of /proc/<pid>/status in bytes: VmRSS now, VmHWM its peak so far."""
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match is not None, field
    return int(match.group(1)) << 10


def cpu_seconds(pid: int) -> float:
    """The CPU time the process has used, user and system (what a wall clock cannot say on a
    busy machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def server_subprocess(tmp_path: Path, env: dict[str, str],
                   budget: int) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A real `python -m guard_server` with a byte budget and `env` on top; its URL, process and
    log file."""
    port = free_port()
    log = tmp_path / "server.log"
    env = os.environ | {"GUARD_SERVER_MAX_BYTES": str(budget),
                        "GUARD_SERVER_LOG_LEVEL": "info", **env}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "guard_server", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log, 20)
        yield url, process, log
    finally:
        process.terminate()
        process.wait(timeout=10)
