"""Reports across wire versions (docs/wire.md, "Versions"), pydantic only: the library lowers
a batch to what an older server reads (the push sink, for a server that says an older version,
or none: the first release's): the fields and check names added after that version are left
out; a check the server does not know is not reported (its counts, its events, its halt). The
server reads a newer guard's batch with the fields it knows (guard_server/shape.py).
"""

from __future__ import annotations

from typing import Any

from guard_server.wire import CHECK_SINCE, ReportBatch, since, wire_models

__all__ = ["lowered"]


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
