"""Running the app under uvicorn: the blocking `serve()` behind `guard serve`."""

from __future__ import annotations

from typing import Any

import uvicorn
from fastapi import FastAPI

from guard_server.app import create_app
from guard_server.settings import Settings

__all__ = ["serve", "uvicorn_config"]


def uvicorn_config(
    app: FastAPI, settings: Settings, *, host: str, port: int, own_logging: bool
) -> uvicorn.Config:
    """One uvicorn worker for `app`; `own_logging=False` leaves the host's logging alone."""
    # A single worker on purpose: the state lives in this process's memory, so a second worker
    # would hold a different half of the ranks and each scrape would see one half.
    extra: dict[str, Any] = {} if own_logging else {"log_config": None}
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        workers=1,
        loop="asyncio",
        lifespan="on",
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=5,
        **extra,
    )


def serve(
    host: str | None = None, port: int | None = None, settings: Settings | None = None
) -> None:
    """Serve until SIGINT/SIGTERM; host and port default to GUARD_SERVER_HOST/PORT."""
    overrides = {key: val for key, val in {"host": host, "port": port}.items() if val is not None}
    settings = Settings(**overrides) if settings is None else settings.model_copy(update=overrides)
    config = uvicorn_config(
        create_app(settings), settings, host=settings.host, port=settings.port, own_logging=True
    )
    uvicorn.Server(config).run()
