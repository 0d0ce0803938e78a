"""Every number of the policy has a documented range (docs/checks.md, "Policy keys and their
ranges"), held to the models here so the two cannot drift, and a value outside it is a
PolicyError naming the key and quoting the value, never a raw error at attach (issue 41,
item 6: a window of 10**12 asked the device for 8 TB, duplicates 2**63 wrapped there)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types as at
import pytest
from pydantic import BaseModel

import guard
from guard.policy import Policy
from guard.quote import quote
from tests.conftest import policy, tiny_gpt

DOC = Path(__file__).resolve().parents[2] / "docs" / "checks.md"
Bounds = tuple[float, bool, float, bool]  # low, low included, high, high included


def _numbers(model: type[BaseModel] = Policy, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key, field) of every number of the policy, sections walked in order."""
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from _numbers(kind, f"{path}{name}.")
        elif kind in (int, float, int | None, float | None):
            yield path + name, field


def _value(text: str) -> float:
    assert re.fullmatch(r"[-0-9e.* ]+", text), text  # numbers, powers and a difference only
    return eval(text, {"__builtins__": {}})  # type: ignore[no-any-return]


def _documented() -> dict[str, tuple[str, Bounds]]:
    table = DOC.read_text().split("## Policy keys and their ranges", 1)[1]
    rows = re.findall(r"^\| `([a-z_.]+)` \| ([^|]+) \| ([\[(])([^,]+), ([^\])]+)([\])]) \|",
                      table, re.M)
    return {key: (default.strip(), (_value(lo), a == "[", _value(hi), b == "]"))
            for key, default, a, lo, hi, b in rows}


def _bounds(field: Any) -> Bounds:
    found: dict[str, tuple[float, bool]] = {}
    for m in field.metadata:
        for kind, name, included in ((at.Ge, "ge", True), (at.Gt, "gt", False),
                                     (at.Le, "le", True), (at.Lt, "lt", False)):
            if isinstance(m, kind):
                found["low" if name[0] == "g" else "high"] = (getattr(m, name), included)
    assert set(found) == {"low", "high"}, "every number has both bounds"
    return (*found["low"], *found["high"])


def test_the_documented_ranges_are_the_models() -> None:
    documented = _documented()
    numbers = dict(_numbers())
    assert sorted(documented) == sorted(numbers)  # every number, and only numbers
    for key, field in numbers.items():
        default, bounds = documented[key]
        assert bounds == _bounds(field), key
        text = default.split(" (")[0]
        assert (None if text == "none" else _value(text)) == field.default, key


def _outside(key: str) -> list[object]:
    """Values just past each bound of `key`, and far past them (each is refused)."""
    low, low_in, high, high_in = _bounds(dict(_numbers())[key])
    integer = isinstance(low, int) and isinstance(high, int)
    step = 1 if integer else max(abs(low), abs(high), 1.0) * 1e-9
    return [low - step if low_in else low, high + step if high_in else high,
            high * 10**30 if integer else 1e308, -(10**30) if integer else -1e308]


def _nested(key: str, value: object) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    *sections, name = key.split(".")
    node = doc
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = value
    return doc


@pytest.mark.parametrize("key", [key for key, _ in _numbers()])
def test_a_number_outside_its_range_is_an_error_naming_the_key(key: str) -> None:
    for value in _outside(key):
        with pytest.raises(guard.PolicyError) as info:
            guard.load_policy(_nested(key, value))
        message = str(info.value)
        assert f"{key}: " in message and f"(got {quote(value)})" in message, (value, message)


@pytest.mark.parametrize(("key", "value"), [
    ("checks.loss_spike.window", 10**12),  # a raw RuntimeError at attach: 8 TB on the device
    ("checks.loss_spike.window", 10**30),  # a raw TypeError
    ("checks.loss_spike.warmup", 10**30),
    ("checks.untrained_rows.duplicates", 2**63),  # accepted, and wrapped on the device
    ("checks.untrained_rows.duplicates", 2**64 + 2),  # a raw OverflowError
    ("checks.untrained_rows.epsilon", 1e308),  # accepted, and "repaired" every row
])
def test_what_attach_took_is_a_policy_error(key: str, value: object) -> None:
    p = policy() | _nested(key, value) | {"export": {"serve": None}}
    with pytest.raises(guard.PolicyError, match=re.escape(key)):
        guard.attach(tiny_gpt(), policy=p)


def test_the_largest_window_attaches_and_trains() -> None:
    p = policy(loss_spike={"window": 10_000, "warmup": 10_000})
    with guard.attach(tiny_gpt(), policy=p | {"export": {"serve": None}}) as g:
        assert g.policy.checks.loss_spike.window == 10_000
