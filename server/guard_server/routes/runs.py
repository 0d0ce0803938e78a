"""GET /v1/runs and /v1/runs/{run_id}: the stored state as JSON."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from guard_server.deps import StoreDep
from guard_server.responses import Problem, RankState, RunDetail, RunList, summarize

__all__ = ["router"]

router = APIRouter(tags=["runs"])


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
def get_run(run_id: str, store: StoreDep) -> RunDetail:
    """Every rank's last step, last report time, latest values and last violations."""
    views = store.snapshot(run_id).ranks
    if not views:
        raise HTTPException(404, f"no run {run_id!r}: never reported, or all its ranks expired")
    return RunDetail(run_id=run_id, ranks=[RankState.of(v) for v in views])
