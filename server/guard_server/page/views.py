"""What the pages show, from the store's views: plain rows of text for the templates, which
escape every one of them (everything here came from a trainer and is untrusted)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from guard_server.page.sparkline import Spark, sparkline
from guard_server.store import RankView
from guard_server.trail import Point
from guard_server.wire import Event, StepReport

__all__ = [  # noqa: RUF022 - sorted() order, as tests/server/test_isolation.py checks
    "EVENTS_SHOWN", "EventRow", "RANKS_SHOWN", "RankRow", "RunRow", "age", "cut",
    "padding_mass_text", "plural", "rank_rows", "recent_events", "run_rows",
]

RANKS_SHOWN = 8  # per run on the list of runs: those that need a look first
EVENTS_SHOWN = 32  # on a page, newest first: one report's worth (wire.MAX_EVENTS)
_RECENT = 5  # per run on the list of runs
WHY_SHOWN = 600  # characters of a halted rank's message in its row (cut at a space; whole in
# the events)


@dataclass(frozen=True)
class EventRow:
    rank: int
    step: int
    check: str
    action: str
    module: str
    message: str


@dataclass(frozen=True)
class RankRow:
    rank: int
    step: int
    age: str
    state: str  # "halted", "finished" or "running"
    loss: str
    padding_mass: str
    grad_norm: str
    nonfinite: str
    out_of_range: str
    violations: tuple[str, ...]  # "check/action: count"
    halted: str  # the check that stopped it, "" if none
    why: str  # that check's last message, "" when none is held
    loss_spark: Spark | None = None  # on a run's page only
    mass_spark: Spark | None = None
    grad_top: tuple[str, str] | None = None  # the largest gradient's parameter, its share


@dataclass(frozen=True)
class RunRow:
    run_id: str
    href: str  # the run's page, relative to the list of runs
    ranks: int
    finished: int
    halted: tuple[str, ...]  # "rank 3: token_range", at most RANKS_SHOWN
    halted_count: int
    steps: str
    age: str
    violations: tuple[str, ...]
    shown: tuple[RankRow, ...]  # the ranks that need a look first
    events: tuple[EventRow, ...]


def age(seconds: float) -> str:
    """How long ago, as a person reads it."""
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.0f} h"


def _num(x: float | None, missing: str = "not reported") -> str:
    return missing if x is None else f"{x:.4g}"


def _counts(by_kind: dict[str, int]) -> str:
    shown = [f"{k} {n}" for k, n in by_kind.items() if n]
    return ", ".join(shown) or "0"


def _violations(reports: Iterable[StepReport]) -> tuple[str, ...]:
    total: dict[tuple[str, str], int] = {}
    for r in reports:
        for check, by_action in r.violations.items():
            for action, n in by_action.items():  # 0: enabled, never fired (not shown)
                if n:
                    total[check, action] = total.get((check, action), 0) + n
    return tuple(f"{c}/{a}: {n}" for (c, a), n in sorted(total.items()))


def recent_events(views: Iterable[RankView], keep: int) -> tuple[EventRow, ...]:
    """The newest `keep` events of these ranks: a heap of `keep`, not a list of every event
    held (16,384 ranks hold up to half a million)."""
    newest = heapq.nlargest(keep, ((e.step, v.rank, i, e) for v in views
                                   for i, e in enumerate(v.events)), key=lambda t: t[:3])
    return tuple(EventRow(rank, step, e.check, e.action, e.module or "", e.message)
                 for step, rank, _, e in newest)


def _why(view: RankView) -> str:
    """The message of the fail that halted it, cut to WHY_SHOWN characters: a page of ranks
    at the wire's limits would otherwise be ~20 KiB of escaped text a rank."""
    stop: Event | None = next((e for e in reversed(view.events) if e.action == "fail"
                               and e.check == view.latest.halted), None)
    if stop is None:
        return ""
    return cut(stop.message, WHY_SHOWN)


def cut(text: str, most: int) -> str:
    """`text` whole if it has at most `most` characters, else cut at the last space within
    them (never inside a word or a number: "vocab 1000" is not shown as "vocab 100") and
    marked " [...]"; a text without a space there is cut at `most`."""
    if len(text) <= most:
        return text
    head = text[:most]
    if not text[most].isspace() and (space := head.rfind(" ")) > 0:
        head = head[:space]
    return head.rstrip() + " [...]"


def plural(n: int, word: str) -> str:
    """ "1 rank", "2 ranks": `word` is the singular, its plural adds an s."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def padding_mass_text(mean: float | None, top: float | None, limit: float | None) -> str:
    """The padding mass as the page shows it: the mean, the largest position's and the bound
    it is judged against (the check fires when the largest is over it; where the report
    carries it)."""
    text = _num(mean, "not measured")
    notes = [] if top is None else [f"max {top:.4g}"]
    if limit is not None and mean is not None:
        over = top is not None and top > limit
        notes.append(f"{'over the' if over else ''} bound {limit:.4g}".strip())
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _rank(view: RankView, now: float, trail: Sequence[Point] | None = None) -> RankRow:
    r = view.latest
    state = "halted" if r.halted else "finished" if view.finished_at is not None else "running"
    # grad_norm came with wire version 3: absent (an older guard) means not reported.
    grad, top = _num(r.grad_norm), None
    if r.grad_norm is not None and r.grad_norm_top is not None:
        share = "" if r.grad_norm_top_share is None else f" {r.grad_norm_top_share:.0%}"
        top = (r.grad_norm_top, share)
    mass = padding_mass_text(r.padding_mass, r.padding_mass_max, r.padding_mass_bound)
    loss_spark = None if trail is None else sparkline([(s, v) for s, v, _ in trail], "loss")
    mass_spark = None if trail is None else sparkline([(s, m) for s, _, m in trail],
                                                      "padding mass")
    # null on the wire: none, or not finite (counted in nonfinite.loss)
    loss = _num(r.loss, "non-finite" if r.nonfinite.loss and r.loss is None else "not reported")
    return RankRow(view.rank, r.step, age(now - view.last_seen), state, loss, mass,
                   grad, _counts(r.nonfinite.model_dump(exclude_none=True)),
                   _counts(r.out_of_range.model_dump()), _violations([r]), r.halted or "",
                   _why(view), loss_spark, mass_spark, top)


def rank_rows(views: Sequence[RankView], trails: dict[int, list[Point]],
              now: float) -> tuple[RankRow, ...]:
    """A run's page: each rank with its sparklines."""
    return tuple(_rank(v, now, trails.get(v.rank, [])) for v in views)


def _first_to_look_at(view: RankView) -> tuple[int, int, int]:
    return (0 if view.latest.halted else 1, 0 if view.latest.violations else 1, view.rank)


def run_rows(views: Sequence[RankView], now: float) -> tuple[RunRow, ...]:
    """The list of runs: per run, a summary, the ranks that need a look first and its latest
    events. `views` sorted by run and rank, as the store's snapshot is."""
    by_run: dict[str, list[RankView]] = {}
    for v in views:
        by_run.setdefault(v.run_id, []).append(v)
    out = []
    for run_id, ranks in by_run.items():
        halted = [v for v in ranks if v.latest.halted]
        steps = [v.latest.step for v in ranks]
        shown = sorted(ranks, key=_first_to_look_at)[:RANKS_SHOWN]
        out.append(RunRow(
            run_id, "runs/" + quote(run_id, safe=""), len(ranks),
            sum(v.finished_at is not None for v in ranks),
            tuple(f"rank {v.rank}: {v.latest.halted}" for v in halted[:RANKS_SHOWN]),
            len(halted), f"{min(steps)}" if min(steps) == max(steps) else
            f"{min(steps)}-{max(steps)}", age(now - max(v.last_seen for v in ranks)),
            _violations(v.latest for v in ranks), tuple(_rank(v, now) for v in shown),
            recent_events(ranks, _RECENT)))
    return tuple(out)
