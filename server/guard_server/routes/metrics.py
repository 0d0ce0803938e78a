"""GET /metrics: the Prometheus exposition, text or OpenMetrics as the Accept header asks,
written a piece at a time (guard_server/exposition.py) by at most
GUARD_SERVER_MAX_INFLIGHT_SCRAPES scrapes at once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from functools import partial

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import ALLOWUTF8, UNDERSCORES
from prometheus_client.registry import Collector
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from guard_server.deps import ScrapeTurnsDep, StoreDep
from guard_server.errors import BusyError
from guard_server.exposition import SEND_BYTES, exposition
from guard_server.responses import Problem

__all__ = ["encoder_for", "router"]

router = APIRouter(tags=["metrics"])

# Seconds a scrape refused for want of a turn is asked to wait: turns free as scrapes end.
BUSY_RETRY_AFTER_S = 2


def encoder_for(accept: str) -> tuple[Callable[[Collector], bytes], str]:
    """prometheus_client's encoder and content type for an Accept header, sped up for ours."""
    encode, content_type = choose_encoder(accept)
    if isinstance(encode, partial) and encode.keywords.get("escaping") == UNDERSCORES:
        # Every guard_* metric and label name is already a legacy Prometheus name, which
        # "underscores" escaping leaves as it is; "allow-utf-8" writes the same bytes without
        # rewriting each sample's name character by character (~45% of an OpenMetrics scrape).
        encode = partial(encode, escaping=ALLOWUTF8)
    return encode, content_type


class _TurnHeld(Response):
    """An answer that gives its scrape's turn back (and lets go of its chunks) once it is sent
    or its client is gone: a turn never given back would be one scrape fewer at once for good.
    Whole, as a scrape of a few ranks (a rank's own endpoint) is: one answer with its length,
    as cheap as before the pieces."""

    def __init__(self, content: bytes, content_type: str, turn: AsyncExitStack) -> None:
        super().__init__(content, headers={"Content-Type": content_type})
        self.turn = turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.turn.aclose()


class _Exposition(_TurnHeld, StreamingResponse):
    """In chunks, each but the first rendered in the thread pool once the connection has
    taken most of the one before (uvicorn waits while more than 64 KiB is unsent)."""

    def __init__(self, first: bytes, chunks: Iterator[bytes], content_type: str,
                 turn: AsyncExitStack) -> None:
        StreamingResponse.__init__(self, _after(first, chunks),
                                   headers={"Content-Type": content_type})
        self.turn = turn


async def _after(first: bytes, chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in iterate_in_threadpool(chunks):
        yield chunk


@router.get("/metrics", response_class=Response, summary="Prometheus metrics", responses={
    503: {"model": Problem, "description": "GUARD_SERVER_MAX_INFLIGHT_SCRAPES scrapes are "
          "being written and no turn freed within GUARD_SERVER_SCRAPE_WAIT_S"}})
async def metrics(request: Request, store: StoreDep, turns: ScrapeTurnsDep) -> Response:
    """Every guard_* family from the store's current state."""
    encode, content_type = encoder_for(request.headers.get("accept", ""))
    turn = AsyncExitStack()
    try:
        await turn.enter_async_context(turns.turn())
    except BusyError as exc:
        headers = {"Retry-After": str(BUSY_RETRY_AFTER_S)}
        raise HTTPException(503, str(exc), headers=headers) from None
    chunks = exposition(store, encode)
    turn.callback(chunks.close)  # a scrape cut short lets go of its keys now, not at GC
    scrapes = request.app.state.scrapes
    started = scrapes.clock()
    try:
        first = await run_in_threadpool(next, chunks)
    except BaseException:
        await turn.aclose()
        raise
    scrapes.note(started)  # the trainer's endpoint, read whole by now, may stop after this
    if len(first) < SEND_BYTES:  # all of it: only the last chunk is shorter
        return _TurnHeld(first, content_type, turn)
    return _Exposition(first, chunks, content_type, turn)
