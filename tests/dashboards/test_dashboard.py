"""The Grafana dashboard JSON: schema, variables, datasources, and the PromQL it runs."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.dashboards.queries import (
    ALL,
    GUARD_METRICS,
    ROOT,
    SERVER_METRICS,
    custom_values,
    load_dashboard,
    metric_names,
    panels,
    regex_value,
    selectors,
    substitute,
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DATASOURCES = ROOT / "dashboards/grafana/provisioning/datasources/logitguard.yaml"


@pytest.fixture
def dashboard() -> dict[str, Any]:
    return load_dashboard()


def _panel(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    (found,) = [p for p in panels(dashboard) if p["title"] == title]
    return found


def _targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in panels(dashboard) for t in p["targets"]]


def test_identity_and_schema(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "logitguard-overview"
    assert 39 <= dashboard["schemaVersion"] <= 41
    assert "id" not in dashboard or dashboard["id"] is None  # provisioning assigns ids
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    ids = [p["id"] for p in rows] + [p["id"] for p in panels(dashboard)]
    assert len(set(ids)) == len(ids), "panel ids must be unique"


def test_panels_tile_the_grid_without_overlap(dashboard: dict[str, Any]) -> None:
    # The top level only: a collapsed row's panels are placed when it opens.
    boxes = [(p["title"], p["gridPos"]) for p in dashboard["panels"]]
    for title, g in boxes:
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, f"{title}: {g}"
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1 :]:
            apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                     or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
            assert apart, f"{a!r} {ga} overlaps {b!r} {gb}"


def test_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    (provisioned,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert variables["datasource"]["current"]["value"] == provisioned["uid"]
    for name in ("run_id", "rank"):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"] == DATASOURCE
        assert var["multi"] is True and var["includeAll"] is True
        assert var["allValue"] == ".*"
        assert re.fullmatch(rf"label_values\(.+,\s*{name}\)", var["query"]["query"])
    # Choosing runs narrows the ranks offered.
    assert "$run_id" in variables["rank"]["query"]["query"]


def test_every_panel_and_query_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]


def test_queries_use_contract_metrics_filtered_by_run_and_rank(dashboard: dict[str, Any]) -> None:
    for title, target in _targets(dashboard):
        expr = target["expr"]
        names = metric_names(expr)
        assert names and names <= GUARD_METRICS, f"{title}: unknown metrics {names - GUARD_METRICS}"
        for metric, matchers in selectors(expr):
            if metric in SERVER_METRICS:
                continue
            assert 'run_id=~"$run_id"' in matchers, f"{title}: {metric} not filtered by run_id"
            assert 'rank=~"$rank"' in matchers, f"{title}: {metric} not filtered by rank"


def test_every_contract_metric_is_on_a_panel(dashboard: dict[str, Any]) -> None:
    shown = set().union(*(metric_names(t["expr"]) for _, t in _targets(dashboard)))
    assert shown == GUARD_METRICS


@pytest.mark.parametrize("what", ["mean", "max"])
def test_padding_mass_is_a_ratio_beside_the_healthy_share(
    dashboard: dict[str, Any], what: str
) -> None:
    panel = _panel(dashboard, f"Padding mass, {what} (pre-mask)")
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "percentunit"
    # No fixed line: what healthy padding rows take depends on the run's sizes, P / (N + P),
    # drawn per run from guard_vocab_size (dashed); the mass is a figure, violations are
    # counted apart.
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "off"
    healthy = next(t for t in panel["targets"] if t["refId"] == "B")
    assert metric_names(healthy["expr"]) == {"guard_vocab_size"}
    assert "healthy share" in healthy["legendFormat"]
    assert "violation" in panel["description"]


def test_last_report_age_marks_the_rank_silent_threshold(dashboard: dict[str, Any]) -> None:
    defaults = _panel(dashboard, "Seconds since last report")["fieldConfig"]["defaults"]
    assert defaults["unit"] == "s"
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, 120]


def test_halted_ranks_is_a_stat_that_reads_zero_when_none(dashboard: dict[str, Any]) -> None:
    panel = _panel(dashboard, "Halted ranks")
    assert panel["type"] == "stat"
    assert panel["fieldConfig"]["defaults"]["noValue"] == "0"


def test_variables_substitute_as_grafana_writes_them() -> None:
    # A run id's dot is escaped for the regex, and the escape itself for the PromQL string.
    assert regex_value("gpt.small") == "gpt\\\\.small"
    assert regex_value(["a", "b"]) == "(a|b)"
    assert regex_value(ALL) == ".*"
    assert substitute('x{r=~"$rank", s=~"${rank}"}', {"rank": "0"}) == 'x{r=~"0", s=~"0"}'
    with pytest.raises(KeyError, match=r"\$nope"):
        substitute("rate(x[$nope])", {})


# The outermost aggregation of a query, and the labels it keeps: `sum by (run_id, rank) (`.
_OUTER = re.compile(r"(topk|bottomk|sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(")


def test_per_rank_panels_show_the_top_k_ranks_only(dashboard: dict[str, Any]) -> None:
    # With thousands of ranks one line per rank is unreadable and heavy: every query that
    # keeps the rank label is bounded by topk / bottomk($topk, ...); the others aggregate it
    # away. test_live_scale.py checks the bound on a real Prometheus holding 1200 ranks.
    for title, target in _targets(dashboard):
        expr = target["expr"].strip()
        outer = _OUTER.match(expr)
        assert outer is not None, f"{title}: {expr} neither aggregates nor picks the top ranks"
        if outer.group(1) in ("topk", "bottomk"):
            assert expr.startswith(f"{outer.group(1)}($topk, "), f"{title}: k is not $topk"
        else:
            kept = {label.strip() for label in (outer.group(2) or "").split(",")}
            assert "rank" not in kept, f"{title}: one series per rank: {expr}"


def test_topk_variable_defaults_to_10(dashboard: dict[str, Any]) -> None:
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "topk"]
    assert var["type"] == "custom" and var["current"]["value"] == "10"
    assert {o["value"] for o in var["options"]} == set(var["query"].split(","))
    assert custom_values(dashboard) == {"topk": "10"}
