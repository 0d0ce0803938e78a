"""GET /v1/runs and /v1/runs/{run_id}: the stored state as JSON."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.responses import JSONResponse
from pydantic_core import to_json

from guard_server.deps import ReadTurnsDep, StoreDep
from guard_server.errors import BusyError
from guard_server.reads import in_turn
from guard_server.responses import Problem, RankState, RunDetail, RunList, summarize
from guard_server.settings import JSON_PAGE_BYTES
from guard_server.store import Store

__all__ = ["router"]

router = APIRouter(tags=["runs"])

PAGE = 100  # ranks per page of GET /v1/runs/{run_id} by default
MAX_PAGE = 1000
# Bytes of one page's JSON: a typical rank is ~0.6 KiB of it (1000 fit), one at the wire's
# limits ~0.5 MiB (4 fit). A page is built one rank at a time, so a read holds about twice this.
MAX_PAGE_BYTES = JSON_PAGE_BYTES
# Seconds a read refused for want of a turn is asked to wait: turns free as answers are taken.
BUSY_RETRY_AFTER_S = 2


@router.get("/v1/runs", response_model=RunList, summary="Runs the server holds")
def list_runs(store: StoreDep) -> RunList:
    """One summary per run: rank count, finished ranks, highest step, last report time."""
    return RunList(runs=summarize(store.snapshot().ranks))


@router.get(
    "/v1/runs/{run_id}",
    response_model=RunDetail,
    responses={404: {"model": Problem, "description": "no live rank of this run"},
               429: {"model": Problem, "description": "GUARD_SERVER_MAX_INFLIGHT_READS reads "
                     "are being answered and no turn freed in time"}},
    summary="Per-rank state of one run",
)
async def get_run(
    run_id: str,
    store: StoreDep,
    turns: ReadTurnsDep,
    offset: Annotated[int, Query(ge=0, description="first rank index of the page")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="ranks per page")] = PAGE,
) -> Response:
    """A page of ranks (by rank): last step, last report time, latest values, last violations.

    Paged in ranks (`limit`) and in bytes (2 MiB of JSON, whatever `limit` says: a rank's
    state can be ~0.5 MiB at the wire's limits, so 1000 ranks could be ~0.5 GiB). A page has
    at least one rank; `next_offset` is where the next one starts, null on the last page.
    Built and answered in a turn of GUARD_SERVER_MAX_INFLIGHT_READS (429 past them).
    """
    return await in_turn(turns, partial(_run_page, store, run_id, offset, limit), _busy)


def _busy(exc: BusyError) -> Response:
    return JSONResponse({"detail": str(exc)}, status_code=429,
                        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})


def _run_page(store: Store, run_id: str, offset: int, limit: int) -> Response:
    views = store.snapshot(run_id).ranks
    if not views:
        raise HTTPException(404, f"no run {run_id!r}: never reported, or all its ranks expired")
    ranks: list[bytes] = []
    size = 0
    for view in views[offset : offset + limit]:
        rank = to_json(RankState.of(view))
        if ranks and size + len(rank) > MAX_PAGE_BYTES - 1024:  # room for the envelope
            break
        ranks.append(rank)
        size += len(rank) + 1
    end = offset + len(ranks)
    page = RunDetail(
        run_id=run_id,
        total=len(views),
        offset=offset,
        limit=limit,
        next_offset=end if end < len(views) else None,
        ranks=[],
    )
    return Response(page.json_with(ranks), media_type="application/json")
