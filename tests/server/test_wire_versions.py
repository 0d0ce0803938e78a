"""Rolling upgrades (docs/wire.md, "Versions"): today's server takes the report of every
released guard, with what that release did not report absent (never a zero); a newer guard's
unknown fields cost no report; today's report, lowered, is what every released server reads."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from guard_server import EmbeddedServer
from guard_server.unknown_fields import MAX_NAMES
from guard_server.versions import lowered
from guard_server.wire import WIRE_VERSION, WIRE_VERSION_HEADER
from tests.wire_versions import (
    RECORDED,
    VERSIONS,
    recorded_report,
    released_models,
    todays_report,
)

JSON = {"content-type": "application/json"}


def post(server: EmbeddedServer, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/reports", content=body, headers=JSON, timeout=10)


def samples(server: EmbeddedServer, run_id: str) -> dict[str, str]:
    """The run's /metrics lines: name{labels} -> value."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return dict(line.rsplit(" ", 1) for line in text.splitlines()
                if f'run_id="{run_id}"' in line and not line.startswith("#"))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_report_of_each_release_is_taken_by_todays_server(
        live_server: EmbeddedServer, version: int) -> None:
    body = recorded_report(version)
    run_id = json.loads(body)["run_id"]
    answer = post(live_server, body)
    assert answer.status_code == 202, answer.text  # before: 422, untrained_* missing
    assert answer.headers[WIRE_VERSION_HEADER] == str(WIRE_VERSION)
    seen = samples(live_server, run_id)
    assert seen[f'guard_step{{rank="0",run_id="{run_id}"}}'] == "2.0"
    # What that release did not report is not reported: no series, rather than a zero.
    assert not [k for k in seen if k.startswith("guard_untrained_")], seen
    state = httpx.get(f"{live_server.url}/v1/runs/{run_id}", timeout=10).json()
    latest = state["ranks"][0]["latest"]
    assert latest["untrained_rows"] is None and latest["untrained_tokens"] is None


@pytest.mark.parametrize("version", VERSIONS)
def test_todays_report_lowered_is_what_each_release_reads(version: int) -> None:
    old = released_models(version).ReportBatch
    today = todays_report()
    with pytest.raises(ValidationError):  # as it is: what made every push a 422
        old.model_validate_json(today.model_dump_json())
    report = old.model_validate(lowered(today, version)).reports[0]
    assert report.step == today.reports[0].step
    assert report.violations == {"vocab": {"fail": 0}}  # the check it lacks is not reported
    assert report.halted is None and report.events == []


def test_the_recorded_models_are_that_releases() -> None:
    if shutil.which("git") is None:
        pytest.skip("no git")
    done = subprocess.run(["git", "show", "3975781^1:server/guard_server/wire.py"],
                          capture_output=True, cwd=RECORDED, check=False)
    if done.returncode != 0:
        pytest.skip("the history is not in this clone (shallow)")
    assert done.stdout == (RECORDED / "v1/wire.py").read_bytes()


def test_fields_this_server_does_not_know_cost_no_report(
        live_server: EmbeddedServer, make_batch: Any, caplog: pytest.LogCaptureFixture) -> None:
    batch = make_batch("newer", 0, steps=(1, 2, 3), grad_norm=0.5)
    for report in batch["reports"]:
        report["nonfinite"]["grad"] = 0
    batch["sent_by"] = "guard 9"
    with caplog.at_level(logging.WARNING, logger="guard_server"):
        assert post(live_server, json.dumps(batch).encode()).status_code == 202
        assert post(live_server, json.dumps(batch).encode()).status_code == 202
    seen = samples(live_server, "newer")
    assert seen['guard_step{rank="0",run_id="newer"}'] == "3.0"
    text = httpx.get(f"{live_server.url}/metrics", timeout=10).text
    for field, n in (("reports.grad_norm", 6), ("reports.nonfinite.grad", 6), ("sent_by", 2)):
        assert f'guard_ingest_unknown_fields_total{{field="{field}"}} {n:.1f}' in text
    said = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(said) == 3 and any("reports.grad_norm" in m for m in said)  # once per name


def test_a_sender_cannot_grow_the_unknown_names(live_server: EmbeddedServer,
                                                make_batch: Any) -> None:
    batch = make_batch("names", 0) | {f"f{i}": 0 for i in range(200)} | {"\nforged 1": 0}
    assert post(live_server, json.dumps(batch).encode()).status_code == 202
    text = httpx.get(f"{live_server.url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines()
             if line.startswith("guard_ingest_unknown_fields_total{")]
    assert len(lines) == MAX_NAMES + 1 and 'field="other"} 169.0' in text
    assert "forged" not in text


def test_a_wrong_value_beside_unknown_fields_is_a_422_that_names_it(
        live_server: EmbeddedServer, make_batch: Any) -> None:
    batch = make_batch("bad", 0, grad_norm=1.0, step=-1)
    answer = post(live_server, json.dumps(batch).encode())
    assert answer.status_code == 422
    assert [e["loc"] for e in answer.json()["detail"]] == [["body", "reports", 0, "step"]]
