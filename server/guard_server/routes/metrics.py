"""GET /metrics: the Prometheus exposition, text or OpenMetrics as the Accept header asks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from fastapi import APIRouter, Request, Response
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import ALLOWUTF8, UNDERSCORES
from prometheus_client.registry import CollectorRegistry

from guard_server.deps import RegistryDep

__all__ = ["encoder_for", "router"]

router = APIRouter(tags=["metrics"])


def encoder_for(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """prometheus_client's encoder and content type for an Accept header, sped up for ours."""
    encode, content_type = choose_encoder(accept)
    if isinstance(encode, partial) and encode.keywords.get("escaping") == UNDERSCORES:
        # Every guard_* metric and label name is already a legacy Prometheus name, which
        # "underscores" escaping leaves as it is; "allow-utf-8" writes the same bytes without
        # rewriting each sample's name character by character (~45% of an OpenMetrics scrape).
        encode = partial(encode, escaping=ALLOWUTF8)
    return encode, content_type


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
def metrics(request: Request, registry: RegistryDep) -> Response:
    """Render every guard_* family from the store's current state."""
    # A plain def: FastAPI runs it in its thread pool, so a large scrape (about 100 ms for
    # 1024 ranks) does not stall the event loop that accepts pushes.
    encode, content_type = encoder_for(request.headers.get("accept", ""))
    return Response(encode(registry), headers={"Content-Type": content_type})
