"""Bodies whose fields the server does not know, or whose shape no batch has, against one real
`python -m guard_server` (issue 41, item 2): each refused with a 422 that names its bound before
it is parsed, within the memory and CPU time docs/server.md states for the body being read
("Memory and scrape time"), nothing stored, no traceback; a newer guard's few fields still
cost its batch nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import MakeBatch
from tests.server.helpers import cpu_seconds, proc_status, server_subprocess

JSON = {"Content-Type": "application/json"}
MiB = 1 << 20
# docs/server.md: the one body parsed at a time holds at most 16x its size (16 MiB for the
# default 1 MiB limit); a refusal before parsing, far less. CPU: what taking one costs.
MAX_GROWTH = 16 * MiB
MAX_CPU_S = 1.0  # for all of the hostile bodies below together (measured: ~0.2 s)


def _hostile(make_batch: MakeBatch) -> dict[str, tuple[bytes, str]]:
    """Bodies of ~1 MiB, and the bound that refuses each."""
    report = make_batch()["reports"][0]

    def body(**fields: Any) -> bytes:
        doc = make_batch("hostile") | fields
        return json.dumps(doc, separators=(",", ":")).encode()

    return {
        # 96,000 unknown fields in one report: took 0.65-2.9 s and ~105 MiB to read.
        "unknown fields": (body(reports=[report | {f"f{i}": 0 for i in range(96_000)}]),
                           "GUARD_SERVER_MAX_UNKNOWN_FIELDS"),
        # One unknown field, 1 MiB of small objects: pydantic's tree of it, and its copy.
        "an unknown value": (body(reports=[report | {"x": [{"a": 0}] * 120_000}]),
                             "GUARD_SERVER_MAX_UNKNOWN_BYTES"),
        # 64 unknown fields in each of 700 reports: each within the count, not together.
        "unknown in every report": (body(reports=[report | {f"f{i}": [0, 0] for i in range(64)}]
                                         * 700), "GUARD_SERVER_MAX_UNKNOWN_BYTES"),
        # Shapes no batch has: lists past the wire's lengths, keys past the names.
        "120,000 reports": (body(reports=[{"a": 0}] * 120_000), "more than 1000 items"),
        "120,000 events": (body(reports=[report | {"events": [{"a": 0}] * 120_000}]),
                           "more than 32 items"),
        "80,000 checks": (body(reports=[report | {"violations": {f"x{i}": {} for i in
                                                                  range(80_000)}}]),
                          "more than 9 keys"),
        "500,000 numbers as reports": (body(reports=[0] * 500_000),
                                       "a value where the wire has an object"),
    }


def test_hostile_bodies_are_refused_before_they_are_parsed(tmp_path: Path,
                                                           make_batch: MakeBatch) -> None:
    hostile = _hostile(make_batch)
    with server_subprocess(tmp_path, {}, 256 * MiB) as (url, process, log), \
            httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/v1/reports", json=make_batch("warm")).status_code == 202
        rss, cpu = proc_status(process.pid, "VmRSS"), cpu_seconds(process.pid)
        for name, (body, bound) in hostile.items():
            assert len(body) <= MiB, name
            reply = client.post("/v1/reports", content=body, headers=JSON)
            assert reply.status_code == 422 and bound in reply.text, (name, reply.text[:300])
        grown = proc_status(process.pid, "VmHWM") - rss
        spent = cpu_seconds(process.pid) - cpu
        assert client.get("/healthz").json()["runs"] == 1  # nothing stored of them
        # A newer guard's few fields: stored without them, counted.
        newer = make_batch("newer", z_loss=1.5, router={"balance": 0.1})
        assert client.post("/v1/reports", json=newer).status_code == 202
        metrics = client.get("/metrics").text
    assert 'guard_ingest_unknown_fields_total{field="reports.z_loss"} 1.0' in metrics
    assert f'guard_ingest_rejected_total{{reason="invalid"}} {float(len(hostile))}' in metrics
    assert grown <= MAX_GROWTH, f"grew {grown / MiB:.1f} MiB"
    assert spent <= MAX_CPU_S, f"{spent:.2f} s of CPU"
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
