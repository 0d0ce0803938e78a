"""One log line a minute per kind of a repeated event, with how many of it went unlogged: a
flood (thousands of refused connections a second, a push refused at every step) must not flood
the log. Logging and time only, no fastapi: the server and the library's push sink share it,
and the library imports it as it imports guard_server.wire."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["EVERY_S", "Throttle"]

# A flood repeats many times a second; a person reads the log a few times an hour.
EVERY_S = 60.0


class Throttle:
    """Log each kind of event at most once every `every_s` seconds, with the number of that
    kind left unlogged since its last line. Thread-safe."""

    def __init__(self, logger: logging.Logger, level: int, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._level = level
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def say(self, kind: str, message: str) -> None:
        """Log `message` (logged as it is: no %-formatting of what it quotes), unless this kind
        had a line within every_s; then count it."""
        now = self._clock()
        with self._lock:
            if now - self._last.get(kind, float("-inf")) < self._every_s:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return
            quiet = self._quiet.pop(kind, 0)
            self._last[kind] = now
        more = f" ({quiet} more like it since the last such line)" if quiet else ""
        self._logger.log(self._level, "%s%s", message, more)
