"""What the store takes of one batch: its sender's latest report, reports kept without their
events (a rank's events live in one deque), and a rank's last events once the batch's are
added."""

from __future__ import annotations

from collections.abc import Iterable

from guard_server.wire import Event, ReportBatch, StepReport

__all__ = ["events_after", "latest_of", "without_events"]


def latest_of(batch: ReportBatch) -> StepReport:
    """The newest report of the batch's newest attach."""
    # A sender switches attach only forward, so the batch's last report names the newest one;
    # within it, ties on step go to the final report, so a detach at a boundary marks it done.
    attach = batch.reports[-1].attach_id
    own = [r for r in batch.reports if r.attach_id == attach]
    return max(own, key=lambda r: (r.step, r.final))


def without_events(report: StepReport) -> StepReport:
    """The report as the store keeps it: its events go to the rank's deque."""
    return report.model_copy(update={"events": []}) if report.events else report


def events_after(
    held: Iterable[Event], reports: list[StepReport], keep: int
) -> list[Event] | None:
    """The rank's last `keep` events once `reports` are added (step order), or None when
    the batch brings no events."""
    carrying = [r for r in reports if r.events]
    if not carrying or keep == 0:
        return None
    new = [e for r in sorted(carrying, key=lambda r: r.step) for e in r.events]
    return [*held, *new][-keep:]
