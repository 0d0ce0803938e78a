"""A policy from a file (YAML, TOML, JSON), a dict or nothing, validated at the edge: every
problem names the key and what was expected, and the file it came from."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from guard.errors import PolicyError
from guard.policy import Policy

__all__ = ["load_policy"]


def _describe(err: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "<top>"
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"{where}: unknown key"
    if kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        choices = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if allowed else "?"
        return f"{where}: {err['input']!r} is not allowed; choose {choices}"
    if kind == "value_error":
        return f"{where}: {str(err['msg']).removeprefix('Value error, ')}"
    return f"{where}: {err['msg']} (got {err.get('input')!r})"


def _allowed_keys(loc: tuple[Any, ...]) -> str:
    model: Any = Policy
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        if field is None:
            return ""
        model = field.annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        return "; allowed keys: " + ", ".join(model.model_fields)
    return ""


def _validate(data: Any, source: str) -> Policy:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        got = type(data).__name__
        raise PolicyError(source, [f"<top>: expected a mapping of sections, got {got}"])
    try:
        return Policy.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = _describe(dict(err))
            if err["type"] == "extra_forbidden":
                msg += _allowed_keys(tuple(err["loc"]))
            problems.append(msg)
        raise PolicyError(source, problems) from None


def _read(path: str | os.PathLike[str]) -> Policy:
    """Read a YAML (.yaml/.yml), TOML (.toml) or JSON (.json) policy file."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        expected = "use .yaml, .yml, .toml or .json"
        raise PolicyError(str(p), [f"unknown extension {suffix!r}; {expected}"])
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PolicyError(str(p), [f"cannot read: {e.strerror or e}"]) from None
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise PolicyError(str(p), [f"not valid {suffix[1:].upper()}: {e}"]) from None
    return _validate(data, str(p))


def load_policy(policy: Policy | dict[str, Any] | str | os.PathLike[str] | None) -> Policy:
    """A Policy from a file (YAML .yaml/.yml, TOML .toml, JSON .json), a dict, a Policy (as it
    is) or None (the defaults); a PolicyError names the source and every bad key."""
    if policy is None:
        return Policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, dict):
        return _validate(policy, "<dict>")
    if isinstance(policy, str | os.PathLike):
        return _read(policy)
    got = type(policy).__name__
    raise PolicyError("<argument>", [f"policy must be a Policy, dict or path, got {got}"])
