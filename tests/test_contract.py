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


def test_a_healthy_rank_under_the_default_policy_has_the_typical_series() -> None:
    # The figure the server's series cap is sized by (guard_server/settings.py).
    from guard_server.families import TYPICAL_SERIES_PER_RANK, series_of

    m = tiny_gpt()
    sink = MemorySink()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with guard.attach(m, vocab_size=100, policy={"export": {"serve": None}}, optimizer=opt) as g:
        g.add_sink(sink)
        _, loss = m(*batch())
        loss.backward()
        opt.step()
    (report,) = sink.batch().reports[:1]
    assert series_of(report) == TYPICAL_SERIES_PER_RANK
    # Every enabled check (all, by default) is on the first report at 0: its violations series
    # is there from the start (docs/metrics.md, held in tests/test_doc_figures.py).
    from guard_server.wire import CHECKS

    assert set(report.violations) == set(CHECKS)
    assert all(n == 0 for by_action in report.violations.values() for n in by_action.values())
    # The bound the padding mass is judged against travels with it (the page shows both).
    from guard.checks.padding_mass import bound
    from guard.policy import Policy

    assert report.padding_mass_bound == bound(Policy(), 100, 128)


def test_the_label_values_are_declared_once_on_the_wire() -> None:
    # Each per-kind label's values are a Literal of the wire, the fields of its report model in
    # that order, the keys of the specs' slots and what the metric families emit.
    from guard.checks import nonfinite, token_range, untrained_rows
    from guard_server.wire import (
        ID_KINDS,
        TENSORS,
        WEIGHTS,
        NonFinite,
        OutOfRange,
        UntrainedRows,
        UntrainedTokens,
    )

    assert tuple(NonFinite.model_fields) == TENSORS
    assert tuple(OutOfRange.model_fields) == tuple(UntrainedTokens.model_fields) == ID_KINDS
    assert tuple(UntrainedRows.model_fields) == WEIGHTS
    assert set(nonfinite.SLOTS) == set(TENSORS)
    assert set(token_range.SLOTS) == set(untrained_rows.SLOTS) == set(ID_KINDS)
    assert tuple(untrained_rows.LEFT) == WEIGHTS
    report = guarded_run_reports().reports[-1]
    from guard_server.families import PER_RANK

    report = report.model_copy(update={"nonfinite": report.nonfinite.model_copy(
        update={"grad": 0})})  # as a rank whose gradients are checked reports it
    emitted = {f.name: {extra for extra, _ in f.samples(report, 0.0)} for f in PER_RANK}
    assert emitted["guard_nonfinite_values_total"] == {(t,) for t in TENSORS}
    assert emitted["guard_out_of_range_tokens_total"] == {(k,) for k in ID_KINDS}
    assert emitted["guard_untrained_tokens_total"] == {(k,) for k in ID_KINDS}
