"""Every dashboard query and alert expression, evaluated by a real Prometheus on loopback.

Prometheus loads the alert rules and scrapes, once a second, the static fault exposition
(exposition.py), in which every alert condition holds, GuardRankSilent included; the queries
go through its HTTP API, so a query that does not parse fails with 400. The same queries
against a real guard-server fed by a real training run: test_live_training.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from guard_server.testing import Prometheus, prometheus_binary, run_prometheus
from tests.dashboards.conftest import Run
from tests.dashboards.exposition import FIRING, RUN, fault_exposition, serve_exposition
from tests.dashboards.live import loaded_alerts, offered_variables
from tests.dashboards.queries import (
    ALERT_RULES,
    ALL,
    PanelQuery,
    alert_rules,
    dashboard_queries,
)

pytestmark = pytest.mark.prometheus

# One run and rank picked in the dashboard's drop-downs, and "All" in both.
SELECTIONS = {"rank0": (RUN, "0"), "all": (ALL, ALL)}
PANEL_QUERIES = [
    pytest.param(name, query, id=f"{name}:{query.title}:{query.ref_id}")
    for name, (run_id, rank) in SELECTIONS.items()
    for query in dashboard_queries(run_id=run_id, rank=rank)
]


@pytest.fixture(scope="module")
def prom() -> Iterator[Prometheus]:
    """A real Prometheus that has scraped the fault exposition at least three times."""
    # Module scope: the tests only read, and each fresh Prometheus costs seconds.
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    with (
        serve_exposition(fault_exposition) as target,
        run_prometheus([target], scrape_interval_s=1.0, rule_files=[ALERT_RULES]) as prom,
    ):
        # Three samples: every rate() / increase() window holds two, and counters have grown.
        prom.wait_for('count_over_time(guard_step{rank="0"}[1m]) >= 3', timeout_s=30)
        yield prom


def test_fault_exposition_passes_promtool(run: Run) -> None:
    result = run("promtool", "check", "metrics", stdin=fault_exposition(1, 1_764_424_800.0))
    assert result.stdout + result.stderr == "", "promtool's metric lint has findings"


@pytest.mark.parametrize(("selection", "query"), PANEL_QUERIES)
def test_panel_query_returns_series(prom: Prometheus, selection: str, query: PanelQuery) -> None:
    result = prom.query(query.expr)
    assert result, f"panel {query.title!r} ({query.ref_id}) shows no data: {query.expr}"
    if selection == "rank0":
        ranks = {series["metric"].get("rank") for series in result} - {None}
        assert ranks <= {"0"}, f"panel {query.title!r} ignores the rank variable: {ranks}"


def test_variables_offer_the_run_and_its_ranks(prom: Prometheus) -> None:
    assert offered_variables(prom, RUN) == {"run_id": {RUN}, "rank": {"0", "1"}}


def test_prometheus_loaded_every_rule(prom: Prometheus) -> None:
    assert loaded_alerts(prom) == {rule["alert"] for rule in alert_rules()}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_expression_fires_for_the_faulty_ranks(
    prom: Prometheus, rule: dict[str, Any]
) -> None:
    result = prom.query(rule["expr"])
    ranks = {series["metric"].get("rank") for series in result}
    # Quiet: GuardServerDown (the target is up; its firing is a promtool unit test).
    assert ranks == FIRING.get(rule["alert"], set()), rule["expr"]
    assert {series["metric"]["run_id"] for series in result} <= {RUN}
