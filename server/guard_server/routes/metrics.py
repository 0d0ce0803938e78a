"""GET /metrics: the Prometheus exposition, text or OpenMetrics as the Accept header asks,
written a piece at a time (guard_server/exposition.py) by at most
GUARD_SERVER_MAX_INFLIGHT_SCRAPES scrapes at once."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AsyncExitStack
from functools import partial

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import ALLOWUTF8, UNDERSCORES
from prometheus_client.registry import Collector
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from guard_server.deps import ScrapeTurnsDep, StoreDep
from guard_server.errors import BusyError
from guard_server.exposition import exposition
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


class _Exposition(StreamingResponse):
    """The pieces, each rendered in the thread pool when the connection has taken the one
    before; the scrape's turn is given back once they are sent or the client is gone."""

    def __init__(self, pieces: Generator[bytes, None, None], content_type: str,
                 turn: AsyncExitStack) -> None:
        super().__init__(pieces, headers={"Content-Type": content_type})
        self._pieces, self._turn = pieces, turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._pieces.close()  # a scrape cut short lets go of its keys now, not at GC
            await self._turn.aclose()


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
    return _Exposition(exposition(store, encode), content_type, turn)
