"""guard_server/shape.py on plain bytes: what it finds of a body before pydantic reads it (the
fields it does not know, their bytes), what it refuses, and what it leaves to pydantic."""

from __future__ import annotations

import json
from typing import Any

import pytest

from guard_server.shape import SCAN_ABOVE, ShapeError, read_batch, unknown_fields
from tests.server.conftest import MakeBatch


def _scan(doc: Any, fields: int = 64, size: int = 1 << 20) -> tuple[list[str], int]:
    found = unknown_fields(json.dumps(doc).encode(), fields, size)
    return found.names, found.size


def test_a_batch_of_this_wire_has_no_unknown_field(wire_example: Any) -> None:
    assert _scan(wire_example) == ([], 0)
    # As the library's push sink writes it, and with escapes JSON allows in keys and strings.
    text = json.dumps(wire_example, ensure_ascii=True).replace('"step"', '"\\u0073tep"')
    assert unknown_fields(text.encode(), 0, 0).names == []


def test_a_newer_guards_fields_are_named_by_their_path(make_batch: MakeBatch) -> None:
    doc = make_batch(z_loss=1.5, nonfinite={"logits": 0, "hidden": 0, "loss": 0, "router": 2})
    doc["sent_by"] = "guard 9"
    names, size = _scan(doc)
    assert names == ["reports.nonfinite.router", "reports.z_loss", "sent_by"]  # in body order
    # Each the last of its object: its key, its value, nothing after them.
    assert size == sum(len(f'"{k}": {json.dumps(v)}') for k, v in
                       (("sent_by", "guard 9"), ("z_loss", 1.5), ("router", 2)))


@pytest.mark.parametrize(("fields", "bound"), [
    ({f"f{i}": 0 for i in range(65)}, "GUARD_SERVER_MAX_UNKNOWN_FIELDS=64"),
    ({"x": "y" * 2000}, "GUARD_SERVER_MAX_UNKNOWN_BYTES=1024"),
])
def test_past_the_bounds_is_a_shape_error_naming_the_setting(
        make_batch: MakeBatch, fields: dict[str, Any], bound: str) -> None:
    with pytest.raises(ShapeError, match=bound) as info:
        _scan(make_batch(**fields), 64, 1024)
    assert info.value.kind == "unknown_fields"


@pytest.mark.parametrize(("change", "loc", "says"), [
    ({"reports": [{}] * 1001}, ("reports",), "more than 1000 items"),
    ({"reports": [1, {}]}, ("reports",), "a value where the wire has an object"),
    ({"loss": {"a": 1}}, ("reports", 0, "loss"), "an object where the wire has a value"),
    ({"events": {}}, ("reports", 0, "events"), "an object where the wire has another kind"),
    ({"violations": {f"c{i}": {} for i in range(10)}}, ("reports", 0, "violations"),
     "more than 9 keys"),
])
def test_shapes_no_batch_has(make_batch: MakeBatch, change: dict[str, Any],
                             loc: tuple[str | int, ...], says: str) -> None:
    doc = make_batch()
    if "reports" in change:
        doc |= change
    else:
        doc["reports"][0] |= change
    with pytest.raises(ShapeError, match=says) as info:
        _scan(doc)
    assert info.value.loc == loc


@pytest.mark.parametrize("body", [b"", b"not json", b'{"a": "unterminated', b"}}}", b"1"])
def test_what_is_not_json_is_left_to_pydantic(body: bytes) -> None:
    unknown_fields(body, 64, 1024)  # no error of its own: pydantic says what is wrong


@pytest.mark.parametrize("reports", [1, 400])  # below and above SCAN_ABOVE
def test_read_batch_stores_what_it_knows(make_batch: MakeBatch, reports: int) -> None:
    doc = make_batch(steps=tuple(range(1, reports + 1)), z_loss=0.5)
    body = json.dumps(doc).encode()
    assert (len(body) > SCAN_ABOVE) == (reports > 1)
    batch, unknown = read_batch(body, 64, 1 << 20)
    assert len(batch.reports) == reports and unknown == ["reports.z_loss"] * reports
    assert "z_loss" not in batch.model_dump_json()
