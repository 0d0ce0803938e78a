"""GET /metrics: the Prometheus exposition, text or OpenMetrics as the Accept header asks."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client.exposition import choose_encoder

__all__ = ["router"]

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
def metrics(request: Request) -> Response:
    """Render every guard_* family from the store's current state."""
    # A plain def: FastAPI runs it in its thread pool, so a large scrape (about 100 ms for
    # 1024 ranks) does not stall the event loop that accepts pushes.
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(request.app.state.registry), headers={"Content-Type": content_type})
