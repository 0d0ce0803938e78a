"""Report requests refused, per reason: one counter, counted where each request is refused
(the ingest route before a body is parsed, the store at ingest) and read at each scrape."""

from __future__ import annotations

import threading
from typing import Literal, get_args

__all__ = ["REJECT_REASONS", "RejectReason", "Rejections"]

RejectReason = Literal[
    "bad_framing",
    "unauthorized",
    "not_json",
    "too_large",
    "busy",
    "timeout",
    "disconnected",
    "invalid",
    "implausible_step",
    "over_capacity",
    "over_budget",
]
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)


class Rejections:
    """Thread-safe counts per reason (guard_ingest_rejected_total{reason})."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[RejectReason, int] = dict.fromkeys(REJECT_REASONS, 0)

    def count(self, reason: RejectReason) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[RejectReason, int]:
        with self._lock:
            return dict(self._counts)
