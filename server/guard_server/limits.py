"""Reading a request body under a byte limit, whatever its Content-Length claims; turns, so
that only a few bodies are read (and a few scrapes written) at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from starlette.requests import Request

from guard_server.errors import BodyTooLargeError, BusyError
from guard_server.settings import WAITING_PER_SLOT

__all__ = ["TURN_WAIT_S", "Turns", "read_body"]

# How long a body waits for a turn: honest bodies are read in milliseconds, so a second covers
# a burst of them; past it the server is held by slow clients, and a 429 that says when to
# retry costs the sender less than a connection held open.
TURN_WAIT_S = 1.0


class Turns:
    """At most `slots` requests of a kind served at once and WAITING_PER_SLOT times as many
    waiting for a turn (each at most `wait_s`); any more are refused with `busy(waited_s)`
    before any work on them, so what those in flight hold stays within what
    GUARD_SERVER_MAX_BYTES keeps for them. Bodies read at once (the ingest route) and scrapes
    written at once (GET /metrics) take turns each of their own."""

    def __init__(self, slots: int, wait_s: float = TURN_WAIT_S,
                 busy: Callable[[int, float], BusyError] = BusyError) -> None:
        self.slots = slots
        self.wait_s = wait_s
        self._busy = busy
        self._waiting = 0
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold one of the slots for the block, waiting for one if all are taken."""
        semaphore = self._here()
        if semaphore.locked():
            if self._waiting >= self.slots * WAITING_PER_SLOT:
                raise self._busy(self.slots, 0.0)
            self._waiting += 1
            try:
                async with asyncio.timeout(self.wait_s):
                    await semaphore.acquire()
            except TimeoutError:
                raise self._busy(self.slots, self.wait_s) from None
            finally:
                self._waiting -= 1
        else:
            await semaphore.acquire()  # free: returns at once
        try:
            yield
        finally:
            semaphore.release()

    @property
    def waiting(self) -> int:
        """Bodies waiting for a turn now."""
        return self._waiting

    @property
    def taken(self) -> bool:
        """Every slot is held by a body being read now."""
        return self._semaphore is not None and self._semaphore.locked()

    def _here(self) -> asyncio.Semaphore:
        # An asyncio primitive belongs to the loop that first waits on it, and one app may be
        # served by more than one loop in its life (a TestClient per test, a stop and start).
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._semaphore, self._loop = asyncio.Semaphore(self.slots), loop
        return self._semaphore


async def read_body(request: Request, limit: int, slots: Turns) -> bytes:
    """Return the whole body, or raise BodyTooLargeError as soon as it passes `limit` bytes,
    or BusyError when no slot frees in time."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        # Refuse before reading a byte; the header is honest more often than not.
        raise BodyTooLargeError(limit, int(declared))
    async with slots.turn():
        # Chunked bodies (no Content-Length) and lying headers are caught here, chunk by chunk,
        # so at most `limit` bytes plus one chunk are ever held.
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLargeError(limit, size)
            chunks.append(chunk)
        return b"".join(chunks)
