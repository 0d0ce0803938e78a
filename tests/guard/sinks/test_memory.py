"""The in-memory sink: what a guard sends, kept as the wire's models."""

from __future__ import annotations

from guard.sinks import MemorySink
from guard_server.wire import ReportBatch
from tests.guard.sinks.helpers import one_report


def test_keeps_every_batch_and_joins_them_into_one_request_body() -> None:
    sink = MemorySink()
    for step in (1, 2, 3):
        sink.emit(one_report(step, final=step == 3, run_id="r9", rank=4))
    sink.close()
    assert sink.closed and [r.step for r in sink.reports] == [1, 2, 3]
    body = sink.batch()
    assert (body.run_id, body.rank, len(body.reports)) == ("r9", 4, 3)
    assert ReportBatch.model_validate_json(body.model_dump_json()) == body  # as the server
