"""1200 ranks scraped directly by a real Prometheus: the dashboard stays readable, alerts fold.

Each rank has its own /metrics endpoint (fleet.py), serving the real exposition of one guard
(captured once from a real guard's embedded endpoint) re-labelled for its rank, as a large job
looks when Prometheus scrapes every rank's `export.serve` port (docs/scale.md). The ranks and
their faults: scale_scenario.py.

The 1200 endpoints are served by a child process under an open-files limit of what they may
hold (fleet_process): a Prometheus slower than its scrape interval on a busy machine cannot
exhaust this process's descriptors and fail the tests after this one.

Every dashboard query must return at most $topk series that carry a rank (topk / bottomk),
and the ranks it picks must be the faulty ones; every per-rank alert returns one series per
rank it holds for, and its by-run form (deploy/prometheus/guard-alerts-by-run.yml) one series
per run whose value is that count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from guard_server.testing import Prometheus, prometheus_binary, run_prometheus
from tests.dashboards.fleet import fleet_process
from tests.dashboards.queries import (
    NEWER_GUARDS_ONLY,
    ROOT,
    alert_rules,
    custom_values,
    dashboard_queries,
    load_dashboard,
)
from tests.dashboards.scale_scenario import FAULTY, HALTED, RANKS, RUN, SILENT, STRAGGLER

pytestmark = pytest.mark.prometheus

K = int(custom_values(load_dashboard())["topk"])
BY_RUN_RULES = ROOT / "deploy/prometheus/guard-alerts-by-run.yml"

# Which ranks each per-rank panel must show among its top k.
SURFACES: dict[str, set[int]] = {
    "Padding mass, mean (pre-mask)": FAULTY,
    "Padding mass, max (pre-mask)": FAULTY,
    "Non-finite values by tensor": FAULTY,
    "Ghost tokens by kind": FAULTY,
    "Skipped optimizer steps": FAULTY,
    "Blind checks (coverage)": FAULTY,
    "Untrained tokens by kind": FAULTY,
    "Loss": FAULTY,
    "Step rate": STRAGGLER | SILENT,
    "Seconds since last report": SILENT,
    "Dropped reports": FAULTY,
}
# Which ranks each alert holds for.
FIRING: dict[str, set[int]] = {
    "GuardNonFinite": FAULTY,
    "GuardPaddingMassHigh": FAULTY,
    "GuardHalted": HALTED,
    "GuardTokenOutOfRange": FAULTY,
    "GuardLossSpike": set(range(RANKS)),
    "GuardRankSilent": SILENT,
    "GuardReportsDropped": FAULTY,
    "GuardBlind": FAULTY,
    "GuardUntrainedTokens": FAULTY,
    "GuardServerDown": set(),
}


# Every 5 s: 240 renderings a second (~0.1 ms of CPU each) from one Python process, which
# keeps up on two busy cores. At 1 s a loaded machine fell behind Prometheus' scrape timeout,
# and every timed-out scrape left a connection behind.
SCRAPE_INTERVAL_S = 5.0
MAX_CONNECTIONS = 2  # per endpoint: Prometheus keeps one; the other is a reconnect's


@pytest.fixture(scope="module")
def prom() -> Iterator[Prometheus]:
    """A real Prometheus that has scraped each of the 1200 rank endpoints three times."""
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    scenario = "tests.dashboards.scale_scenario:render"
    with fleet_process(RANKS, scenario, max_connections=MAX_CONNECTIONS) as fleet, \
            run_prometheus(fleet.targets, scrape_interval_s=SCRAPE_INTERVAL_S) as prom:
        # A deadline for a busy machine, not a speed requirement.
        prom.wait_for(f"count(count_over_time(guard_step[1m]) >= 3) >= {RANKS}", timeout_s=600)
        # After three rounds of 1200 scrapes the fleet holds what it may: a listening socket
        # and at most MAX_CONNECTIONS connections per endpoint.
        assert fleet.open_sockets() <= RANKS * (1 + MAX_CONNECTIONS)
        yield prom


def _ranks(result: list[dict[str, Any]]) -> set[int]:
    return {int(s["metric"]["rank"]) for s in result if "rank" in s["metric"]}


def test_every_panel_query_is_bounded_and_picks_the_faulty_ranks(prom: Prometheus) -> None:
    for query in dashboard_queries(run_id=RUN):
        result = prom.query(query.expr)
        where = f"{query.title} ({query.ref_id}): {query.expr}"
        assert result or (query.title, query.ref_id) in NEWER_GUARDS_ONLY, f"no data: {where}"
        per_rank = [s for s in result if "rank" in s["metric"]]
        assert len(per_rank) <= K, f"{len(per_rank)} per-rank series, more than {K}: {where}"
        assert len(result) < 50, f"{len(result)} series: {where}"
        if query.title in SURFACES and query.ref_id == "A":
            assert SURFACES[query.title] <= _ranks(per_rank), where
    halted = prom.query(next(q.expr for q in dashboard_queries() if q.title == "Halted ranks"))
    assert [s["value"][1] for s in halted] == [str(len(HALTED))]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_per_rank_alerts_fan_out_to_every_rank_they_hold_for(
    prom: Prometheus, rule: dict[str, Any]
) -> None:
    ranks = [int(s["metric"]["rank"]) for s in prom.query(rule["expr"])]
    # One series per (rank, tensor / kind / ...): these faults each have one such label value.
    assert sorted(ranks) == sorted(FIRING[rule["alert"]])


@pytest.mark.parametrize("rule", alert_rules(BY_RUN_RULES), ids=lambda rule: rule["alert"])
def test_by_run_alerts_fold_the_ranks_into_one_alert_per_run(
    prom: Prometheus, rule: dict[str, Any]
) -> None:
    result = prom.query(rule["expr"])
    expected = len(FIRING[rule["alert"]])
    if not expected:
        assert result == []
        return
    assert len(result) == 1, result
    (series,) = result
    assert series["metric"]["run_id"] == RUN and "rank" not in series["metric"]
    assert float(series["value"][1]) == expected
