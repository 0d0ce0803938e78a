"""Where the guard's per-step reports go: memory (tests), the embedded endpoint, HTTP push."""

from guard.sinks.base import Sink, open_sinks
from guard.sinks.memory import MemorySink

__all__ = ["MemorySink", "Sink", "open_sinks"]
