"""The pages and the answers' headers against what a hostile or careless trainer or client can
send, over a real uvicorn on loopback (issue 41, items 1 and 8): every value the wire takes
draws, bidi controls stay inside their text, no Location from a Host header, every answer
nosniff and uncached, one reading of a repeated Authorization header."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer, Settings
from tests.server.conftest import MakeBatch

MAX = sys.float_info.max
TOKEN = "t0ken"
# (loss, padding mass) of a rank's reports, step after step: the edges of what the wire takes.
EDGES: dict[str, list[tuple[float, float]]] = {
    "zero and the smallest denormal": [(0.0, 0.0), (5e-324, 1.0)],
    "two denormals": [(5e-324, 1.0), (1e-323, 0.0)],
    "equal values": [(2.0, 0.5), (2.0, 0.5), (2.0, 0.5)],
    "the widest span": [(-MAX, 0.0), (MAX, 1.0), (0.0, 0.5)],
    "max float twice": [(MAX, 1.0), (MAX, 1.0)],
    "one point": [(1.0, 0.0)],
}


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[EmbeddedServer]:
    values: dict[str, Any] = {"port": 0, **getattr(request, "param", {})}
    with EmbeddedServer(port=0, settings=Settings(**values)) as running:
        yield running


def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


def test_every_value_the_wire_takes_draws_or_says_why(
        server: EmbeddedServer, make_batch: MakeBatch, caplog: pytest.LogCaptureFixture) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for n, (name, points) in enumerate(EDGES.items()):
            for step, (loss, mass) in enumerate(points, 1):
                batch = make_batch(f"edge-{n}", steps=(step,), loss=loss, padding_mass=mass,
                                   padding_mass_max=mass)
                assert client.post("/v1/reports", json=batch).status_code == 202, name
            page = client.get(f"/runs/edge-{n}")
            assert page.status_code == 200, name
            assert "default-src 'none'" in page.headers["content-security-policy"]
            drawn = page.text.count('<svg class="spark"')
            assert drawn == (0 if len(points) == 1 else 2), name
            if len(points) == 1:
                assert "one report so far: a line needs two" in page.text
        assert client.get("/").status_code == 200
    _quiet(caplog)
