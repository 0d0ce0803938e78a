"""docs/operate.md, followed: the shipped Prometheus config and Alertmanager route pass their
tools, `guard serve` starts with the documented command, a real Prometheus started with the
shipped config (its targets pointed at that server) scrapes it with the rules loaded, and the
dashboard it says to import queries only what the server exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from guard_server.testing import prometheus_binary, run_prometheus
from tests.dashboards.conftest import Run
from tests.dashboards.live import loaded_alerts
from tests.dashboards.queries import (
    ALERT_RULES,
    DASHBOARD,
    GUARD_METRICS,
    ROOT,
    alert_rules,
    dashboard_queries,
    metric_names,
)
from tests.dashboards.test_live_silent import _env
from tests.served import guard_serve

DOC = ROOT / "docs/operate.md"
CONFIG = ROOT / "deploy/existing/prometheus.yml"
ROUTE = ROOT / "deploy/existing/alertmanager.yml"


def _doc() -> str:
    return DOC.read_text()


def test_the_page_names_files_that_exist_and_is_linked_from_the_readme() -> None:
    named = set(re.findall(r"`((?:deploy|dashboards|docs)/[^`\s]+)`", _doc()))
    assert {str(CONFIG.relative_to(ROOT)), str(ROUTE.relative_to(ROOT)),
            str(DASHBOARD.relative_to(ROOT)), str(ALERT_RULES.relative_to(ROOT))} <= named
    assert [n for n in named if not (ROOT / n).exists()] == []
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    assert "docs/operate.md" in first_screen


COMMAND = "guard serve --host 0.0.0.0 --port 9400"


def test_the_documented_server_command_is_the_one_tested() -> None:
    assert f"GUARD_TOKEN=$(cat /etc/guard/token) {COMMAND}" in _doc()


@pytest.fixture
def documented_server(tmp_path: Path) -> Iterator[str]:
    """The page's command, on a free port, with a token; its loopback URL once it answers."""
    args = COMMAND.replace("9400", "{port}").split()[2:]
    env = _env() | {"GUARD_TOKEN": "operate-test-token"}
    with guard_serve(args, env, tmp_path / "guard-serve.log") as url:
        yield url


@pytest.mark.prometheus
def test_promtool_checks_the_shipped_config_and_its_rules(run: Run) -> None:
    out = run("promtool", "check", "config", CONFIG).stdout
    assert "SUCCESS" in out and f"SUCCESS: {len(alert_rules())} rules found" in out
    named = yaml.safe_load(CONFIG.read_text())["rule_files"]
    rules = [(CONFIG.parent / p).resolve() for p in named]
    assert rules == [ALERT_RULES]


@pytest.mark.prometheus
def test_amtool_checks_the_shipped_route(run: Run) -> None:
    out = run("amtool", "check-config", ROUTE).stdout
    assert "SUCCESS" in out
    routes = yaml.safe_load(ROUTE.read_text())["route"]["routes"]
    guard = next(r for r in routes if 'alertname=~"Guard.+"' in r["matchers"])
    assert guard["group_by"] == ["alertname", "run_id"]
    # Every severity the rules use reaches a receiver (critical ones by their own route).
    assert {r["labels"]["severity"] for r in alert_rules()} == {"critical", "warning"}


def test_the_dashboard_parses_and_queries_only_what_the_server_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert any(v["name"] == "datasource" and v["type"] == "datasource"
               for v in dashboard["templating"]["list"]), "import asks for no data source"
    queried = set().union(*(metric_names(q.expr) for q in dashboard_queries()))
    assert queried and queried <= GUARD_METRICS


def _config_for(server_url: str) -> str:
    """The shipped config with its guard-server target pointed at the test's server, a fast
    interval, the rule file by absolute path and no Alertmanager (none runs here)."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str((CONFIG.parent / p).resolve()) for p in config["rule_files"]]
    del config["alerting"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["guard-server"]["static_configs"] = [{"targets": [server_url.split("://")[1]]}]
    config["scrape_configs"] = [jobs["guard-server"]]
    return json.dumps(config)


@pytest.mark.prometheus
def test_prometheus_with_the_shipped_config_scrapes_guard_serve(documented_server: str) -> None:
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    with run_prometheus([], config=_config_for(documented_server)) as prom:
        prom.wait_for('up{job="guard-server"} == 1', timeout_s=60)
        prom.wait_for('guard_server_ranks{job="guard-server"}', timeout_s=30)
        assert loaded_alerts(prom) == {rule["alert"] for rule in alert_rules()}
        assert prom.query('ALERTS{alertname="GuardServerDown"}') == []


