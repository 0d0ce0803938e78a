"""When GET /metrics was last read, for the trainer's endpoint to wait, at detach, for one scrape
after the rank's final report (guard/sinks/embedded.py): Prometheus then records the rank
finished (guard_rank_finished 1) before the process exits and its series vanish, and
GuardRankSilent, which fires for a rank gone without finishing, stays quiet for it."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["LAST_SCRAPE_WAIT_S", "ScrapeClock"]

# The longest a trainer's exit waits for its last scrape: 2 intervals of the recipes' 15 s.
LAST_SCRAPE_WAIT_S = 30.0


class ScrapeClock:
    """The start times of the last two scrapes that read the store; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._changed = threading.Condition()
        self._starts: deque[float] = deque(maxlen=2)

    def note(self, started: float) -> None:
        """A scrape that began reading the store at `started` (the clock's time) was written."""
        with self._changed:
            self._starts.append(started)
            self._changed.notify_all()

    def interval(self) -> float | None:
        """Seconds between the last two scrapes; None before two (a person's curl is no
        Prometheus)."""
        with self._changed:
            return self._starts[1] - self._starts[0] if len(self._starts) == 2 else None

    def wait_after(self, since: float, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for a scrape that began reading after `since`; True once
        one was written."""
        with self._changed:
            return self._changed.wait_for(lambda: bool(self._starts) and self._starts[-1] > since,
                                          timeout=timeout_s)

    def last_scrape_wait(self, most_s: float = LAST_SCRAPE_WAIT_S) -> float:
        """How long to wait for the next scrape: twice the interval between the last two and a
        second (a scrape comes late on a loaded machine), at most `most_s`; 0 where nothing
        scrapes this endpoint on an interval."""
        every = self.interval()
        return 0.0 if every is None else min(most_s, 2 * every + 1.0)
