"""deploy/prometheus/guard-alerts-by-run.yml: the per-rank rules, counted per run, generated
by scripts/gen_alerts_by_run.py (byte for byte here).

Each by-run expression must be the per-rank rule's expression, unchanged, inside one
`count by (run_id, ...)`; so a change to a per-rank rule fails here until the file is
generated again. What the rules return on 1200 ranks: tests/dashboards/test_live_scale.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from tests.dashboards.conftest import Run
from tests.dashboards.queries import ROOT, alert_rules
from tests.scripts import load_script

BY_RUN = ROOT / "deploy/prometheus/guard-alerts-by-run.yml"
SCRIPT = ROOT / "scripts/gen_alerts_by_run.py"


GEN = load_script("gen_alerts_by_run")
KEPT, UNCHANGED = GEN.KEPT, GEN.UNCHANGED  # the label each rule keeps beside run_id; none


def test_committed_file_is_what_the_script_generates() -> None:
    assert BY_RUN.read_text() == GEN.render(), (
        "deploy/prometheus/guard-alerts-by-run.yml is stale: run "
        ".venv/bin/python scripts/gen_alerts_by_run.py")


def test_the_script_checks_the_committed_file() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_rule_whose_text_names_no_rank_must_be_written_out() -> None:
    rule = {"alert": "GuardNew", "expr": "x > 0", "labels": {},
            "annotations": {"summary": "something on run {{ $labels.run_id }}",
                            "description": "d"}}
    with pytest.raises(GEN.GenerationError, match="GuardNew: its text does not say"):
        GEN.render_rule(rule)


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
