"""The one test that links the library and the server: what the guard emits, the server takes."""

from __future__ import annotations

import torch

import guard
from guard.sinks import MemorySink
from guard_server.wire import ReportBatch, StepReport
from tests.conftest import batch, policy, tiny_gpt


def guarded_run_reports() -> ReportBatch:
    """Reports of a short run that hits every per-step check and an attach-time warning."""
    m = tiny_gpt(rows=100, garbage=None)  # unaligned: alignment warns at attach
    pol = policy(alignment={"action": "warn"}, padding_mass={"action": "warn"},
                 nonfinite={"action": "warn"}, token_range={"action": "warn"})
    sink = MemorySink()
    with torch.no_grad():  # garbage padding rows: the unmasked loss trains on ghost classes
        m.lm_head.weight[90:] = torch.randn(10, m.lm_head.weight.shape[1]) * 5.0
    with guard.attach(m, policy=pol, vocab_size=90) as g:
        g.add_sink(sink)
        x, y = batch(real=90)
        for i in range(4):
            if i == 2:
                y = y.clone()
                y[0, 0] = 95  # a ghost label
            _, loss = m(x, y)
            g.step(torch.tensor(float("nan")) if i == 3 else loss)
    return sink.batch()


def test_guard_reports_validate_against_the_server_schema() -> None:
    body = guarded_run_reports().model_dump_json()
    parsed = ReportBatch.model_validate_json(body)  # as the server parses a push
    assert [r.step for r in parsed.reports] == [1, 2, 3, 4, 4]
    last = parsed.reports[-1]
    assert last.final and last.out_of_range.label == 2 and last.nonfinite.loss == 1
    assert last.loss is None  # non-finite losses are counted, never sent as a value
    assert last.vocab.real == 90 and last.vocab.rows == 100 and last.vocab.aligned == 128
    checks = {e.check for r in parsed.reports for e in r.events}
    assert checks == {"alignment", "padding_mass", "token_range", "nonfinite"}
    assert parsed.reports[0].violations["alignment"]["warn"] == 1


def test_report_keys_are_exactly_the_wire_fields() -> None:
    report = guarded_run_reports().reports[0].model_dump(mode="json")
    assert set(report) == set(StepReport.model_fields)


def test_the_policy_checks_and_actions_are_the_wires() -> None:
    from guard.policy import CHECKS, Action, Checks
    from guard_server.wire import ACTIONS
    from guard_server.wire import CHECKS as WIRE_CHECKS

    assert CHECKS == WIRE_CHECKS == tuple(Checks.model_fields)
    assert set(ACTIONS) == {a.value for a in Action} - {"off"}  # off never reaches the wire
