"""GET /healthz (the process answers) and GET /readyz (it accepts reports)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from guard_server.deps import ReadyDep, StoreDep
from guard_server.responses import Health
from guard_server.store import Store

__all__ = ["router"]

router = APIRouter(tags=["health"])


def _health(store: Store, status: str) -> Health:
    runs, ranks = store.size()
    return Health(status=status, runs=runs, ranks=ranks)


@router.get("/healthz", response_model=Health, summary="Liveness")
def healthz(store: StoreDep) -> Health:
    """200 whenever the process can answer."""
    return _health(store, "ok")


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": Health, "description": "starting up or shutting down"}},
    summary="Readiness",
)
def readyz(store: StoreDep, ready: ReadyDep) -> Health | JSONResponse:
    """200 between startup and shutdown, 503 outside them."""
    if ready:
        return _health(store, "ready")
    return JSONResponse(_health(store, "not ready").model_dump(), status_code=503)
