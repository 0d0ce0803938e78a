"""The FastAPI application: one store, one registry, four routers (three for the trainer's
embedded endpoint, which takes no reports)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from guard_server.auth import ReadAuth
from guard_server.collector import new_registry
from guard_server.framing import CloseAfter
from guard_server.limits import TURN_WAIT_S, BodySlots
from guard_server.routes import ROUTERS, ingest_router
from guard_server.settings import Settings
from guard_server.store import Store

__all__ = ["create_app"]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.ready = True
    yield
    # Tell load balancers to stop sending before uvicorn drains the open connections.
    app.state.ready = False


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
    )
    app.state.settings = settings
    app.state.store = store
    app.state.registry = new_registry(store)  # per app: two apps in one process never clash
    # A turn is waited for within the read timeout, so a waiting body is a 429, never a 408.
    wait_s = min(TURN_WAIT_S, settings.read_timeout_s / 2)
    app.state.body_slots = BodySlots(settings.max_inflight_bodies, wait_s)
    app.state.ready = False
    for router in ROUTERS:
        if ingest or router is not ingest_router:
            app.include_router(router)
    if settings.token is not None:
        app.add_middleware(ReadAuth, token=settings.token, metrics=settings.metrics_token)
    # Added last, so it is outermost: it sees every answer, ReadAuth's 401s included.
    app.add_middleware(CloseAfter)
    return app
