"""GET / and GET /runs/{run_id}: the runs as HTML pages for a person with a browser and no
Grafana (docs/server.md, "The page"). Served by the server and by the trainer's endpoint alike,
under the read token when one is set (guard_server/auth.py); not in the OpenAPI document,
which describes the API."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Query
from starlette.responses import HTMLResponse

from guard_server.deps import StoreDep
from guard_server.page.render import page
from guard_server.page.views import EVENTS_SHOWN, rank_rows, recent_events, run_rows
from guard_server.trail import TRAIL_POINTS

__all__ = ["router"]

router = APIRouter(tags=["pages"], include_in_schema=False)

PAGE = 100  # ranks per page of a run: ~100 KiB of HTML, every one with two sparklines
MAX_PAGE = 256  # ~0.3 MiB of HTML at most (docs/benchmarks.md, "The page")


@router.get("/", response_class=HTMLResponse)
def runs_page(store: StoreDep) -> HTMLResponse:
    """Every run held: its summary, the ranks that need a look first, its latest events."""
    views = store.snapshot().ranks
    runs = run_rows(views, store.now())
    halted = sum(r.halted_count for r in runs)
    return page("runs.html", runs=runs, rank_count=len(views), halted=halted)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(
    run_id: str,
    store: StoreDep,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PAGE,
) -> HTMLResponse:
    """One run: a page of its ranks (by rank) with sparklines, and its latest events."""
    views = store.snapshot(run_id).ranks
    if not views:
        return page("message.html", status=404, refresh=False, title="No such run",
                    text=f"No rank of the run {run_id!r} is held: it never reported, or every "
                    "rank expired (GUARD_SERVER_RANK_TTL_S).", back="../")
    now = store.now()
    (run,) = run_rows(views, now)
    shown = views[offset:offset + limit]
    rows = rank_rows(shown, store.trails(run_id, [v.rank for v in shown]), now)
    end = offset + len(shown)
    return page("run.html", run=run, rows=rows, events_rows=recent_events(views, EVENTS_SHOWN),
                first=shown[0].rank if shown else 0, last=shown[-1].rank if shown else 0,
                limit=limit, points=TRAIL_POINTS,
                previous=max(offset - limit, 0) if offset > 0 else None,
                next=end if end < len(views) else None,
                json_href="../v1/runs/" + quote(run_id, safe=""))
