"""Every dashboard query and alert expression, evaluated by a real Prometheus on loopback.

Prometheus loads the alert rules and scrapes, once a second, either the fault exposition or
a real guard-server that was pushed the same faults (exposition.py); the queries go through
its HTTP API, so a query that does not parse fails with 400.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from guard_server import EmbeddedServer, Settings
from guard_server.testing import Prometheus, prometheus_binary, run_prometheus

from tests.dashboards.conftest import Run
from tests.dashboards.exposition import (
    FIRING,
    FIRING_FROM_BATCHES,
    RUN,
    fault_batches,
    fault_exposition,
    serve_exposition,
)
from tests.dashboards.queries import (
    ALERT_RULES,
    ALL,
    PanelQuery,
    alert_rules,
    dashboard_queries,
    variable_queries,
)

pytestmark = pytest.mark.prometheus

# One run and rank picked in the dashboard's drop-downs, and "All" in both.
SELECTIONS = {"rank0": (RUN, "0"), "all": (ALL, ALL)}
PANEL_QUERIES = [
    pytest.param(name, query, id=f"{name}:{query.title}:{query.ref_id}")
    for name, (run_id, rank) in SELECTIONS.items()
    for query in dashboard_queries(run_id=run_id, rank=rank)
]


@dataclass
class Source:
    """A Prometheus scraping one form of the fault scenario, and who must alert there."""

    prom: Prometheus
    firing: dict[str, set[str]]


def _guard_server(stack: ExitStack) -> str:
    with pytest.MonkeyPatch.context() as env:
        # Defaults only: a developer's GUARD_TOKEN would make the server refuse the pushes.
        for name in os.environ.copy():
            if name.upper().startswith(("GUARD_SERVER_", "GUARD_TOKEN")):
                env.delenv(name)
        settings = Settings(port=0)
    server = stack.enter_context(EmbeddedServer(port=0, settings=settings))
    for batch in fault_batches(time.time()):
        httpx.post(f"{server.url}/v1/reports", json=batch, timeout=5.0).raise_for_status()
    return f"{server.host}:{server.port}"


@pytest.fixture(scope="module", params=["exposition", "guard-server"])
def source(request: pytest.FixtureRequest) -> Iterator[Source]:
    """A real Prometheus that has scraped the scenario at least three times."""
    # Module scope: the tests only read, and each fresh Prometheus costs seconds.
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    with ExitStack() as stack:
        if request.param == "exposition":
            target = stack.enter_context(serve_exposition(fault_exposition))
            firing = FIRING
        else:
            target, firing = _guard_server(stack), FIRING_FROM_BATCHES
        prom = stack.enter_context(
            run_prometheus([target], scrape_interval_s=1.0, rule_files=[ALERT_RULES])
        )
        # Three samples: every rate() / increase() window holds two, and counters have grown.
        prom.wait_for('count_over_time(guard_step{rank="0"}[1m]) >= 3', timeout_s=30)
        yield Source(prom, firing)


def test_fault_exposition_passes_promtool(run: Run) -> None:
    result = run("promtool", "check", "metrics", stdin=fault_exposition(1, 1_764_424_800.0))
    assert result.stdout + result.stderr == "", "promtool's metric lint has findings"


@pytest.mark.parametrize(("selection", "query"), PANEL_QUERIES)
def test_panel_query_returns_series(source: Source, selection: str, query: PanelQuery) -> None:
    result = source.prom.query(query.expr)
    assert result, f"panel {query.title!r} ({query.ref_id}) shows no data: {query.expr}"
    if selection == "rank0":
        ranks = {series["metric"].get("rank") for series in result} - {None}
        assert ranks <= {"0"}, f"panel {query.title!r} ignores the rank variable: {ranks}"


def test_variables_offer_the_run_and_its_ranks(source: Source) -> None:
    offered = {}
    for var in variable_queries(run_id=RUN):
        reply = httpx.get(
            f"{source.prom.url}/api/v1/label/{var.label}/values",
            params={"match[]": var.selector},
            timeout=5.0,
        )
        reply.raise_for_status()
        offered[var.name] = set(reply.json()["data"])
    assert offered == {"run_id": {RUN}, "rank": {"0", "1"}}


def test_prometheus_loaded_every_rule(source: Source) -> None:
    reply = httpx.get(f"{source.prom.url}/api/v1/rules", timeout=5.0)
    reply.raise_for_status()
    loaded = {r["name"] for g in reply.json()["data"]["groups"] for r in g["rules"]}
    assert loaded == {rule["alert"] for rule in alert_rules()}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_expression_fires_for_the_faulty_ranks(source: Source, rule: dict[str, Any]) -> None:
    result = source.prom.query(rule["expr"])
    ranks = {series["metric"].get("rank") for series in result}
    # Quiet ones: GuardServerDown (the target is up; its firing is a promtool unit test) and,
    # from a real server, GuardRankSilent (the server stamps report times itself).
    assert ranks == source.firing.get(rule["alert"], set()), rule["expr"]
    assert {series["metric"]["run_id"] for series in result} <= {RUN}
