"""The FastAPI application: one store, turns for the bodies, the scrapes and the reads in
flight, five routers (four for the trainer's embedded endpoint, which takes no reports)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from guard_server.auth import ReadAuth
from guard_server.errors import BusyError
from guard_server.framing import CloseAfter
from guard_server.headers import AnswerHeaders
from guard_server.limits import TURN_WAIT_S, Turns
from guard_server.reads import READ_WAIT_S, reads_busy
from guard_server.routes import ROUTERS, ingest_router
from guard_server.scrapes import ScrapeClock
from guard_server.settings import Settings
from guard_server.store import Store

__all__ = ["create_app"]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.ready = True
    yield
    # Tell load balancers to stop sending before uvicorn drains the open connections.
    app.state.ready = False


def _scrapes_busy(limit: int, waited_s: float) -> BusyError:
    return BusyError(limit, waited_s, setting="MAX_INFLIGHT_SCRAPES",
                     serving="writing {limit} scrapes", consequence="this one was not begun")


def create_app(
    settings: Settings | None = None, store: Store | None = None, *, ingest: bool = True
) -> FastAPI:
    """Build the guard server app; pass `store` to share state with an in-process caller.

    `ingest=False` serves the reads only (the trainer's embedded endpoint: its store is fed
    in-process, and a POST from anywhere else must not grow the training process).
    """
    settings = settings if settings is not None else Settings()
    store = store if store is not None else Store(settings)
    app = FastAPI(
        title="guard server",
        summary="Collects logitguard step reports and serves them to Prometheus.",
        version="1",
        lifespan=_lifespan,
        # No redirect of /runs/x/ to /runs/x: starlette builds its Location from the request's
        # Host header, so a forged Host made this server send a browser to another site.
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.store = store
    # A turn is waited for within the read timeout, so a waiting body is a 429, never a 408.
    wait_s = min(TURN_WAIT_S, settings.read_timeout_s / 2)
    app.state.body_slots = Turns(settings.max_inflight_bodies, wait_s)
    app.state.scrape_turns = Turns(settings.max_inflight_scrapes, settings.scrape_wait_s,
                                   _scrapes_busy)
    app.state.read_turns = Turns(settings.max_inflight_reads, READ_WAIT_S, reads_busy)
    app.state.scrapes = ScrapeClock()  # when /metrics was read (the trainer's last scrape)
    app.state.ready = False
    for router in ROUTERS:
        if ingest or router is not ingest_router:
            app.include_router(router)
    if settings.token is not None:
        app.add_middleware(ReadAuth, token=settings.token, metrics=settings.metrics_token)
    # Added last, so they are outermost: they see every answer, ReadAuth's 401s included.
    app.add_middleware(CloseAfter)
    app.add_middleware(AnswerHeaders)
    return app
