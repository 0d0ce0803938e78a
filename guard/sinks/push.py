"""HTTP push to a guard server: a bounded queue drained by one background thread.

`emit` only appends to the queue (dropping the oldest report when full), so the training step
never waits on the network and never sees its errors. The thread batches by count and time,
retries connection errors, 5xx and 429 with exponential backoff, and counts what it drops.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque

import httpx

from guard_server.wire import MAX_BATCH_REPORTS, ReportBatch, StepReport

__all__ = ["PushSink"]

log = logging.getLogger("guard")

# Far below the server's 1 MiB body limit even with 32 long violation messages in a report.
MAX_BATCH_BYTES = 512 * 1024
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class PushSink:
    """Push reports to `{url}/v1/reports`; token from GUARD_TOKEN unless given."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_queue: int = 4096,
        batch_size: int = 200,
        flush_interval_s: float = 1.0,
        timeout_s: float = 2.0,
        backoff_s: tuple[float, float] = (0.2, 10.0),
    ) -> None:
        self.endpoint = url.rstrip("/") + "/v1/reports"
        token = token if token is not None else os.environ.get("GUARD_TOKEN")
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=timeout_s)
        self._queue: deque[ReportBatch] = deque()  # one report each
        self._max_queue = max_queue
        self._batch_size = min(batch_size, MAX_BATCH_REPORTS)
        self._flush_interval_s = flush_interval_s
        self._backoff_s = backoff_s
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = float("inf")  # close(): give up retrying after this
        self.dropped = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="guard-push", daemon=True)
        self._thread.start()

    def emit(self, batch: ReportBatch) -> None:
        parts = [batch] if len(batch.reports) == 1 else [
            batch.model_copy(update={"reports": [r]}) for r in batch.reports]
        with self._cond:
            for part in parts:
                if len(self._queue) >= self._max_queue:
                    self._queue.popleft()
                    self.dropped += 1
                self._queue.append(part)
            if len(self._queue) >= self._batch_size or any(r.final for r in batch.reports):
                self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued, for at most `timeout` seconds; then drop and count the rest."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify()
        self._thread.join(timeout + 1.0)
        with self._cond:
            if self._queue:
                self.dropped += len(self._queue)
                log.warning("guard: %d reports not pushed to %s before close; dropped",
                            len(self._queue), self.endpoint)
                self._queue.clear()
        self._client.close()

    # -- the background thread ---------------------------------------------------------------

    def _take(self) -> list[ReportBatch]:
        with self._cond:
            if not self._queue and not self._closing:
                self._cond.wait(self._flush_interval_s)
            n = min(len(self._queue), self._batch_size)
            return [self._queue.popleft() for _ in range(n)]

    def _bodies(self, taken: list[ReportBatch]) -> list[tuple[bytes, int]]:
        """(request body, reports in it): one batch per run and rank, in order, each stamped
        with the drops so far and at most MAX_BATCH_BYTES."""
        stamp = {"dropped_reports": self.dropped}
        bodies: list[tuple[bytes, int]] = []
        for (run_id, rank), group in itertools.groupby(taken, lambda b: (b.run_id, b.rank)):
            reports = [r.model_copy(update=stamp) for b in group for r in b.reports]
            bodies += _encode(ReportBatch(run_id=run_id, rank=rank, reports=reports))
        return bodies

    def _run(self) -> None:
        while True:
            for body, count in self._bodies(self._take()):
                self._send(body, count)
            with self._cond:
                if self._closing and not self._queue:
                    return
                if self._closing and time.monotonic() > self._deadline:
                    return

    def _send(self, body: bytes, count: int) -> None:
        delay = self._backoff_s[0]
        while True:
            try:
                r = self._client.post(self.endpoint, content=body)
                if r.status_code < 300:
                    self.sent += count
                    return
                if r.status_code not in _RETRY_STATUS:
                    self.dropped += count
                    log.error("guard: %s rejected %d reports (%d): %s; dropped", self.endpoint,
                              count, r.status_code, r.text[:300])
                    return
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                why = type(e).__name__
            with self._cond:
                if self._closing and time.monotonic() + delay > self._deadline:
                    self.dropped += count
                    return
                log.debug("guard: push to %s failed (%s); retrying in %.1f s", self.endpoint,
                          why, delay)
                self._cond.wait(delay)
            delay = min(delay * 2, self._backoff_s[1])


def _encode(batch: ReportBatch) -> list[tuple[bytes, int]]:
    """The batch as request bodies of at most MAX_BATCH_BYTES each (halved until they fit;
    a single report is always far below the limit)."""
    body = batch.model_dump_json().encode()
    n = len(batch.reports)
    if len(body) <= MAX_BATCH_BYTES or n == 1:
        return [(body, n)]
    halves: list[list[StepReport]] = [batch.reports[: n // 2], batch.reports[n // 2 :]]
    return [part for half in halves
            for part in _encode(batch.model_copy(update={"reports": half}))]
