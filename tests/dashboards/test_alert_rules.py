"""The Prometheus alert rules: promtool's checks and unit tests, and what each rule says."""

from __future__ import annotations

import pytest
import yaml

from tests.dashboards.conftest import Run
from tests.dashboards.queries import ALERT_RULES, GUARD_METRICS, alert_rules, metric_names

UNIT_TESTS = ALERT_RULES.with_name("guard-alerts.test.yml")
# DESIGN.md's alert names; GuardServerDown is the extra that watches guard-server itself.
CONTRACT_ALERTS = {
    "GuardNonFinite",
    "GuardPaddingMassHigh",
    "GuardHalted",
    "GuardTokenOutOfRange",
    "GuardLossSpike",
    "GuardRankSilent",
    "GuardReportsDropped",
    "GuardBlind",
    "GuardUntrainedTokens",
}
SERVER_ALERTS = {"GuardServerDown"}


@pytest.mark.prometheus
def test_promtool_check_rules(run: Run) -> None:
    out = run("promtool", "check", "rules", ALERT_RULES).stdout
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


@pytest.mark.prometheus
def test_promtool_unit_tests(run: Run) -> None:
    run("promtool", "test", "rules", UNIT_TESTS.name, cwd=UNIT_TESTS.parent)


def test_rules_are_the_contract_alerts() -> None:
    assert {rule["alert"] for rule in alert_rules()} == CONTRACT_ALERTS | SERVER_ALERTS


def test_unit_tests_cover_each_alert_firing_and_not_firing() -> None:
    cases = [
        case
        for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    for rule in alert_rules():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case["exp_alerts"] for case in mine), f"{rule['alert']}: no firing case"
        assert any(not case["exp_alerts"] for case in mine), f"{rule['alert']}: no quiet case"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_rule_has_severity_and_says_where_and_what_first(rule: dict) -> None:
    assert rule["labels"]["severity"] in {"critical", "warning"}
    summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
    assert "First:" in description, "the description must say what to do first"
    if rule["alert"] in SERVER_ALERTS:
        assert "{{ $labels.instance }}" in summary
        return
    for label in ("run_id", "rank"):
        placeholder = "{{ $labels." + label + " }}"
        assert placeholder in summary
        assert placeholder in description


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_rule_uses_only_contract_metrics(rule: dict) -> None:
    names = metric_names(rule["expr"])
    # GuardRankSilent stands down while guard-server is down (GuardServerDown says it then).
    watches_up = rule["alert"] in SERVER_ALERTS | {"GuardRankSilent"}
    allowed = GUARD_METRICS | ({"up"} if watches_up else set())
    assert names and names <= allowed, f"{rule['alert']}: unknown metrics {names - allowed}"


def test_padding_mass_rule_names_the_fix() -> None:
    (rule,) = [r for r in alert_rules() if r["alert"] == "GuardPaddingMassHigh"]
    text = " ".join(rule["annotations"]["description"].split())
    assert "checks.padding_mass.action: mask" in text
    assert "checks.padding_rows.action: repair" in text
    # It fires on violations only: a measured mass alone (healthy rows take P / (N + P)) never.
    assert 'guard_violations_total{check="padding_mass"}' in rule["expr"]
    assert "guard_padding_mass_ratio" not in rule["expr"]
