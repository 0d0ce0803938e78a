"""GET /healthz (the process answers) and GET /readyz (it accepts reports)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from guard_server.store import Store
from guard_server.views import Health

__all__ = ["router"]

router = APIRouter(tags=["health"])


def _health(request: Request, status: str) -> Health:
    store: Store = request.app.state.store
    runs, ranks = store.size()
    return Health(status=status, runs=runs, ranks=ranks)


@router.get("/healthz", response_model=Health, summary="Liveness")
def healthz(request: Request) -> Health:
    """200 whenever the process can answer."""
    return _health(request, "ok")


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": Health, "description": "starting up or shutting down"}},
    summary="Readiness",
)
def readyz(request: Request) -> Health | JSONResponse:
    """200 between startup and shutdown, 503 outside them."""
    if request.app.state.ready:
        return _health(request, "ready")
    return JSONResponse(_health(request, "not ready").model_dump(), status_code=503)
