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


# Per release, what it did not report yet: its series and its report fields.
NOT_YET: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    1: (("guard_untrained_", "guard_grad_norm", "guard_logsumexp", "guard_scaler_",
         'tensor="grad"'), ("untrained_rows", "untrained_tokens", "grad_norm")),
    2: (("guard_grad_norm", "guard_logsumexp", "guard_scaler_", 'tensor="grad"'),
        ("grad_norm", "logsumexp", "scaler_skipped_steps")),
}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_report_of_each_release_is_taken_by_todays_server(
        live_server: EmbeddedServer, version: int) -> None:
    body = recorded_report(version)
    run_id = json.loads(body)["run_id"]
    answer = post(live_server, body)
    assert answer.status_code == 202, answer.text  # before: 422, the newer fields missing
    assert answer.headers[WIRE_VERSION_HEADER] == str(WIRE_VERSION)
    seen = samples(live_server, run_id)
    assert seen[f'guard_step{{rank="0",run_id="{run_id}"}}'] == "2.0"
    # What that release did not report is not reported: no series, rather than a zero.
    series, fields = NOT_YET[version]
    assert not [k for k in seen if any(s in k for s in series)], seen
    state = httpx.get(f"{live_server.url}/v1/runs/{run_id}", timeout=10).json()
    latest = state["ranks"][0]["latest"]
    assert all(latest[f] is None for f in fields) and latest["nonfinite"]["grad"] is None


@pytest.mark.parametrize("version", VERSIONS)
def test_todays_report_lowered_is_what_each_release_reads(version: int) -> None:
    old = released_models(version).ReportBatch
    today = todays_report()
    with pytest.raises(ValidationError):  # as it is: what made every push a 422
        old.model_validate_json(today.model_dump_json())
    report = old.model_validate(lowered(today, version)).reports[0]
    assert report.step == today.reports[0].step
    if version == 1:  # the check it lacks is not reported
        assert report.violations == {"vocab": {"fail": 0}}
        assert report.halted is None and report.events == []
    else:  # it knows untrained_rows, not the gradients
        assert report.halted == "untrained_rows" and report.untrained_rows is not None
        assert not hasattr(report, "grad_norm")
        assert "grad" not in type(report.nonfinite).model_fields


@pytest.mark.parametrize(("version", "tree"), [(1, "3975781^1"), (2, "37bce87")])
def test_the_recorded_models_are_that_releases(version: int, tree: str) -> None:
    if shutil.which("git") is None:
        pytest.skip("no git")
    done = subprocess.run(["git", "show", f"{tree}:server/guard_server/wire.py"],
                          capture_output=True, cwd=RECORDED, check=False)
    if done.returncode != 0:
        pytest.skip("the history is not in this clone (shallow)")
    assert done.stdout == (RECORDED / f"v{version}/wire.py").read_bytes()


def test_fields_this_server_does_not_know_cost_no_report(
        live_server: EmbeddedServer, make_batch: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A field and a nested one of a wire this server does not read yet.
    batch = make_batch("newer", 0, steps=(1, 2, 3), z_loss=0.5)
    for report in batch["reports"]:
        report["nonfinite"]["router"] = 0
    batch["sent_by"] = "guard 9"
    with caplog.at_level(logging.WARNING, logger="guard_server"):
        assert post(live_server, json.dumps(batch).encode()).status_code == 202
        assert post(live_server, json.dumps(batch).encode()).status_code == 202
    seen = samples(live_server, "newer")
    assert seen['guard_step{rank="0",run_id="newer"}'] == "3.0"
    text = httpx.get(f"{live_server.url}/metrics", timeout=10).text
    for field, n in (("reports.z_loss", 6), ("reports.nonfinite.router", 6), ("sent_by", 2)):
        assert f'guard_ingest_unknown_fields_total{{field="{field}"}} {n:.1f}' in text
    said = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(said) == 3 and any("reports.z_loss" in m for m in said)  # once per name


def test_a_sender_cannot_grow_the_unknown_names(live_server: EmbeddedServer,
                                                make_batch: Any) -> None:
    # 63 names: within GUARD_SERVER_MAX_UNKNOWN_FIELDS (64), past MAX_NAMES (32).
    batch = make_batch("names", 0) | {f"f{i}": 0 for i in range(62)} | {"\nforged 1": 0}
    assert post(live_server, json.dumps(batch).encode()).status_code == 202
    text = httpx.get(f"{live_server.url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines()
             if line.startswith("guard_ingest_unknown_fields_total{")]
    assert len(lines) == MAX_NAMES + 1 and 'field="other"} 31.0' in text
    assert "forged" not in text


def test_a_wrong_value_beside_unknown_fields_is_a_422_that_names_it(
        live_server: EmbeddedServer, make_batch: Any) -> None:
    batch = make_batch("bad", 0, z_loss=1.0, step=-1)
    answer = post(live_server, json.dumps(batch).encode())
    assert answer.status_code == 422
    assert [e["loc"] for e in answer.json()["detail"]] == [["body", "reports", 0, "step"]]
