"""Fields of reports this server does not know (a newer guard's), left out at ingest: counted
per name for guard_ingest_unknown_fields_total{field}, each name logged once."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable

__all__ = ["MAX_NAMES", "UnknownFields"]

log = logging.getLogger("guard_server")

# Names are the sender's: at most this many get a series of their own (and a log line), the
# rest, and any name that is not lower-case words joined by dots, count under "other", so a
# hostile client can neither grow /metrics and the log nor write into them.
MAX_NAMES = 32
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}(\.[a-z][a-z0-9_]{0,63}){0,3}")


class UnknownFields:
    """Thread-safe counts per field name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def count(self, names: Iterable[str]) -> None:
        said = []
        with self._lock:
            for name in names:
                known = name in self._counts
                if not known and (len(self._counts) >= MAX_NAMES or not _NAME.fullmatch(name)):
                    name, known = "other", "other" in self._counts
                self._counts[name] = self._counts.get(name, 0) + 1
                if not known:
                    said.append(name)
        for name in said:
            log.warning("guard server: reports carry a field this server does not know, %s; "
                        "they are stored without it (a newer guard: upgrade the server to "
                        "keep it). Counted in guard_ingest_unknown_fields_total", name)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
