"""An in-memory sink: keeps every report, for tests and notebooks."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["MemorySink"]


class MemorySink:
    """Stores reports in a list; `batch()` wraps them as one wire-format request body."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.closed = False
        self._lock = threading.Lock()
        self.run_id: str | None = None
        self.rank: int | None = None

    def bind(self, run_id: str, rank: int) -> None:
        self.run_id, self.rank = run_id, rank

    def emit(self, report: dict[str, Any]) -> None:
        with self._lock:
            self.reports.append(report)

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True

    def batch(self) -> dict[str, Any]:
        with self._lock:
            return {"run_id": self.run_id, "rank": self.rank, "reports": list(self.reports)}
