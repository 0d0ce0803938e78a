"""1200 ranks scraped directly by a real Prometheus: the dashboard stays readable, alerts fold.

Each rank has its own /metrics endpoint (fleet.py), serving the real exposition of one guard
(captured once from a real guard's embedded endpoint) re-labelled for its rank, as a large job
looks when Prometheus scrapes every rank's `export.serve` port (docs/scale.md). Faults:

  FAULTY     unmasked padding mass, non-finite logits, ghost labels, skipped steps, blind
             steps, input ids on untrained rows, dropped reports, and a loss of 87
  HALTED     stopped by nonfinite (one of FAULTY)
  SILENT     last report 10 minutes ago, its step frozen
  STRAGGLER  steps at a fifth of the others' rate
  every rank counts loss_spike violations: the guard's decisions are all-reduced, so a run-wide
             fault is counted on every rank, the case that makes per-rank alerts fan out.

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
from tests.dashboards.fleet import Template, capture_exposition, serve_fleet
from tests.dashboards.queries import (
    ROOT,
    alert_rules,
    custom_values,
    dashboard_queries,
    load_dashboard,
)

pytestmark = pytest.mark.prometheus

RUN = "scale.1"  # the dot checks that the dashboard's regex matchers escape run ids
RANKS = 1200
FAULTY = {7, 613, 1187}
HALTED = {7}
SILENT = {1024}
STRAGGLER = {333}
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


def values(rank: int, scrape: int, now: float) -> dict[str, float]:
    """What rank `rank` reports at its `scrape`-th scrape; counters grow once a scrape."""
    n, bad = scrape, rank in FAULTY
    found = {
        "guard_step": 100 + (0 if rank in SILENT else n if rank in STRAGGLER else 5 * n),
        "guard_last_report_timestamp_seconds": now - 600 if rank in SILENT else now,
        "guard_loss": 87.0 if bad else 2.0 + rank / 1e5,
        "guard_padding_mass_ratio": 0.99 if bad else 0.02,  # garbage rows, or healthy ones
        "guard_padding_mass_max_ratio": 1.0 if bad else 0.03,
        'guard_violations_total{check="padding_mass",action="warn"}': n if bad else 0,
        'guard_violations_total{check="loss_spike",action="warn"}': n,
        'guard_violations_total{check="coverage",action="warn"}': n if bad else 0,
        'guard_nonfinite_values_total{tensor="logits"}': 4 * n if bad else 0,
        'guard_out_of_range_tokens_total{kind="label"}': 3 * n if bad else 0,
        'guard_untrained_tokens_total{kind="input"}': 2 * n if bad else 0,
        "guard_skipped_steps_total": n if bad else 0,
        "guard_dropped_reports_total": 7 * n if bad else 0,
    }
    if rank in HALTED:
        found['guard_halted{check="nonfinite"}'] = 1
    return found


@pytest.fixture(scope="module")
def prom() -> Iterator[Prometheus]:
    """A real Prometheus that has scraped each of the 1200 rank endpoints three times."""
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    template = Template(capture_exposition())

    def render(rank: int, scrape: int, now: float) -> bytes:
        return template.render(RUN, rank, values(rank, scrape, now)).encode()

    with serve_fleet(RANKS, render) as targets, run_prometheus(targets) as prom:
        prom.wait_for(f"count(count_over_time(guard_step[1m]) >= 3) >= {RANKS}", timeout_s=90)
        yield prom


def _ranks(result: list[dict[str, Any]]) -> set[int]:
    return {int(s["metric"]["rank"]) for s in result if "rank" in s["metric"]}


def test_every_panel_query_is_bounded_and_picks_the_faulty_ranks(prom: Prometheus) -> None:
    for query in dashboard_queries(run_id=RUN):
        result = prom.query(query.expr)
        where = f"{query.title} ({query.ref_id}): {query.expr}"
        assert result, f"no data: {where}"
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
