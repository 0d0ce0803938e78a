"""What the routes read from the app, as typed dependencies.

`create_app` puts the settings, the store, the turns for bodies, scrapes and reads and the
ready flag on `app.state`; only this module reads them back, and a route asks for them by type:

    def list_runs(store: StoreDep) -> RunList: ...
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request

from guard_server.limits import Turns
from guard_server.settings import Settings
from guard_server.store import Store

__all__ = ["BodySlotsDep", "ReadTurnsDep", "ReadyDep", "ScrapeTurnsDep", "SettingsDep",
           "StoreDep"]


def _state(name: str) -> Callable[[Request], Awaitable[Any]]:
    # Read per request, never captured: the lifespan flips `ready` at startup and shutdown.
    # async: FastAPI would run a plain def in its thread pool, a hop per request on ingest.
    async def read(request: Request) -> Any:
        return getattr(request.app.state, name)

    return read


SettingsDep = Annotated[Settings, Depends(_state("settings"))]
StoreDep = Annotated[Store, Depends(_state("store"))]
BodySlotsDep = Annotated[Turns, Depends(_state("body_slots"))]
ScrapeTurnsDep = Annotated[Turns, Depends(_state("scrape_turns"))]
ReadTurnsDep = Annotated[Turns, Depends(_state("read_turns"))]
ReadyDep = Annotated[bool, Depends(_state("ready"))]
