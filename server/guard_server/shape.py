"""A request body's shape, read before it is parsed: the fields this server does not know (a
newer guard's), bounded in count and bytes, and what no batch can be (a list longer than the
wire allows, a list or an object where a value goes), refused before pydantic reads it.

Why before: pydantic reads a body whole into its own tree and keeps a copy of every value it
refuses. A 1 MiB body of 96,000 unknown fields cost 0.65-2.9 s and ~105 MiB to take, and a
list of 120,000 reports ~58 MiB to refuse; read here, each is a 422 after a few kilobytes.
One regular expression finds the strings and brackets (the only tokens that matter); numbers,
commas and literals are skipped in C. Once the shape is known to be a batch's, with every
unknown field within the bounds, pydantic reads it leaving those fields out.
"""

from __future__ import annotations

import json
import re
import types
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError

from guard_server.wire import ReportBatch, StepReport

__all__ = ["SCAN_ABOVE", "ShapeError", "Unknown", "read_batch", "unknown_fields"]

# Bodies up to this size go to pydantic first, and are scanned only when it finds fields it
# does not know: refusing any shape of 32 KiB costs pydantic at most ~4 MiB, and the scan (~2x
# the parse, in Python) would double the cost of every push. Larger ones are scanned first.
SCAN_ABOVE = 32 << 10
# A string (with escapes), and the colon that makes it a key; or a bracket.
_TOKEN = re.compile(rb'"([^"\\]*(?:\\.[^"\\]*)*)"(\s*:)?|[\[\]{}]')
_OPEN_LIST = ord("[")
# After a list of objects opens, or one of its items ends: another object, or the list's end.
_NEXT_OBJECT = re.compile(rb"\s*(?:,?\s*\{|\])")
_OPEN, _CLOSE = b"[{", b"]}"


class ShapeError(ValueError):
    """The body is no batch, or carries more unknown fields than the server takes; `.loc` is
    where (as pydantic's errors say it), `.kind` what (an error type of the 422)."""

    def __init__(self, loc: tuple[str | int, ...], kind: str, message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.kind = kind


@dataclass
class _Kind:
    """What a JSON value may be at one place of a batch."""

    fields: dict[bytes, _Kind] | None = None  # an object of a model: its fields, by JSON key
    items: _Kind | None = None  # a list: its items (max_items of them)
    values: _Kind | None = None  # an object of keys (max_items of them): its values
    max_items: int = 0
    report: bool = False  # a step report: unknown fields are counted per report


_VALUE = _Kind()  # a number, string, boolean or null: never a list or an object


def _kind(annotation: Any, metadata: list[Any]) -> _Kind:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _kind(args[0], [*metadata, *args[1:]])
    if origin in (Union, types.UnionType):
        found = [k for a in args if a is not type(None) and (k := _kind(a, metadata)) is not _VALUE]
        return found[0] if found else _VALUE
    most = next((m.max_length for m in metadata if isinstance(m, annotated_types.MaxLen)), 0)
    if origin is list:
        return _Kind(items=_kind(args[0], []), max_items=most)
    if origin is dict:  # keys from a Literal: at most that many (a check, an action)
        keys = get_args(args[0]) if get_origin(args[0]) is Literal else ()
        return _Kind(values=_kind(args[1], []), max_items=len(keys))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model(annotation)
    return _VALUE


def _model(model: type[BaseModel]) -> _Kind:
    fields = {name.encode(): _kind(info.annotation, list(info.metadata))
              for name, info in model.model_fields.items()}
    return _Kind(fields=fields, report=model is StepReport)


_BATCH = _model(ReportBatch)


@dataclass
class Unknown:
    """The unknown fields of a body: each one's name as a path of names (reports.grad_norm2),
    once per occurrence, and their bytes in all (names and values)."""

    names: list[str] = field(default_factory=list)
    size: int = 0


class _Frame:
    """An open list or object: what it may hold, where it is, what it has held so far."""

    __slots__ = ("items", "key", "kind", "parent", "unknown")

    def __init__(self, kind: _Kind | None, parent: _Frame | None, key: bytes | int) -> None:
        self.kind = kind  # None: inside an unknown field's value, or a value pydantic refuses
        self.parent, self.key = parent, key  # where it is: built into a loc only for an error
        self.items = 0  # items of a list, keys of an object of keys
        self.unknown = 0  # unknown fields of a report (or of the batch's top level)

    @property
    def loc(self) -> tuple[str | int, ...]:
        if self.parent is None:
            return ()
        key = self.key if isinstance(self.key, int) else _text(self.key)
        return (*self.parent.loc, key)


def _read(key: bytes) -> bytes:
    """A key with escapes as JSON reads it, in UTF-8 ("\\u0067rad_norm" is grad_norm); one
    JSON cannot read stays as it is (pydantic refuses the body)."""
    try:
        return str(json.loads(b'"' + key + b'"')).encode("utf-8", "replace")
    except ValueError:
        return key


def _text(key: bytes) -> str:
    return key.decode("utf-8", "replace")


def unknown_fields(body: bytes, max_fields: int, max_bytes: int) -> Unknown:
    """The unknown fields of `body`: at most `max_fields` in each report (and at the batch's
    top level), `max_bytes` in all; ShapeError past them, or for a shape no batch has. A body
    that is not JSON passes: pydantic says what is wrong with it."""
    found = Unknown()
    top: _Frame | None = None  # the innermost open list or object
    depth = 0
    scope: list[_Frame] = []  # the frames that count unknown fields: the batch, each report
    pending: _Kind | None = _BATCH  # what the next value is, once a key says so
    key: bytes = b""
    open_depth, open_at = -1, 0  # an unknown field's depth and first byte, while it is open
    for m in _TOKEN.finditer(body):
        content, colon = m.group(1, 2)
        if open_depth >= 0:
            at = m.start()
            ends = colon is not None or (content is None and body[at] in _CLOSE)
            if found.size + at - open_at > max_bytes:
                _too_many_bytes(max_bytes)
            if depth <= open_depth and ends:
                found.size += at - open_at
                open_depth = -1
        if content is not None:  # a string
            pending = None
            if colon is None or top is None or (kind := top.kind) is None:
                continue
            if b"\\" in content:
                content = _read(content)
            if kind.fields is not None:
                if (child := kind.fields.get(content)) is not None:
                    pending, key = child, content
                    continue
                counting = scope[-1]
                counting.unknown += 1
                found.names.append(".".join([*(p for p in top.loc if isinstance(p, str)),
                                             _text(content)]))
                if counting.unknown > max_fields:
                    _too_many_fields(counting.loc, max_fields)
                open_depth, open_at = depth, m.start()
            else:  # an object of keys (violations: check -> action -> count)
                top.items += 1
                if top.items > kind.max_items:
                    raise ShapeError(top.loc, "too_long", f"more than {kind.max_items} keys: "
                                     "more than there are names for them")
                pending, key = kind.values, content
        elif body[m.start()] in _OPEN:
            new = _opened(top, pending, key, body[m.start()] == _OPEN_LIST)
            top, depth, pending = new, depth + 1, None
            if new.kind is not None and (new.kind.report or new.kind is _BATCH):
                scope.append(new)
            _objects_only(new, body, m.end())
        elif top is not None:
            if scope and scope[-1] is top:
                scope.pop()
            top, depth, pending = top.parent, depth - 1, None
            if top is not None and top.kind is not None and top.kind.items is not None:
                _objects_only(top, body, m.end())
    return found


def _objects_only(frame: _Frame, body: bytes, at: int) -> None:
    """In a list of objects (reports, events), only objects: the next item after `at` (the
    list's opening, or an item's end) is one, or the list ends. A number, no token of the scan,
    would otherwise go unseen: 500,000 of them where reports go cost pydantic 26 MiB to refuse."""
    items = frame.kind.items if frame.kind is not None else None
    if items is not None and items.fields is not None and not _NEXT_OBJECT.match(body, at):
        raise ShapeError(frame.loc, "type_error", "a value where the wire has an object")


def _opened(top: _Frame | None, pending: _Kind | None, key: bytes,
            is_list: bool) -> _Frame:
    """The frame of a list or object opened in `top`, after `key` (in an object) whose value
    is `pending`; ShapeError where no batch has one."""
    if top is None:
        kind, where = pending, None
    elif top.kind is None:
        return _Frame(None, top, top.key)  # inside an unknown or refused value: not looked at
    elif top.kind.items is not None:  # an item of a list
        top.items += 1
        if top.kind.max_items and top.items > top.kind.max_items:
            raise ShapeError(top.loc, "too_long", f"more than {top.kind.max_items} items: "
                             "more than the wire allows")
        return _frame(top.kind.items, top, top.items - 1, is_list)
    else:
        kind, where = pending, top
    return _frame(kind, where, key, is_list)


def _frame(kind: _Kind | None, parent: _Frame | None, key: bytes | int,
           is_list: bool) -> _Frame:
    frame = _Frame(kind, parent, key)
    if kind is not None and (kind is _VALUE or is_list != (kind.items is not None)):
        what = "a list" if is_list else "an object"
        raise ShapeError(frame.loc, "type_error", f"{what} where the wire has "
                         f"{'a value' if kind is _VALUE else 'another kind of value'}")
    return frame


def _too_many_fields(loc: tuple[str | int, ...], most: int) -> None:
    raise ShapeError(loc, "unknown_fields", f"more than {most} fields this server does not "
                     f"know in one report (GUARD_SERVER_MAX_UNKNOWN_FIELDS={most}); nothing "
                     "was stored")


def _too_many_bytes(most: int) -> None:
    raise ShapeError((), "unknown_fields", f"more than {most} bytes of fields this server "
                     f"does not know in one batch (GUARD_SERVER_MAX_UNKNOWN_BYTES={most}); "
                     "nothing was stored")


def read_batch(body: bytes, max_fields: int, max_bytes: int) -> tuple[ReportBatch, list[str]]:
    """The batch in `body`, stored without the fields this server does not know, and their
    names (once per occurrence); ShapeError past the bounds on them or for a shape no batch
    has, ValidationError for anything else wrong with it."""
    if len(body) > SCAN_ABOVE:
        unknown = unknown_fields(body, max_fields, max_bytes)
        if not unknown.names:
            return ReportBatch.model_validate_json(body), []
    else:
        try:
            return ReportBatch.model_validate_json(body), []
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            if any(e["type"] != "extra_forbidden" for e in errors):
                raise
        unknown = unknown_fields(body, max_fields, max_bytes)
    # Read with the same validation as every batch, leaving out what it does not know (rare: a
    # newer guard before it has heard this server's version).
    return ReportBatch.model_validate_json(body, extra="ignore"), unknown.names
