"""What the sink tests share: a short guarded run, a wait with a deadline, and a raw HTTP
server whose every answer the test writes."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import guard
from guard.step.record import Record
from guard_server.wire import ReportBatch
from tests.conftest import batch, policy
from tests.guard.readings import values


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def serving(mass: str = "warn", **export: object) -> dict[str, object]:
    p = policy(padding_mass={"action": mass})
    p["export"] = {"serve": None, **export}
    p["run_id"] = "sink-test"
    return p


def train_steps(g: guard.Guard, model: torch.nn.Module, n: int) -> None:
    for i in range(n):
        _, loss = model(*batch(seed=i))
        loss.backward()
        g.step(loss)


def one_report(step: int = 1, *, final: bool = False, run_id: str = "r",
               rank: int = 0) -> ReportBatch:
    """A one-report batch as a guard sends it, from the library's own record."""
    record = Record(run_id, rank, {"real": 100, "rows": 128, "aligned": 128}, {})
    record.update(values(), step)
    return ReportBatch(run_id=run_id, rank=rank, reports=[record.report(final=final)])


# Given the request number (from 1), what the server does with the connection.
Answer = Callable[[int, socket.socket], None]


def _read_request(conn: socket.socket) -> None:
    """Read one request's head and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := conn.recv(65536)):
        body += chunk


@contextmanager
def raw_server(answer: Answer) -> Iterator[tuple[str, list[float]]]:
    """An HTTP server of one socket per request; yields its URL and the arrival times."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()
    arrivals: list[float] = []

    def handle(conn: socket.socket, n: int) -> None:
        with conn:
            conn.settimeout(5)
            try:
                _read_request(conn)
                arrivals.append(time.monotonic())
                answer(n, conn)
            except OSError:
                pass  # the client gave up: what the trickle test wants

    def serve() -> None:
        n = 0
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            n += 1
            threading.Thread(target=handle, args=(conn, n), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", arrivals
    finally:
        stop.set()
        thread.join(5)
        listener.close()
