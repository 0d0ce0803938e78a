"""An in-memory sink: keeps every report, for tests and notebooks."""

from __future__ import annotations

import threading

from guard_server.wire import ReportBatch, StepReport

__all__ = ["MemorySink"]


class MemorySink:
    """Stores what it receives; `batch()` is all of it as one request body of the wire."""

    def __init__(self) -> None:
        self.batches: list[ReportBatch] = []
        self.closed = False
        self._lock = threading.Lock()

    def emit(self, batch: ReportBatch) -> None:
        with self._lock:
            self.batches.append(batch)

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True

    @property
    def reports(self) -> list[StepReport]:
        with self._lock:
            return [r for b in self.batches for r in b.reports]

    def batch(self) -> ReportBatch:
        """Every report received, as one batch (they all come from one run and rank)."""
        with self._lock:
            first = self.batches[0]
            return first.model_copy(update={"reports": [r for b in self.batches
                                                        for r in b.reports]})
