"""GET / and GET /runs/{run_id}: the runs as HTML pages for a person with a browser and no
Grafana (docs/server.md, "The page"). Served by the server and by the trainer's endpoint alike,
under the read token when one is set (guard_server/auth.py); not in the OpenAPI document,
which describes the API. Each page is cut to GUARD_SERVER_MAX_PAGE_BYTES whatever the trainers
sent (page/sizes.py), and built and answered in a turn of GUARD_SERVER_MAX_INFLIGHT_READS
(guard_server/reads.py)."""

from __future__ import annotations

from functools import partial
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Query
from starlette.responses import HTMLResponse, Response

from guard_server.deps import ReadTurnsDep, SettingsDep, StoreDep
from guard_server.errors import BusyError
from guard_server.page.render import page
from guard_server.page.sizes import CHROME, event_cost, fitting, rank_cost, run_cost
from guard_server.page.views import EVENTS_SHOWN, rank_rows, recent_events, run_rows
from guard_server.reads import in_turn
from guard_server.routes.runs import BUSY_RETRY_AFTER_S
from guard_server.store import Store
from guard_server.trail import TRAIL_POINTS

__all__ = ["router"]

router = APIRouter(tags=["pages"], include_in_schema=False)

PAGE = 100  # ranks per page of a run: ~100 KiB of HTML, every one with two sparklines
MAX_PAGE = 256  # ~0.3 MiB of HTML at most (docs/benchmarks.md, "The page")


def _busy(exc: BusyError) -> Response:
    return page("message.html", status=429, refresh=False, title="Busy", back="",
                text=f"{exc} The page reloads itself once a turn is free.",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})


@router.get("/", response_class=HTMLResponse)
async def runs_page(store: StoreDep, settings: SettingsDep, turns: ReadTurnsDep) -> Response:
    """Every run held (as many as the page's bytes allow): its summary, the ranks that need a
    look first, its latest events."""
    return await in_turn(turns, partial(_runs, store, settings.max_page_bytes), _busy)


def _runs(store: Store, bound: int) -> Response:
    views = store.snapshot().ranks
    runs = run_rows(views, store.now())
    shown, _ = fitting(runs, run_cost, bound - CHROME, at_least=1)
    halted = sum(r.halted_count for r in runs)
    return page("runs.html", runs=runs, shown=shown, rank_count=len(views), halted=halted,
                bound=bound)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(
    run_id: str,
    store: StoreDep,
    settings: SettingsDep,
    turns: ReadTurnsDep,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PAGE,
) -> Response:
    """One run: a page of its ranks (by rank) with sparklines, and its latest events."""
    build = partial(_run, store, run_id, offset, limit, settings.max_page_bytes)
    return await in_turn(turns, build, _busy)


def _run(store: Store, run_id: str, offset: int, limit: int, bound: int) -> Response:
    views = store.snapshot(run_id).ranks
    if not views:
        return page("message.html", status=404, refresh=False, title="No such run",
                    text=f"No rank of the run {run_id!r} is held: it never reported, or every "
                    "rank expired (GUARD_SERVER_RANK_TTL_S).", back="../")
    now = store.now()
    (run,) = run_rows(views, now)
    # The events take at most half the page; the ranks the rest, one at least: those cut off
    # start the next page.
    events = recent_events(views, EVENTS_SHOWN)
    events_shown, spent = fitting(events, event_cost, (bound - CHROME) // 2)
    shown = views[offset:offset + limit]
    rows, _ = fitting(rank_rows(shown, store.trails(run_id, [v.rank for v in shown]), now),
                      rank_cost, bound - CHROME - spent, at_least=1)
    shown = shown[:len(rows)]
    end = offset + len(shown)
    return page("run.html", run=run, rows=rows, events_rows=events_shown,
                events_left=len(events) - len(events_shown), bound=bound,
                first=shown[0].rank if shown else 0, last=shown[-1].rank if shown else 0,
                limit=limit, points=TRAIL_POINTS,
                previous=max(offset - limit, 0) if offset > 0 else None,
                next=end if end < len(views) else None,
                json_href="../v1/runs/" + quote(run_id, safe=""))
