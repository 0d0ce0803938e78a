"""The wire models accept the documented example and reject everything outside its bounds."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from guard_server.wire import (
    ACTIONS,
    CHECKS,
    MAX_BATCH_REPORTS,
    MAX_COUNT,
    MAX_EVENTS,
    MAX_MESSAGE,
    MAX_MODULE,
    RUN_ID_PATTERN,
    ReportBatch,
    StepReport,
    since,
)


def test_the_documented_example_validates(wire_example: dict[str, Any]) -> None:
    batch = ReportBatch.model_validate_json(json.dumps(wire_example))
    report = batch.reports[0]
    assert (batch.run_id, batch.rank, report.step) == ("gpt-small-001", 0, 120)
    assert report.violations == {"token_range": {"warn": 1}}
    assert report.events[0].check == "token_range"
    assert batch.model_dump(mode="json") == wire_example


def _set(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


R = ("reports", 0)
BAD: list[tuple[tuple[str | int, ...], Any, str | None]] = [
    (("run_id",), "", "string_too_short"),
    (("run_id",), "x" * 129, "string_too_long"),
    (("run_id",), "has space", "string_pattern_mismatch"),
    (("rank",), -1, "greater_than_equal"),
    (("rank",), 65536, "less_than_equal"),
    (("rank",), "0", "int_type"),  # strict: no string-to-int coercion
    (("rank",), True, "int_type"),
    (("reports",), [], "too_short"),
    ((*R, "step"), -1, "greater_than_equal"),
    ((*R, "step"), 1.5, "int_type"),
    ((*R, "step"), 3.0, None),  # JSON Schema calls 3.0 an integer, so the server does too
    ((*R, "padding_mass"), 1.5, "less_than_equal"),
    ((*R, "padding_mass"), -0.1, "greater_than_equal"),
    ((*R, "nonfinite", "logits"), 2**53 + 1, "less_than_equal"),
    ((*R, "nonfinite", "logits"), 10**400, "less_than_equal"),
    ((*R, "nonfinite", "extra"), 0, "extra_forbidden"),
    ((*R, "violations", "bogus"), {"warn": 1}, "literal_error"),
    ((*R, "violations", "vocab"), {"off": 1}, "literal_error"),
    ((*R, "halted"), "everything", "literal_error"),
    ((*R, "final"), "true", "bool_type"),
    ((*R, "events"), [], None),  # control: valid
    ((*R, "events", 0, "message"), "m" * 4097, "string_too_long"),
    ((*R, "events", 0, "module"), "m" * 257, "string_too_long"),
    ((*R, "unknown_field"), 1, "extra_forbidden"),
    (("unknown_field",), 1, "extra_forbidden"),
]


@pytest.mark.parametrize(
    ("path", "value", "error"), BAD, ids=[".".join(map(str, b[0])) for b in BAD]
)
def test_out_of_bounds_values_name_the_field(
    wire_example: dict[str, Any], path: tuple[str | int, ...], value: Any, error: str | None
) -> None:
    doc = json.dumps(_set(wire_example, path, value))
    if error is None:
        ReportBatch.model_validate_json(doc)
        return
    with pytest.raises(ValidationError) as info:
        ReportBatch.model_validate_json(doc)
    (err,) = info.value.errors()
    assert err["type"] == error
    assert tuple(err["loc"][: len(path)]) == path or err["loc"][-1] == "[key]"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_floats_are_rejected(wire_example: dict[str, Any], literal: str) -> None:
    doc = json.dumps(wire_example).replace('"loss": 2.13', f'"loss": {literal}')
    with pytest.raises(ValidationError) as info:
        ReportBatch.model_validate_json(doc)
    assert info.value.errors()[0]["loc"] == ("reports", 0, "loss")


# Fields added to StepReport after its first release, each with the wire version of its
# Since(N): optional, absent = not reported.
ADDED_LATER = {"untrained_rows": 2, "untrained_tokens": 2, "grad_norm": 3, "grad_norm_top": 3,
               "grad_norm_top_share": 3, "logsumexp": 3, "logsumexp_max": 3,
               "scaler_skipped_steps": 3, "padding_mass_bound": 3}


def test_every_field_of_the_first_release_is_required(wire_example: dict[str, Any]) -> None:
    # A field added since (Since(N) > 1) is optional: an older guard's reports lack it.
    report = wire_example["reports"][0]
    assert {n: since(f) for n, f in StepReport.model_fields.items() if not f.is_required()} \
        == ADDED_LATER
    for field in report:
        doc = copy.deepcopy(wire_example)
        del doc["reports"][0][field]
        if since(StepReport.model_fields[field]) > 1:
            assert getattr(ReportBatch.model_validate(doc).reports[0], field) is None
            continue
        with pytest.raises(ValidationError) as info:
            ReportBatch.model_validate(doc)
        assert info.value.errors()[0]["loc"] == ("reports", 0, field)
    doc = copy.deepcopy(wire_example)
    del doc["reports"][0]["nonfinite"]["grad"]  # a client whose gradients are not checked
    assert ReportBatch.model_validate(doc).reports[0].nonfinite.grad is None


def test_list_bounds(make_batch: Any, wire_example: dict[str, Any]) -> None:
    ReportBatch.model_validate(make_batch(steps=tuple(range(1000))))
    with pytest.raises(ValidationError, match="at most 1000"):
        ReportBatch.model_validate(make_batch(steps=tuple(range(1001))))
    event = wire_example["reports"][0]["events"][0]
    ReportBatch.model_validate(make_batch(events=[event] * 32))
    with pytest.raises(ValidationError, match="at most 32"):
        ReportBatch.model_validate(make_batch(events=[event] * 33))


@pytest.mark.parametrize("heavy", ["fastapi", "starlette", "uvicorn", "prometheus_client"])
def test_importing_the_wire_pulls_in_no_server_framework(heavy: str) -> None:
    # The library imports guard_server.wire; the server's own dependencies must not follow.
    code = f"import guard_server.wire, sys; print({heavy!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_models_enforce_the_exported_limits() -> None:
    # Read back from the JSON schema: what the OpenAPI document tells clients, not what we hope.
    schema = ReportBatch.model_json_schema()
    defs = schema["$defs"]
    reports = schema["properties"]["reports"]
    events = defs["StepReport"]["properties"]["events"]
    event = defs["Event"]["properties"]
    module = next(s for s in event["module"]["anyOf"] if s.get("type") == "string")
    assert (reports["minItems"], reports["maxItems"]) == (1, MAX_BATCH_REPORTS)
    assert events["maxItems"] == MAX_EVENTS
    assert event["message"]["maxLength"] == MAX_MESSAGE
    assert module["maxLength"] == MAX_MODULE
    assert defs["NonFinite"]["properties"]["logits"]["maximum"] == MAX_COUNT
    assert schema["properties"]["run_id"]["pattern"] == RUN_ID_PATTERN
    assert event["check"]["enum"] == list(CHECKS)
    assert event["action"]["enum"] == list(ACTIONS)


def _field_rows(doc: str) -> dict[str, str]:
    """docs/wire.md's field table: each backticked field name of a row -> the whole row."""
    rows: dict[str, str] = {}
    for line in doc.splitlines():
        if line.startswith("| `"):
            names = line.split("|")[1]
            for name in names.replace("`", "").split(","):
                rows[name.strip()] = line
    return rows


def test_the_doc_names_every_field_value_and_limit_of_the_wire() -> None:
    """docs/wire.md is written by hand: every field of the models, every check and action
    name, and every limit with its constant must be in it, so it cannot drift from wire.py."""
    from guard_server import wire
    from tests.server.conftest import WIRE_DOC

    doc = WIRE_DOC.read_text()
    rows = _field_rows(doc)
    fields = {*wire.ReportBatch.model_fields, *wire.StepReport.model_fields}
    fields |= {f"events[].{n}" for n in wire.Event.model_fields}
    assert fields - set(rows) == set()
    for name in (*CHECKS, *ACTIONS):
        assert f"`{name}`" in rows["violations"] or f" {name}" in rows["violations"], name
    assert "`CHECKS`" in rows["violations"] and "`ACTIONS`" in rows["violations"]
    assert all(name in rows["halted"] for name in ("check name", "CHECKS"))
    limits = {"MAX_BATCH_REPORTS": MAX_BATCH_REPORTS, "MAX_EVENTS": MAX_EVENTS,
              "MAX_MESSAGE": MAX_MESSAGE, "MAX_MODULE": MAX_MODULE}
    for constant, value in limits.items():
        assert f"{value}" in doc and f"`{constant}`" in doc, constant
    assert MAX_COUNT == 2**53 and "2**53 (`MAX_COUNT`" in doc
    assert "`RUN_ID_PATTERN`" in doc and "`ATTACH_ID_PATTERN`" in doc
    run_id = wire.ReportBatch.model_fields["run_id"].metadata
    assert RUN_ID_PATTERN.strip("^$").replace("{1,128}", "") in doc.replace("1–128 chars, ", "")
    assert any("128" in str(m) for m in run_id) and "1–128 chars" in rows["run_id"]
    assert "0–65535" in rows["rank"]
