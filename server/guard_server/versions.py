"""Reports across wire versions (docs/wire.md, "Versions"), pydantic only: the library lowers
a batch to what an older server reads, and the server reads a newer guard's batch with the
fields it knows.

- Lowering (the push sink, for a server that says an older version, or none: the first
  release's): the fields and check names added after that version are left out; a check the
  server does not know is not reported (its counts, its events, its halt).
- Reading (the ingest route): a batch whose only problem is fields this server does not know
  (pydantic's extra_forbidden) is stored without them, and their names are said to the caller.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from guard_server.wire import CHECK_SINCE, ReportBatch, since, wire_models

__all__ = ["lowered", "read_known", "unknown_name"]


def _drop(node: Any, path: tuple[str, ...], field: str) -> None:
    """Remove `field` from every object at `path` under `node` (lists: each item)."""
    if isinstance(node, list):
        for item in node:
            _drop(item, path, field)
    elif isinstance(node, dict):
        if path:
            _drop(node.get(path[0]), path[1:], field)
        else:
            node.pop(field, None)


def lowered(batch: ReportBatch, version: int) -> dict[str, Any]:
    """`batch` as JSON data a server of wire `version` reads: what it does not know left out."""
    doc = batch.model_dump(mode="json")
    for path, model in wire_models():
        for name, info in model.model_fields.items():
            if since(info) > version:
                _drop(doc, path, name)
    newer = {check for check, added in CHECK_SINCE.items() if added > version}
    if newer:
        for report in doc["reports"]:
            report["violations"] = {c: n for c, n in report["violations"].items()
                                    if c not in newer}
            report["events"] = [e for e in report["events"] if e["check"] not in newer]
            if report["halted"] in newer:
                report["halted"] = None
    return doc


def unknown_name(loc: tuple[int | str, ...]) -> str:
    """A field's name as a path of names, its list indices left out: reports.grad_norm."""
    return ".".join(str(part) for part in loc if not isinstance(part, int))


def read_known(body: bytes) -> tuple[ReportBatch, list[tuple[int | str, ...]]]:
    """The batch in `body` and where the fields it carries that this server does not know
    were (left out); ValidationError for anything else wrong with it."""
    try:
        return ReportBatch.model_validate_json(body), []
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        if any(e["type"] != "extra_forbidden" for e in errors):
            raise
        # Only unknown fields: take them out where pydantic found them and read it again,
        # with the same validation as every batch (rare: a newer guard before it has heard
        # this server's version).
        unknown = [tuple(e["loc"]) for e in errors]
        try:
            doc = json.loads(body)
            for loc in unknown:
                node = doc
                for part in loc[:-1]:
                    node = node[part]
                node.pop(loc[-1], None)
        except (ValueError, LookupError, TypeError, AttributeError):
            raise exc from None  # JSON that only pydantic reads: the 422 as it was
    return ReportBatch.model_validate_json(json.dumps(doc)), unknown
