"""Response bodies of the JSON endpoints (documented in the OpenAPI schema)."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic_core import to_json

from guard_server.store import RankView
from guard_server.wire import Event, StepReport

__all__ = [
    "Accepted",
    "ErrorItem",
    "Health",
    "Problem",
    "RankState",
    "RunDetail",
    "RunList",
    "RunSummary",
    "ValidationProblem",
    "summarize",
]


class Accepted(BaseModel):
    """202 body: how many step reports of the batch were stored."""

    accepted: int


class Problem(BaseModel):
    """Body of a 401, 404, 413 or 429: what went wrong and what to do."""

    detail: str


class ErrorItem(BaseModel):
    """One validation error; `loc` names the field, starting with "body"."""

    type: str
    loc: list[str | int]
    msg: str


class ValidationProblem(BaseModel):
    """Body of a 422, the same shape FastAPI uses for its own validation errors."""

    detail: list[ErrorItem]


class Health(BaseModel):
    """Body of /healthz and /readyz."""

    status: str
    runs: int
    ranks: int


class RunSummary(BaseModel):
    """One run in GET /v1/runs."""

    run_id: str
    ranks: int
    finished_ranks: int
    last_step: int
    last_report_time: float


class RunList(BaseModel):
    """Body of GET /v1/runs."""

    runs: list[RunSummary]


class RankState(BaseModel):
    """One rank in GET /v1/runs/{run_id}: its latest report and its last violations."""

    rank: int
    step: int
    last_report_time: float
    finished: bool
    latest: StepReport
    recent_events: list[Event]

    @classmethod
    def of(cls, view: RankView) -> RankState:
        """Build from a store view."""
        return cls(
            rank=view.rank,
            step=view.latest.step,
            last_report_time=view.last_seen,
            finished=view.finished_at is not None,
            latest=view.latest,
            recent_events=list(view.events),
        )


class RunDetail(BaseModel):
    """Body of GET /v1/runs/{run_id}: one page of its ranks, by rank."""

    run_id: str
    total: int  # ranks of the run held now
    offset: int
    limit: int
    next_offset: int | None  # pass as `offset` for the next page; null on the last one
    ranks: list[RankState]

    def json_with(self, ranks: list[bytes]) -> bytes:
        """This page as JSON with `ranks`, each already JSON, as its ranks: the route
        serialises each rank once, to measure the page as it grows."""
        envelope = to_json(self.model_dump(exclude={"ranks"}))  # b'{...}'
        return b"".join((envelope[:-1], b',"ranks":[', b",".join(ranks), b"]}"))


def summarize(views: list[RankView]) -> list[RunSummary]:
    """Group rank views (sorted by run) into one summary per run."""
    by_run: dict[str, list[RankView]] = {}
    for view in views:
        by_run.setdefault(view.run_id, []).append(view)
    return [
        RunSummary(
            run_id=run_id,
            ranks=len(ranks),
            finished_ranks=sum(v.finished_at is not None for v in ranks),
            last_step=max(v.latest.step for v in ranks),
            last_report_time=max(v.last_seen for v in ranks),
        )
        for run_id, ranks in by_run.items()
    ]
