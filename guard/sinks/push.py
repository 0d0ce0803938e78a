"""HTTP push to a guard server: a bounded queue drained by one background thread.

`emit` only appends to the queue (dropping the oldest report when full), so the training step
never waits on the network and never sees its errors. The thread batches by count and time,
retries connection errors, 5xx and 429 with exponential backoff (never sooner than the
server's `Retry-After`), gives every request an overall deadline, and counts what it drops.

The deadline is why the thread runs its requests on an event loop of its own: httpx's timeouts
bound each read, so a server that answers one byte at a time held a blocking request (and the
batch in it) forever; `asyncio.wait_for` bounds the whole request and closes its connection.
"""

from __future__ import annotations

import asyncio
import atexit
import email.utils
import functools
import itertools
import logging
import os
import threading
import time
import urllib.parse
import weakref
from collections import deque

import httpx

from guard_server.wire import MAX_BATCH_REPORTS, ReportBatch, StepReport

__all__ = ["PushSink", "redact"]

log = logging.getLogger("guard")

# Far below the server's 1 MiB body limit even with 32 long violation messages in a report.
MAX_BATCH_BYTES = 512 * 1024
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# A Retry-After is honoured up to this; a longer one (or a forged one) would silence the rank.
_RETRY_AFTER_MAX_S = 60.0
# A rejection that repeats (a missing token: every push) is logged at most this often.
_ERROR_EVERY_S = 60.0


def redact(url: str) -> str:
    """`url` without the credentials of its user-info part, for logs: http://***@host/."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        host += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{host}"))


def retry_after(response: httpx.Response) -> float | None:
    """The seconds a 429 / 503 asks to wait (delta-seconds or an HTTP date), at most
    _RETRY_AFTER_MAX_S; None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), _RETRY_AFTER_MAX_S)


class _Throttled:
    """An error logged once per _ERROR_EVERY_S per kind, with how many were not logged."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def error(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, float("-inf")) < _ERROR_EVERY_S:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        quiet = self._quiet.pop(kind, 0)
        self._last[kind] = now
        more = f" ({quiet} more like it in the last {_ERROR_EVERY_S:.0f} s)" if quiet else ""
        log.error("%s%s", message, more)


class PushSink:
    """Push reports to `{url}/v1/reports`; token from GUARD_TOKEN unless given.

    `timeout_s` bounds each connect / read / write, `deadline_s` each request as a whole.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_queue: int = 4096,
        batch_size: int = 200,
        flush_interval_s: float = 1.0,
        timeout_s: float = 2.0,
        deadline_s: float = 10.0,
        backoff_s: tuple[float, float] = (0.2, 10.0),
    ) -> None:
        self.endpoint = url.rstrip("/") + "/v1/reports"
        self.where = redact(self.endpoint)  # what the logs say: never the URL's credentials
        token = token if token is not None else os.environ.get("GUARD_TOKEN")
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._loop = asyncio.new_event_loop()  # the push thread's; see the module docstring
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout_s)
        self._queue: deque[ReportBatch] = deque()  # one report each
        self._max_queue = max_queue
        self._batch_size = min(batch_size, MAX_BATCH_REPORTS)
        self._flush_interval_s = flush_interval_s
        self._deadline_s = deadline_s
        self._backoff_s = backoff_s
        self._errors = _Throttled()
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = float("inf")  # close(): give up retrying after this
        self._in_flight = 0  # reports taken from the queue and not yet sent or dropped
        self._failing = False  # since the last request that went through
        self.dropped = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="guard-push", daemon=True)
        self._thread.start()
        # A `fail` that ends the script (GuardViolation uncaught, no detach) would kill the
        # daemon thread with the halt report still queued: flush at exit, bounded in time.
        # Weak, so an atexit entry never keeps a closed sink alive.
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    def emit(self, batch: ReportBatch) -> None:
        parts = [batch] if len(batch.reports) == 1 else [
            batch.model_copy(update={"reports": [r]}) for r in batch.reports]
        with self._cond:
            for part in parts:
                if len(self._queue) >= self._max_queue:
                    self._queue.popleft()
                    self.dropped += 1
                self._queue.append(part)
            # A final or halting report goes now: the process may end right after it.
            if len(self._queue) >= self._batch_size or any(
                    r.final or r.halted is not None for r in batch.reports):
                self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued, for at most `timeout` seconds; then drop and count the rest,
        the batch in flight included."""
        atexit.unregister(self._at_exit)
        with self._cond:
            if self._closing:
                return  # closed already (detach, then exit)
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify()
        # A request in flight ends by the close deadline (_post bounds it by what is left).
        self._thread.join(timeout + 1.0)
        with self._cond:
            left = len(self._queue) + (self._in_flight if self._thread.is_alive() else 0)
            if left:
                self.dropped += left
                log.warning("guard: %d reports not pushed to %s before close; dropped",
                            left, self.where)
                self._queue.clear()
                self._in_flight = 0

    # -- the background thread ---------------------------------------------------------------

    def _take(self) -> list[ReportBatch]:
        with self._cond:
            if not self._queue and not self._closing:
                self._cond.wait(self._flush_interval_s)
            n = min(len(self._queue), self._batch_size)
            self._in_flight = n
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
        try:
            while True:
                for body, count in self._bodies(self._take()):
                    self._send(body, count)
                with self._cond:
                    if self._closing and (not self._queue or time.monotonic() > self._deadline):
                        return
        finally:
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()

    def _settle(self, count: int, *, sent: bool) -> None:
        with self._cond:
            if sent:
                self.sent += count
            else:
                self.dropped += count
            self._in_flight = max(0, self._in_flight - count)

    def _post(self, body: bytes) -> httpx.Response:
        """One request, bounded as a whole by deadline_s (and by close's deadline)."""
        limit = self._deadline_s
        with self._cond:
            if self._closing:
                limit = min(limit, max(0.0, self._deadline - time.monotonic()))
        request = self._client.post(self.endpoint, content=body)
        return self._loop.run_until_complete(asyncio.wait_for(request, limit))

    def _send(self, body: bytes, count: int) -> None:
        delay = self._backoff_s[0]
        while True:
            wait = delay
            try:
                r = self._post(body)
                if r.status_code < 300:
                    self._settle(count, sent=True)
                    self._failing = False
                    return
                if r.status_code not in _RETRY_STATUS:
                    self._settle(count, sent=False)
                    self._errors.error(str(r.status_code), _rejected(self.where, count, r))
                    return
                why = f"HTTP {r.status_code}"
                wait = max(delay, retry_after(r) or 0.0)
            except (httpx.HTTPError, TimeoutError) as e:
                why = (f"no complete answer within {self._deadline_s:g} s"
                       if isinstance(e, TimeoutError) else _cause(e))
            if not self._failing:  # said at the first failure, not only by a count at exit
                self._failing = True
                log.warning("guard: cannot push to %s (%s); reports wait in the queue and are "
                            "retried with backoff", self.where, why)
            with self._cond:
                resume = time.monotonic() + wait
                if not self._closing:
                    log.debug("guard: push to %s failed (%s); retrying in %.1f s", self.where,
                              why, wait)
                    # Only close() ends this early: emit() notifies the condition too, and a
                    # queue that stays full during an outage would cut every backoff short.
                    self._cond.wait_for(lambda: self._closing, wait)
                if self._closing and resume > self._deadline:
                    # The next try would come after close's deadline: no more tries for any
                    # batch (the server asked for the wait); the rest is counted at close.
                    self._deadline = min(self._deadline, time.monotonic())
                    self._settle(count, sent=False)
                    return
            if (left := resume - time.monotonic()) > 0:  # closing, with time for one more try
                time.sleep(left)
            delay = min(delay * 2, self._backoff_s[1])


def _cause(exc: BaseException) -> str:
    """`exc` and the OS error under it (httpx keeps "Connection refused" causes down)."""
    inner: BaseException | None = exc
    while inner is not None and not (isinstance(inner, OSError) and inner.errno):
        inner = inner.__cause__ or inner.__context__
    code = inner.errno if isinstance(inner, OSError) else None  # < 0: a getaddrinfo error
    os_error = os.strerror(code) if code and code > 0 else getattr(inner, "strerror", None)
    return f"{type(exc).__name__}: {exc}" + (f" ({os_error})" if os_error else "")


def _close_at_exit(ref: weakref.ref[PushSink]) -> None:
    if (sink := ref()) is not None:
        sink.close(timeout=2.0)


def _rejected(where: str, count: int, r: httpx.Response) -> str:
    """The error for a push the server refused for good: what to do about it."""
    head = f"guard: {where} rejected {count} reports (HTTP {r.status_code})"
    if r.status_code in (401, 403):
        return (f"{head}: the server wants a token and the trainer sent "
                f"{'a wrong one' if 'authorization' in r.request.headers else 'none'}; set "
                "GUARD_TOKEN in the trainer's environment to the server's token "
                "(docs/server.md); dropped")
    return f"{head}: {r.text[:300]}; dropped"


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
