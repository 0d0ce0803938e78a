"""What a page's rows cost in bytes once escaped, so that a page is cut to its bound
(GUARD_SERVER_MAX_PAGE_BYTES) before it is rendered, whatever the text the trainers sent: in
HTML a `"` is `&#34;`, five bytes, and a bidi control in a tooltip `&lt;U+202E&gt;`, fourteen.
63 runs of 32 events of 4,096 quotes made the list of runs 7.9 MiB when nothing was counted.

Each cost is an upper bound of what the templates write for the row (tests/server/
test_hostile_pages.py holds whole pages to the bound), counted from the row's own text."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from markupsafe import escape

from guard_server.page.sparkline import Spark
from guard_server.page.views import EventRow, RankRow, RunRow

__all__ = ["CHROME", "TOOLTIP", "event_cost", "fitting", "rank_cost", "run_cost", "visible"]

T = TypeVar("T")

# The page around the rows: head, stylesheet, headings, notes (measured ~3 KiB).
CHROME = 8 << 10
# Characters of a message in an event's tooltip (its title attribute; the text shows it whole).
TOOLTIP = 300
# Bidi controls (embeddings and overrides U+202A-202E, isolates U+2066-2069, the marks U+061C,
# U+200E, U+200F): in a trainer's text they reorder what follows them. In the page's text each
# such text is a <bdi> of its own, which keeps them inside it; in an attribute (a tooltip, no
# element to hold them) they are written out as their code points.
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# The markup of a row without its text: a rank's cells (~0.6 KiB), an event's (~0.3 KiB), a
# run's section with its headings and notes (~0.8 KiB); a sparkline's box and its title
# (~0.4 KiB) and each lone dot (~40 bytes), beside its points.
_RANK, _EVENT, _RUN, _SPARK, _DOT = 1024, 512, 1536, 512, 48


def visible(text: object) -> str:
    """`text` with each bidi control written out (<U+202E>): for attributes."""
    return _BIDI.sub(lambda m: f"<U+{ord(m[0]):04X}>", str(text))


def _escaped(text: str) -> int:
    return len(str(escape(text)).encode())


def _spark(spark: Spark | None) -> int:
    if spark is None:
        return 0
    return _SPARK + sum(len(line) + 32 for line in spark.lines) + _DOT * len(spark.dots) + \
        _escaped(spark.why)


def rank_cost(row: RankRow) -> int:
    """The most the templates write for a rank's row (and its halted message's row)."""
    texts = (row.age, row.loss, row.padding_mass, row.grad_norm, row.nonfinite,
             row.out_of_range, row.halted, row.why, *row.violations,
             *(row.grad_top or ()))
    return _RANK + sum(_escaped(t) + 2 for t in texts) + _spark(row.loss_spark) + \
        _spark(row.mass_spark)


def event_cost(row: EventRow) -> int:
    """The most the templates write for an event: module and message, each as text and (cut
    to TOOLTIP characters) as a tooltip."""
    return (_EVENT + 2 * _escaped(visible(row.module)) + _escaped(row.message)
            # Jinja's truncate keeps up to 5 characters more, and its "...".
            + _escaped(visible(row.message[:TOOLTIP + 8])) + _escaped(row.check + row.action))


def run_cost(run: RunRow) -> int:
    """A run's section on the list of runs: its summary, its ranks shown, its events."""
    texts = (run.run_id, run.href, run.steps, run.age, *run.halted, *run.violations)
    return _RUN + 2 * sum(_escaped(t) + 2 for t in texts) + \
        sum(rank_cost(r) for r in run.shown) + sum(event_cost(e) for e in run.events)


def fitting(rows: Sequence[T], cost: Callable[[T], int], budget: int,
            at_least: int = 0) -> tuple[Sequence[T], int]:
    """The first of `rows` that fit `budget` bytes together (at least `at_least` of them,
    whatever they cost), and the bytes they take."""
    spent = 0
    for n, row in enumerate(rows):
        more = cost(row)
        if spent + more > budget and n >= at_least:
            return rows[:n], spent
        spent += more
    return rows, spent
