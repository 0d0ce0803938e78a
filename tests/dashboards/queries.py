"""The dashboard's and the alert rules' PromQL, ready to evaluate against a real Prometheus.

Reusable with any data behind Prometheus (a static exposition, a real training run):

    for q in dashboard_queries(run_id="gpt-small-001", rank="0"):
        prom.query(q.expr)          # Grafana variables already substituted
    for rule in alert_rules():
        prom.query(rule["expr"])
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from guard_server.collector import server_families
from guard_server.families import PER_RANK

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards/grafana/dashboards/logitguard-overview.json"
ALERT_RULES = ROOT / "dashboards/prometheus/guard-alerts.yml"
# Every metric the server exposes, from the code: the per-rank families table and the server's
# own families (which carry no run_id / rank: a rejected request has no trusted run).
SERVER_METRICS = frozenset(m.name + ("_total" if m.type == "counter" else "")
                           for m in server_families(0, {}, 0, 0, 0))
GUARD_METRICS = frozenset(f.name for f in PER_RANK) | SERVER_METRICS

# Queries with data only where a guard newer than the server pushes to it (its reports'
# unknown fields): the static exposition (test_live_queries.py) has them, a live run does not.
NEWER_GUARDS_ONLY = frozenset({("Server rejects by reason", "C")})

ALL = ".*"  # the allValue of the run_id / rank variables ("All")
# Grafana's built-in range variables, fixed: 1m spans many scrapes at the tests' 1 s interval.
BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}


class PanelQuery(NamedTuple):
    """One query of one panel, with every variable substituted."""

    title: str
    ref_id: str
    expr: str


class VariableQuery(NamedTuple):
    """A `label_values(selector, label)` template variable, variables substituted."""

    name: str
    selector: str
    label: str


def regex_value(values: str | Sequence[str]) -> str:
    """A multi-value variable as Grafana writes it into `=~"..."`: regex-escaped, alternated.

    ALL stays as is (it is the allValue, already a regex). The escaping backslash is itself
    escaped, because the value lands inside a PromQL double-quoted string.
    """
    if isinstance(values, str):
        values = [values]
    if list(values) == [ALL]:
        return ALL
    escaped = [re.sub(r"([\\^$*+?.()|\[\]{}])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace `$name` and `${name}`; an unknown variable is an error, not a silent hole."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard JSON as a dict."""
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data, including those inside (collapsed) rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panels(panel)
        else:
            yield panel


def _variables(run_id: str | Sequence[str], rank: str | Sequence[str]) -> dict[str, str]:
    return {"run_id": regex_value(run_id), "rank": regex_value(rank), **BUILTINS}


def custom_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """The current (default) value of each custom variable, such as `$topk`."""
    return {
        var["name"]: str(var["current"]["value"])
        for var in dashboard["templating"]["list"]
        if var["type"] == "custom"
    }


def dashboard_queries(
    path: Path = DASHBOARD, *, run_id: str | Sequence[str] = ALL, rank: str | Sequence[str] = ALL
) -> list[PanelQuery]:
    """Each panel query of the dashboard, for the given run_id / rank selection (custom
    variables at their defaults)."""
    dashboard = load_dashboard(path)
    variables = {**custom_values(dashboard), **_variables(run_id, rank)}
    return [
        PanelQuery(panel["title"], target["refId"], substitute(target["expr"], variables))
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def variable_queries(
    path: Path = DASHBOARD, *, run_id: str | Sequence[str] = ALL
) -> list[VariableQuery]:
    """The dashboard's label_values() variables, with `$run_id` substituted."""
    variables = _variables(run_id, ALL)
    found = []
    for var in load_dashboard(path)["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        if match is None:
            raise ValueError(f"variable {var['name']}: not a label_values() query: {query!r}")
        found.append(
            VariableQuery(var["name"], substitute(match.group(1), variables), match.group(2))
        )
    return found


def alert_rules(path: Path = ALERT_RULES) -> list[dict[str, Any]]:
    """Every alerting rule of the Prometheus rules file, in file order."""
    doc = yaml.safe_load(path.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


_KEYWORDS = frozenset(
    {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "inf", "nan"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a lexical scan, enough for our queries)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # dashboard variables, such as $topk
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)\b(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, matchers) for each vector selector of a metric name in the expression."""
    names = metric_names(expr)
    return [
        (m.group(1), m.group(2) or "")
        for m in re.finditer(r"\b([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?", expr)
        if m.group(1) in names
    ]
