"""A policy from a file (YAML, TOML, JSON), a dict or nothing, validated at the edge: every
problem names the key and what was expected, and the file it came from."""

from __future__ import annotations

import codecs
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
from guard.quote import quote

__all__ = ["load_policy"]

# A parser's message quotes the line it stopped at; a minified file is one line.
_MAX_PARSER_MESSAGE = 300


def _describe(err: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "<top>"
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"{where}: unknown key"
    if kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        choices = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if allowed else "?"
        return f"{where}: {quote(err['input'])} is not allowed; choose {choices}"
    if kind == "value_error":
        return f"{where}: {str(err['msg']).removeprefix('Value error, ')}"
    # Quoted within bounds: a YAML alias bomb is a few hundred bytes that expand to gigabytes.
    return f"{where}: {err['msg']} (got {quote(err.get('input'))})"


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
        raw = p.read_bytes()
    except OSError as e:
        raise PolicyError(str(p), [f"cannot read: {e.strerror or e}"]) from None
    text = _decode(raw, str(p))
    fmt = suffix[1:].upper().replace("YML", "YAML")
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    # ValueError: the decode errors of json and tomllib, and an integer of more than 4300
    # digits in any of the three (int() refuses to read it).
    except (yaml.YAMLError, ValueError) as e:
        raise PolicyError(str(p), [f"not valid {fmt}: {str(e)[:_MAX_PARSER_MESSAGE]}"]) from None
    except RecursionError:
        raise PolicyError(str(p), [f"not a policy: {fmt} nested too deeply to read (a policy "
                                   "is three levels deep)"]) from None
    return _validate(data, str(p))


def _decode(raw: bytes, source: str) -> str:
    """The file's text: UTF-8, with or without a byte-order mark (editors on Windows add one)."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            why = "it is UTF-16 (it starts with a UTF-16 byte-order mark)"
        else:
            why = f"byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8"
        raise PolicyError(source, [f"not UTF-8 text: {why}; save the file as UTF-8"]) from None


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
