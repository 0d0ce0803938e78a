"""docs/metrics.md is what the code serves: every family of a real /metrics with its type and
labels, every alert of the rule files with its severity, and nothing else."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from guard_server import EmbeddedServer, ReportBatch, Settings
from guard_server.rejections import REJECT_REASONS
from guard_server.wire import ACTIONS
from tests.dashboards.queries import ALERT_RULES, alert_rules

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs/metrics.md"
BY_RUN = sorted((ROOT / "deploy/prometheus").glob("*.yml"))
# Labels whose values are a closed set the page lists in the metric's row.
LISTED = ("tensor", "kind", "action", "reason", "weight")

Row = dict[str, str]


def table(heading: str) -> dict[str, Row]:
    """The table under `## heading` in docs/metrics.md: first cell (unquoted) -> row."""
    section = DOC.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(head, cells, strict=True))
    return rows


def documented_metrics() -> dict[str, Row]:
    return table("Per-rank metrics") | table("The serving process's own metrics")


def served() -> dict[str, tuple[str, set[str], set[str]]]:
    """name -> (type, labels, label values) of a real server's /metrics holding one rank
    that has every family: docs/wire.md's example report, halted, a rejected request and a
    report with a field the server does not know."""
    example = json.loads(re.search(r"```json\n(.*?)```", (ROOT / "docs/wire.md").read_text(),
                                   re.S).group(1))  # type: ignore[union-attr]
    example["reports"][0] |= {"halted": "nonfinite", "events": []}
    with EmbeddedServer(port=0, settings=Settings(port=0, log_level="warning")) as server:
        server.store.ingest(ReportBatch.model_validate(example))
        assert httpx.post(f"{server.url}/v1/reports", content=b"x").status_code == 415
        # A newer guard's report, with a field this server does not know: stored, counted.
        newer = json.dumps({**example, "run_id": "newer", "sent_by": "guard 9"})
        assert httpx.post(f"{server.url}/v1/reports", content=newer,
                          headers={"content-type": "application/json"}).status_code == 202
        text = httpx.get(f"{server.url}/metrics").text
    found = {}
    for family in text_string_to_metric_families(text):
        # The parser reports counters without their _total; the page names what is served.
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels}
        values = {v for s in family.samples for k, v in s.labels.items() if k in LISTED}
        found[name] = (family.type, labels, values)
    return found


def test_every_metric_served_is_documented_with_its_type_and_labels() -> None:
    documented = documented_metrics()
    served_now = served()
    assert set(documented) == set(served_now)
    for name, (kind, labels, _) in served_now.items():
        row = documented[name]
        assert row["type"] == kind, name
        assert set(re.findall(r"`(\w+)`", row["labels"])) == labels, name


def test_the_label_values_a_metric_takes_are_listed_in_its_row() -> None:
    documented = documented_metrics()
    for name, (_, _, values) in served().items():
        listed = set(re.findall(r"`(\w+)`", documented[name]["meaning"]))
        assert values <= listed, (name, values - listed)
    # Values no scrape of one rank shows at once: every action, every reason.
    assert set(ACTIONS) <= set(re.findall(r"`(\w+)`",
                                          documented["guard_violations_total"]["meaning"]))
    reasons = documented["guard_ingest_rejected_total"]["meaning"]
    assert set(REJECT_REASONS) <= set(re.findall(r"`(\w+)`", reasons))


def test_every_alert_of_both_rule_files_is_documented_with_its_severity() -> None:
    documented = table("Alerts")
    for path in [ALERT_RULES, *BY_RUN]:
        rules = {rule["alert"]: rule for rule in alert_rules(path)}
        assert set(rules) == set(documented), path.name
        for name, rule in rules.items():
            assert documented[name]["severity"] == rule["labels"]["severity"], (path.name, name)
    assert all(row["fires when"] and row["what to do"] for row in documented.values())


def test_the_docs_need_nothing_outside_the_repository() -> None:
    # A clone has no ../shared: README.md and docs/ send the reader to pages of their own.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert [p.name for p in pages if "shared/" in p.read_text() or "../" in p.read_text()] == []
