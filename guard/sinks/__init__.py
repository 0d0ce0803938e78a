"""Where the guard's per-step reports go: memory (tests), the embedded endpoint, HTTP push."""

from __future__ import annotations

from typing import Any, Protocol

from guard.sinks.memory import MemorySink

__all__ = ["MemorySink", "Sink"]


class Sink(Protocol):
    """Receives one report per read boundary; must never block or raise into training."""

    def emit(self, report: dict[str, Any]) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...
