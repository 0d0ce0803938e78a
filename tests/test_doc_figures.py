"""The figures the user docs quote, held to the code: series a rank and its endpoint have
(docs/scale.md), the alerts of the shipped rule files (docs/scale.md's table), when a
violation counter's series appears (docs/metrics.md), and no internal issue numbers in them.
docs/server.md's series figures and settings are held in tests/server/test_settings.py."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from guard_server import EmbeddedServer, Settings
from guard_server.families import TYPICAL_SERIES_PER_RANK
from tests.dashboards.queries import ALERT_RULES, alert_rules

ROOT = Path(__file__).resolve().parents[1]
BY_RUN = ROOT / "deploy/prometheus/guard-alerts-by-run.yml"
PROMETHEUS_OWN = 5  # up and the four scrape_* series Prometheus adds to every target
# Docs that keep history by design: what was measured before and after a change.
HISTORY = ("benchmarks.md", "architecture.md")


def _flat(name: str) -> str:
    return " ".join((ROOT / "docs" / name).read_text().split())


def _endpoint_series() -> int:
    """Series of a server's own families with nothing pushed: what a rank's endpoint adds."""
    with EmbeddedServer(port=0, settings=Settings(port=0, log_level="warning")) as server:
        text = httpx.get(f"{server.url}/metrics").text
    return sum(len(f.samples) for f in text_string_to_metric_families(text))


def test_scale_md_quotes_the_series_a_rank_and_its_endpoint_have() -> None:
    doc = _flat("scale.md")
    typical = TYPICAL_SERIES_PER_RANK
    assert f"**Series per rank: {typical}**" in doc
    assert f"plus {_endpoint_series()} series of the endpoint itself" in doc
    head = typical + PROMETHEUS_OWN
    assert (f"{PROMETHEUS_OWN} series per target (`up`, `scrape_*`), {head} head series per "
            f"rank: **{head * 1000:,} per 1000 ranks**") in doc
    assert f"10,000 ranks are {head * 10_000:,} head series" in doc


def _alert_table(doc: str) -> dict[str, str]:
    """docs/scale.md's by-run table: alert -> its by-run form."""
    rows = re.findall(r"^\| (Guard\w+) \| [^|]+ \| ([^|]+) \|$", doc, re.M)
    return {name: form.strip() for name, form in rows}


def test_scale_md_lists_every_shipped_alert_with_its_by_run_form() -> None:
    table = _alert_table((ROOT / "docs/scale.md").read_text())
    per_rank = [r["alert"] for r in alert_rules(ALERT_RULES)]
    by_run = {r["alert"]: r["expr"] for r in alert_rules(BY_RUN)}
    assert sorted(table) == sorted(per_rank) == sorted(by_run)
    for name, form in table.items():
        grouped = re.search(r"count by \(([^)]*)\)", by_run[name])
        if grouped is None:
            assert form == "unchanged", name
        else:
            assert form == f"`count by ({grouped.group(1)})`", name


def test_metrics_md_says_the_violation_series_start_at_0() -> None:
    # What the library does: tests/test_contract.py, the typical rank's first report.
    doc = _flat("metrics.md")
    assert "Every enabled check has its series from the first report, at 0" in doc
    assert "appears at a check's first violation" not in doc


def test_the_user_docs_cite_no_internal_issue_numbers() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}"
             for p in pages if p.name not in HISTORY
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bissues? \d+", line, re.I)]
    assert found == []
