"""HTTP push to a guard server: a bounded queue drained by one background thread.

`emit` only appends to the queue (dropping the oldest report when full), so the training step
never waits on the network and never sees its errors. The thread batches by count and time,
retries connection errors, 5xx and 429 with exponential backoff (never sooner than the
server's `Retry-After`), gives every request an overall deadline, reads at most
`max_answer_bytes` of each answer, keeps no cookies, sends an older server only what it reads
(guard/sinks/wire_version.py), and counts what it drops. What will not heal by retrying (a
401, 403, 413 or 422, a TLS certificate refused) is dropped at once and logged (guard/sinks/
replies.py); what is given up at close is logged there.

The deadline is why the thread runs its requests on an event loop of its own: httpx's timeouts
bound each read, so a server that answers one byte at a time held a blocking request (and the
batch in it) forever; `asyncio.wait_for` bounds the whole request and closes its connection.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

from guard.policy.model import push_url
from guard.sinks.replies import (
    Answer,
    certificate_problem,
    certificate_refused,
    failure,
    read_answer,
    redact,
    refusal,
    split_credentials,
    unusable,
)
from guard.sinks.wire_version import ServerVersion
from guard_server.throttle import Throttle
from guard_server.wire import MAX_BATCH_REPORTS, ReportBatch, StepReport, bearer_token

__all__ = ["PushSink"]

log = logging.getLogger("guard")

# Far below the server's 1 MiB body limit even with 32 long violation messages in a report.
MAX_BATCH_BYTES = 512 * 1024
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class PushSink:
    """Push reports to `{url}/v1/reports`; token from GUARD_TOKEN unless given.

    `timeout_s` bounds each connect / read / write, `deadline_s` each request as a whole,
    `max_answer_bytes` what is read of each answer (the rest is never read). A token that
    cannot be sent as a bearer token, or a URL no request can go to, is a ValueError here, at
    start.
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
        max_answer_bytes: int = 4096,
    ) -> None:
        self.where = redact(url.rstrip("/") + "/v1/reports")  # never the URL's credentials
        url, auth = split_credentials(push_url(url.rstrip("/")))
        self.endpoint = url + "/v1/reports"
        # identity: what is read of an answer is its bytes on the wire, never an inflated body.
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        token = token if token is not None else os.environ.get("GUARD_TOKEN")
        if token is not None:  # the server's rule (guard_server.wire): stripped, header-safe
            headers["authorization"] = f"Bearer {bearer_token(token, 'GUARD_TOKEN')}"
        self._token_sent = token is not None
        self._max_answer_bytes = max_answer_bytes
        self._loop = asyncio.new_event_loop()  # the push thread's; see the module docstring
        # No cookie jar: a receiver's Set-Cookie is never kept nor sent back (1500 of them an
        # answer grew the jar to 22,500 cookies and the Cookie header to 1 MB).
        no_cookies = CookieJar(DefaultCookiePolicy(allowed_domains=[]))
        self._client = httpx.AsyncClient(headers=headers, auth=auth, timeout=timeout_s,
                                         cookies=no_cookies)
        self._queue: deque[ReportBatch] = deque()  # one report each
        self._max_queue = max_queue
        self._batch_size = min(batch_size, MAX_BATCH_REPORTS)
        self._flush_interval_s = flush_interval_s
        self._deadline_s = deadline_s
        self._backoff_s = backoff_s
        # A failure that repeats (a missing token: every push) is logged once a minute.
        self._errors = Throttle(log, logging.ERROR)
        self._server = ServerVersion(self.where)  # the wire version its answers say
        self._cond = threading.Condition()
        self._closing = False
        self._closed = False  # close() has returned: the thread says nothing more
        self._deadline = float("inf")  # close(): give up retrying after this
        self._in_flight = 0  # reports taken from the queue and not yet sent or dropped
        self._gave_up = 0  # reports in flight given up at close (the server never took them)
        self._failure = "none"  # why the last try failed, for the line at close
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
            self.dropped += left
            self._queue.clear()
            self._in_flight = 0
            self._closed = True
            if left + self._gave_up:
                log.warning("%d reports not pushed to %s within the %g s of close (last "
                            "try: %s); dropped, %d in all this run", left + self._gave_up,
                            self.where, timeout, self._failure, self.dropped)

    # -- the background thread ---------------------------------------------------------------

    def _take(self) -> list[ReportBatch]:
        with self._cond:
            if not self._queue and not self._closing:
                self._cond.wait(self._flush_interval_s)
            n = min(len(self._queue), self._batch_size)
            self._in_flight = n
            return [self._queue.popleft() for _ in range(n)]

    def _bodies(self, taken: list[ReportBatch]) -> list[ReportBatch]:
        """One batch per run and rank, in order, each stamped with the drops so far and at
        most MAX_BATCH_BYTES as a request body."""
        stamp = {"dropped_reports": self.dropped}
        bodies: list[ReportBatch] = []
        for (run_id, rank), group in itertools.groupby(taken, lambda b: (b.run_id, b.rank)):
            reports = [r.model_copy(update=stamp) for b in group for r in b.reports]
            bodies += _split(ReportBatch(run_id=run_id, rank=rank, reports=reports))
        return bodies

    def _run(self) -> None:
        try:
            while True:
                for part in self._bodies(self._take()):
                    self._send(part)
                with self._cond:
                    if self._closing and (not self._queue or time.monotonic() > self._deadline):
                        return
        finally:
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()

    def _say(self, log_it: Callable[[], None]) -> None:
        """Log from the push thread, unless close() has returned (then nothing more)."""
        with self._cond:
            if not self._closed:
                log_it()

    def _settle(self, count: int, *, sent: bool) -> None:
        with self._cond:
            if sent:
                self.sent += count
            else:
                self.dropped += count
            self._in_flight = max(0, self._in_flight - count)

    def _post(self, body: bytes) -> Answer:
        """One request, bounded as a whole by deadline_s (and by close's deadline)."""
        limit = self._deadline_s
        with self._cond:
            if self._closing:
                limit = min(limit, max(0.0, self._deadline - time.monotonic()))
        request = self._client.build_request("POST", self.endpoint, content=body)
        answer = read_answer(self._client, request, self._max_answer_bytes)
        try:
            return self._loop.run_until_complete(asyncio.wait_for(answer, limit))
        finally:
            # An answer left unread leaves httpcore's stream generators to the loop's finaliser,
            # which schedules their closing; this loop runs only inside these calls, so give
            # them their turn now (or they are destroyed pending when the loop closes).
            self._loop.run_until_complete(asyncio.sleep(0))

    def _send(self, part: ReportBatch) -> None:
        delay, count = self._backoff_s[0], len(part.reports)
        while True:
            wait = delay
            try:
                sent_for = self._server.version
                a = self._post(self._server.body(part))
                if (older := self._server.heard(a.status, a.wire_version)) is not None:
                    self._say(functools.partial(log.warning, "%s", older))
                if a.status == 422 and self._server.version < sent_for:
                    continue  # an older server: sent again at once without what it lacks
                if a.status < 300:
                    self._settle(count, sent=True)
                    self._failing = False
                    return
                if a.status not in _RETRY_STATUS:
                    self._settle(count, sent=False)
                    self._say(functools.partial(self._errors.say, str(a.status), refusal(
                        self.where, count, a, token_sent=self._token_sent)))
                    return
                why = f"HTTP {a.status}"
                wait = max(delay, a.retry_after_s or 0.0)
            except (httpx.HTTPError, TimeoutError) as e:
                if (cert := certificate_problem(e)) is not None:
                    self._settle(count, sent=False)
                    self._say(functools.partial(self._errors.say, "tls",
                                                certificate_refused(self.where, count, cert)))
                    return
                why = (f"no complete answer within {self._deadline_s:g} s"
                       if isinstance(e, TimeoutError) else failure(e))
            except Exception as e:  # whatever a receiver answers, the push thread lives on
                # An answer nothing above expects (a header httpx or we cannot read): retrying
                # will not heal it; dropped and counted, said once a minute, as a refusal is.
                self._settle(count, sent=False)
                self._say(functools.partial(self._errors.say, type(e).__name__, unusable(
                    self.where, count, failure(e))))
                return
            with self._cond:
                # Said at the first failure, not only by a count at exit; while closing, close
                # says what was lost (nothing waits to be retried then).
                if not self._failing and not self._closing:
                    log.warning("cannot push to %s (%s); reports wait in the queue and "
                                "are retried with backoff", self.where, why)
                self._failing = True
                self._failure = why
                resume = time.monotonic() + wait
                if not self._closing:
                    log.debug("push to %s failed (%s); retrying in %.1f s", self.where,
                              why, wait)
                    # Only close() ends this early: emit() notifies the condition too, and a
                    # queue that stays full during an outage would cut every backoff short.
                    self._cond.wait_for(lambda: self._closing, wait)
                if self._closing and resume > self._deadline:
                    # The next try would come after close's deadline: no more tries for any
                    # batch (the server asked for the wait); close() says how many were lost.
                    self._deadline = min(self._deadline, time.monotonic())
                    self._gave_up += count
                    self._settle(count, sent=False)
                    return
            if (left := resume - time.monotonic()) > 0:  # closing, with time for one more try
                time.sleep(left)
            delay = min(delay * 2, self._backoff_s[1])


def _close_at_exit(ref: weakref.ref[PushSink]) -> None:
    if (sink := ref()) is not None:
        sink.close(timeout=2.0)


def _split(batch: ReportBatch) -> list[ReportBatch]:
    """The batch in parts whose request bodies are at most MAX_BATCH_BYTES each (halved until
    they fit; a single report is always far below the limit, and a body lowered for an older
    server is smaller still)."""
    n = len(batch.reports)
    if n == 1 or len(batch.model_dump_json().encode()) <= MAX_BATCH_BYTES:
        return [batch]
    halves: list[list[StepReport]] = [batch.reports[: n // 2], batch.reports[n // 2 :]]
    return [part for half in halves for part in _split(batch.model_copy(update={"reports": half}))]
