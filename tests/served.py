"""A real server process for the tests that run one as a user does (`guard serve ...`): started,
waited for on /healthz, always stopped."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from guard_server.testing import free_port


@contextmanager
def guard_serve(args: list[str], env: dict[str, str], log: Path,
                timeout_s: float = 30.0) -> Iterator[str]:
    """`guard serve ARGS`, `{port}` in ARGS replaced by a free port; its loopback URL once it
    answers (its output in `log`, quoted when it does not start)."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "guard"), "serve",
               *(a.replace("{port}", str(port)) for a in args)]
    with log.open("wb") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, log, timeout_s)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path,
                 timeout_s: float) -> None:
    """Until `url`'s /healthz answers 200; the server's log in the failure when `process`
    exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
