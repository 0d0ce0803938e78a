"""The HTTP routes over a TestClient: statuses, bodies, and nothing stored on a reject."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from guard_server import Settings, Store, create_app
from tests.server.helpers import split_ingest_counters

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}
AUTH_JSON = AUTH | JSON


@pytest.fixture
def guarded(make_batch: Any, clock: Any) -> Iterator[TestClient]:
    """An app with a token and caps of 2 runs x 2 ranks, holding run a (ranks 0, 1) and run b."""
    settings = Settings(token=TOKEN, max_runs=2, max_ranks_per_run=2, max_body_bytes=4096)
    with TestClient(create_app(settings, Store(settings, clock=clock))) as client:
        for run_id, rank in (("a", 0), ("a", 1), ("b", 0)):
            reply = client.post("/v1/reports", json=make_batch(run_id, rank), headers=AUTH)
            assert reply.status_code == 202
        yield client


def _series(client: TestClient) -> tuple[str, dict[str, float]]:
    return split_ingest_counters(client.get("/metrics").text)


def test_accepts_a_batch_and_serves_its_state(client: TestClient, wire_example: Any) -> None:
    reply = client.post("/v1/reports", json=wire_example)
    assert (reply.status_code, reply.json()) == (202, {"accepted": 1})
    assert client.get("/v1/runs").json()["runs"][0] | {"last_report_time": 0} == {
        "run_id": "gpt-small-001",
        "ranks": 1,
        "finished_ranks": 0,
        "last_step": 120,
        "last_report_time": 0,
    }
    (rank,) = client.get("/v1/runs/gpt-small-001").json()["ranks"]
    assert (rank["rank"], rank["step"], rank["finished"]) == (0, 120, False)
    assert rank["latest"]["out_of_range"] == {"input": 0, "label": 3}
    assert rank["recent_events"] == wire_example["reports"][0]["events"]
    assert "module" in rank["recent_events"][0]
    missing = client.get("/v1/runs/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]


def test_metrics_in_text_and_openmetrics(client: TestClient, wire_example: Any) -> None:
    client.post("/v1/reports", json=wire_example)
    text = client.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'guard_step{rank="0",run_id="gpt-small-001"} 120.0' in text.text
    om = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n") and "# TYPE guard_violations counter" in om.text


def test_health_and_readiness(make_batch: Any) -> None:
    app = create_app(Settings())
    assert TestClient(app).get("/readyz").status_code == 503  # lifespan not started
    with TestClient(app) as client:
        client.post("/v1/reports", json=make_batch())
        assert client.get("/healthz").json() == {"status": "ok", "runs": 1, "ranks": 1}
        assert client.get("/readyz").json() == {"status": "ready", "runs": 1, "ranks": 1}


def _body(make_batch: Any, **change: Any) -> bytes:
    return json.dumps(make_batch() | change).encode()


BAD: list[tuple[str, int, str, Callable[[Any], bytes], dict[str, str]]] = [
    # (case, status, reject reason counted, body from make_batch, headers)
    ("no token", 401, "unauthorized", _body, {}),
    ("wrong token", 401, "unauthorized", _body, {"Authorization": "Bearer t0kem"}),
    ("not bearer", 401, "unauthorized", _body, {"Authorization": f"Basic {TOKEN}"}),
    ("malformed json", 422, "invalid", lambda mb: b'{"run_id": "a", "rank": ', AUTH_JSON),
    ("empty body", 422, "invalid", lambda mb: b"", AUTH_JSON),
    ("wrong type", 422, "invalid", lambda mb: _body(mb, rank="zero"), AUTH_JSON),
    # A field it does not know costs a batch nothing (docs/wire.md, "Versions"); a wrong one
    # beside it still does.
    ("unknown field", 422, "invalid", lambda mb: _body(mb, extra=1, rank="zero"), AUTH_JSON),
    ("oversize", 413, "too_large", lambda mb: _body(mb, run_id="a" * 128) * 8, AUTH_JSON),
    ("new run over cap", 429, "over_capacity", lambda mb: _body(mb, run_id="c"), AUTH_JSON),
    ("new rank over cap", 429, "over_capacity", lambda mb: _body(mb, rank=2), AUTH_JSON),
    # What a web page can send cross-site without a CORS preflight: not JSON, refused.
    ("no content type", 415, "not_json", _body, AUTH),
    ("text/plain", 415, "not_json", _body, AUTH | {"Content-Type": "text/plain"}),
    ("form", 415, "not_json", _body,
     AUTH | {"Content-Type": "application/x-www-form-urlencoded"}),
    ("multipart", 415, "not_json", _body, AUTH | {"Content-Type": "multipart/form-data; b=x"}),
    ("forged step", 409, "implausible_step",
     lambda mb: json.dumps(mb("a", 0, steps=(2**53,))).encode(), AUTH_JSON),
]


@pytest.mark.parametrize(
    ("case", "status", "reason", "body", "headers"), BAD, ids=[b[0] for b in BAD]
)
def test_a_rejected_request_changes_nothing_but_its_counter(
    guarded: TestClient,
    make_batch: Any,
    case: str,
    status: int,
    reason: str,
    body: Callable[[Any], bytes],
    headers: dict[str, str],
) -> None:
    metrics_before, rejected_before = _series(guarded)
    runs_before = guarded.get("/v1/runs").json()
    reply = guarded.post("/v1/reports", content=body(make_batch), headers=headers)
    assert reply.status_code == status, reply.text
    metrics_after, rejected_after = _series(guarded)
    assert metrics_after == metrics_before
    assert guarded.get("/v1/runs").json() == runs_before
    assert rejected_after == rejected_before | {reason: rejected_before[reason] + 1}


def test_errors_say_what_and_where(guarded: TestClient, make_batch: Any) -> None:
    bad = make_batch("a", 0)
    bad["reports"][0]["padding_mass"] = 2.0
    detail = guarded.post("/v1/reports", json=bad, headers=AUTH).json()["detail"]
    assert detail == [
        {
            "type": "less_than_equal",
            "loc": ["body", "reports", 0, "padding_mass"],
            "msg": "Input should be less than or equal to 1",
        }
    ]
    unauthorized = guarded.post("/v1/reports", json=make_batch())
    assert unauthorized.headers["www-authenticate"] == "Bearer"
    over = guarded.post("/v1/reports", json=make_batch("c"), headers=AUTH).json()["detail"]
    assert "GUARD_SERVER_MAX_RUNS" in over and "nothing was stored" in over
