"""A real Prometheus scrapes a real guard server and answers queries for the pushed ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer


@pytest.mark.prometheus
def test_prometheus_scrapes_pushed_reports(
    live_server: EmbeddedServer, prometheus: Callable[..., Any], make_batch: Any
) -> None:
    for rank in (0, 1):
        batch = make_batch("prom-e2e", rank, steps=(10 + rank,), padding_mass=0.25)
        assert httpx.post(f"{live_server.url}/v1/reports", json=batch).status_code == 202
    with prometheus([live_server.url]) as prom:
        step = prom.wait_for('guard_step{run_id="prom-e2e", rank="1"}', timeout_s=30)
        mass = prom.wait_for('guard_padding_mass_ratio{run_id="prom-e2e", rank="0"}', timeout_s=30)
        up = prom.wait_for('up{job="guard"}', timeout_s=30)
    assert step[0]["value"][1] == "11"
    assert mass[0]["value"][1] == "0.25"
    assert up[0]["value"][1] == "1"
    assert prom.process.poll() is not None  # stopped on leaving the block
