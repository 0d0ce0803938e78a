"""GET /v1/runs and /v1/runs/{run_id}: the stored state as JSON."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from guard_server.deps import StoreDep
from guard_server.responses import Problem, RankState, RunDetail, RunList, summarize

__all__ = ["router"]

router = APIRouter(tags=["runs"])

PAGE = 100  # ranks per page of GET /v1/runs/{run_id} by default
MAX_PAGE = 1000


@router.get("/v1/runs", response_model=RunList, summary="Runs the server holds")
def list_runs(store: StoreDep) -> RunList:
    """One summary per run: rank count, finished ranks, highest step, last report time."""
    return RunList(runs=summarize(store.snapshot().ranks))


@router.get(
    "/v1/runs/{run_id}",
    response_model=RunDetail,
    responses={404: {"model": Problem, "description": "no live rank of this run"}},
    summary="Per-rank state of one run",
)
def get_run(
    run_id: str,
    store: StoreDep,
    offset: Annotated[int, Query(ge=0, description="first rank index of the page")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="ranks per page")] = PAGE,
) -> RunDetail:
    """A page of ranks (by rank): last step, last report time, latest values, last violations.

    Paged because a rank's state can be ~0.6 MiB at the wire's limits: 512 ranks in one body
    would be hundreds of MiB. `next_offset` is null on the last page.
    """
    views = store.snapshot(run_id).ranks
    if not views:
        raise HTTPException(404, f"no run {run_id!r}: never reported, or all its ranks expired")
    page = views[offset : offset + limit]
    end = offset + len(page)
    return RunDetail(
        run_id=run_id,
        total=len(views),
        offset=offset,
        limit=limit,
        next_offset=end if end < len(views) else None,
        ranks=[RankState.of(v) for v in page],
    )
