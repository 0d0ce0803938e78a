"""Fixtures for the server tests: clean environment, report builders, real servers."""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from guard_server import EmbeddedServer, Settings, create_app
from guard_server.testing import prometheus_binary, run_prometheus

WIRE_DOC = Path(__file__).resolve().parents[2] / "docs" / "wire.md"

MakeBatch = Callable[..., dict[str, Any]]


class FakeClock:
    """An injectable clock: unix seconds that move only when told."""

    def __init__(self, now: float = 1_764_424_800.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings read the environment; a developer's GUARD_TOKEN must not change test outcomes.
    for name in list(os.environ):
        if name.upper().startswith("GUARD_SERVER_") or name.upper() == "GUARD_TOKEN":
            monkeypatch.delenv(name)


@pytest.fixture
def wire_example() -> dict[str, Any]:
    """The example batch of docs/wire.md, parsed (the doc is the contract)."""
    block = re.search(r"```json\n(.*?)```", WIRE_DOC.read_text(), re.S)
    assert block is not None, "docs/wire.md lost its JSON example"
    example: dict[str, Any] = json.loads(block.group(1))
    return example


@pytest.fixture
def make_batch(wire_example: dict[str, Any]) -> MakeBatch:
    """Build a valid batch dict: make_batch(run_id, rank, steps=(1,), **report_fields)."""

    def build(
        run_id: str = "run-1", rank: int = 0, steps: tuple[int, ...] = (1,), **fields: Any
    ) -> dict[str, Any]:
        template = wire_example["reports"][0]
        reports = []
        for step in steps:
            report = copy.deepcopy(template) | {"step": step, "events": []} | fields
            reports.append(report)
        return {"run_id": run_id, "rank": rank, "reports": reports}

    return build


@pytest.fixture
def clock() -> FakeClock:
    """A fresh fake clock per test."""
    return FakeClock()


@pytest.fixture
def client() -> Iterator[TestClient]:
    """A TestClient over a fresh app with default settings and no token (lifespan run)."""
    with TestClient(create_app(Settings())) as test_client:
        yield test_client


@pytest.fixture
def live_server() -> Iterator[EmbeddedServer]:
    """A real uvicorn serving a fresh app on a free loopback port."""
    with EmbeddedServer(port=0, settings=Settings(port=0)) as server:
        yield server


@pytest.fixture
def prometheus() -> Callable[..., Any]:
    """`run_prometheus` (guard_server.testing), or a skip when the binary is absent."""
    if prometheus_binary() is None:
        pytest.skip("prometheus binary not installed (Debian package prometheus; bootstrap --dev)")
    return run_prometheus
