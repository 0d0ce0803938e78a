"""The wire version a push target reads, as its answers say (`Guard-Wire-Version`; a server of
the first release says none: version 1), and the request bodies built for it: a newer guard
leaves out what an older server does not know instead of losing every report to a 422
(docs/wire.md, "Versions")."""

from __future__ import annotations

import json

from guard_server.versions import lowered
from guard_server.wire import CHECK_SINCE, WIRE_VERSION, ReportBatch, since, wire_models

__all__ = ["ServerVersion", "answer_version"]


def answer_version(header: str | None) -> int:
    """The version an answer's header says, at most ours (an unreadable one: 1)."""
    value = (header or "").strip().lstrip("0")
    if not (value.isascii() and value.isdigit()):
        return 1
    # Longer than ours can be: newer. int() of 5,000 digits raises (its 4,300-digit bound),
    # which ended the push thread.
    return WIRE_VERSION if len(value) > len(str(WIRE_VERSION)) else min(int(value), WIRE_VERSION)


def _newer_than(version: int) -> list[str]:
    fields = [".".join((*path, name)) for path, model in wire_models()
              for name, info in model.model_fields.items() if since(info) > version]
    return fields + [f"the {c} check" for c, added in CHECK_SINCE.items() if added > version]


class ServerVersion:
    """What the server at `where` reads: ours until an answer says otherwise."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.version = WIRE_VERSION
        self._said: set[int] = set()

    def body(self, batch: ReportBatch) -> bytes:
        """The request body of `batch` for this server's version."""
        if self.version >= WIRE_VERSION:
            return batch.model_dump_json().encode()
        return json.dumps(lowered(batch, self.version), separators=(",", ":")).encode()

    def heard(self, status: int, header: str | None) -> str | None:
        """An answer came with this status and Guard-Wire-Version header (or none); the
        warning to log the first time the server is found to read an older version. No header
        says version 1 only on a 422 (a first-release server refusing what it does not know):
        a proxy's 502 without one says nothing of the server behind it."""
        if header is None and status != 422:
            return None
        version, said = answer_version(header), None
        if version < WIRE_VERSION and version not in self._said:
            self._said.add(version)
            said = (f"{self.where} reads wire version {version}, an older guard "
                    f"server's: reports go to it without {', '.join(_newer_than(version))}; "
                    "upgrade the server to see them")
        self.version = version
        return said
