"""deploy/prometheus/guard-alerts-by-run.yml: the per-rank rules, counted per run.

Each by-run expression must be the per-rank rule's expression, unchanged, inside one
`count by (run_id, ...)`; so a change to a per-rank rule fails here until the by-run file
follows. What the rules return on 1200 ranks: tests/dashboards/test_live_scale.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.dashboards.conftest import Run
from tests.dashboards.queries import ROOT, alert_rules

BY_RUN = ROOT / "deploy/prometheus/guard-alerts-by-run.yml"
# The label each rule keeps beside run_id: the one its per-rank series vary in.
KEPT = {"GuardNonFinite": "tensor", "GuardHalted": "check", "GuardTokenOutOfRange": "kind",
        "GuardLossSpike": "action", "GuardPaddingMassHigh": "action",
        "GuardUntrainedTokens": "kind"}
UNCHANGED = {"GuardServerDown"}  # watches guard-server, has no run


def _flat(expr: str) -> str:
    return " ".join(expr.split())


def _pairs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    by_run = {rule["alert"]: rule for rule in alert_rules(BY_RUN)}
    return [(rule, by_run[rule["alert"]]) for rule in alert_rules()]


def test_same_alerts_in_the_same_order() -> None:
    assert [r["alert"] for r in alert_rules(BY_RUN)] == [r["alert"] for r in alert_rules()]


@pytest.mark.parametrize(("base", "by_run"), _pairs(), ids=lambda r: r["alert"])
def test_expression_is_the_per_rank_one_counted_per_run(
    base: dict[str, Any], by_run: dict[str, Any]
) -> None:
    name = base["alert"]
    if name in UNCHANGED:
        assert _flat(by_run["expr"]) == _flat(base["expr"])
        return
    labels = ", ".join(["run_id", *filter(None, [KEPT.get(name)])])
    assert _flat(by_run["expr"]) == f"count by ({labels}) ( {_flat(base['expr'])} )"


@pytest.mark.parametrize(("base", "by_run"), _pairs(), ids=lambda r: r["alert"])
def test_same_severity_and_pending_time_and_no_rank_in_the_text(
    base: dict[str, Any], by_run: dict[str, Any]
) -> None:
    assert by_run["labels"] == base["labels"]
    assert by_run.get("for") == base.get("for")
    annotations = by_run["annotations"]
    assert "First:" in annotations["description"]
    if base["alert"] not in UNCHANGED:
        # The alert has no rank label any more; its value is the number of ranks.
        text = annotations["summary"] + annotations["description"]
        assert "$labels.rank" not in text and "{{ $value }} ranks" in text
        assert not re.search(r"\$labels\.(?!run_id|tensor|check|kind|action)", text)


@pytest.mark.prometheus
def test_promtool_check_rules(run: Run) -> None:
    out = run("promtool", "check", "rules", BY_RUN).stdout
    assert f"SUCCESS: {len(alert_rules(BY_RUN))} rules found" in out
