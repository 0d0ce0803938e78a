"""The HTTP routes, one router per concern; `create_app` includes `ROUTERS` in order."""

from __future__ import annotations

from guard_server.routes.health import router as health_router
from guard_server.routes.ingest import router as ingest_router
from guard_server.routes.metrics import router as metrics_router
from guard_server.routes.pages import router as pages_router
from guard_server.routes.runs import router as runs_router

__all__ = ["ROUTERS", "health_router", "ingest_router", "metrics_router", "pages_router",
           "runs_router"]

# The order of the paths in the OpenAPI document (the pages are not in it).
ROUTERS = (ingest_router, metrics_router, runs_router, health_router, pages_router)
