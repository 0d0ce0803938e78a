"""The record: from readings and verdicts to g.stats and to reports the server accepts."""

from __future__ import annotations

import logging
import math

import pytest

from guard.checks import Slot, loss, nonfinite, padding_mass, token_range, untrained_rows
from guard.policy import Action
from guard.policy_file import load_policy
from guard.sinks import MemorySink
from guard.step.record import Record, empty_stats
from guard.step.verdict import Note, Verdict, Violation
from guard.vocab.sizes import audit_sizes
from guard_server.wire import MAX_COUNT, MAX_EVENTS, MAX_MESSAGE, MAX_MODULE, ReportBatch
from tests.conftest import no_host_reads, policy
from tests.guard.readings import values

VOCAB = {"real": 100, "rows": 128, "aligned": 128}


def mass(mean: float, top: float) -> dict[Slot, float]:
    """The padding-mass slots of one sampled position."""
    return {padding_mass.SUM: mean, padding_mass.COUNT: 1, padding_mass.MAX: top}


def loss_of(x: float) -> dict[Slot, float]:
    return {loss.VALUE: x, loss.SEEN: 1}


def record(**enabled: Action) -> Record:
    r = Record("run-1", 3, VOCAB, dict(enabled))
    r.sinks.append(MemorySink())
    return r


def sent(r: Record) -> MemorySink:
    sink = r.sinks[0]
    assert isinstance(sink, MemorySink)
    return sink


def violation(check: str = "padding_mass", action: Action = Action.WARN, step: int = 1,
              message: str = "m", module: str | None = None) -> Violation:
    return Violation(check, action, step, message, module, rank=0, value=0.5, threshold=1e-6)


def test_from_the_policy_every_enabled_check_is_a_zero_count() -> None:
    pol = load_policy({**policy(), "run_id": "r7"})
    r = Record.from_policy(pol, audit_sizes(real=100, rows=128, embedding_rows=128,
                                            tied=True), rank=1)
    r.sinks.append(MemorySink())
    r.emit()
    (report,) = sent(r).reports
    assert (r.run_id, r.rank) == ("r7", 1)
    assert report.violations == {"alignment": {"fail": 0}, "vocab": {"fail": 0},
                                 "padding_mass": {"mask": 0}, "nonfinite": {"fail": 0},
                                 "token_range": {"fail": 0},
                                 "coverage": {"warn": 0},
                                 "untrained_rows": {"repair": 0}}  # loss_spike is off


def test_values_add_up_in_stats_and_gauges_keep_their_last_value() -> None:
    r = record()
    r.update(values({**mass(0.2, 0.3), **loss_of(2.0), nonfinite.LOGITS: 1}), step=1)
    r.update(values({token_range.INPUT: 2}), step=2)  # no position, no loss
    s = r.stats
    assert s == {**empty_stats(), "step": 2, "loss": 2.0, "padding_mass": 0.2,
                 "padding_mass_max": 0.3, "nonfinite": {"logits": 1, "hidden": 0, "loss": 0},
                 "out_of_range": {"input": 2, "label": 0}}
    s["nonfinite"]["logits"] = 99  # a copy
    assert r.stats["nonfinite"]["logits"] == 1


def test_untrained_rows_left_are_a_state_and_the_tokens_on_them_a_count() -> None:
    r = record(untrained_rows=Action.REPAIR)
    assert r.stats["untrained_rows"] is None  # not read yet
    left = {untrained_rows.READ: 1, untrained_rows.LEFT["embedding"]: 4,
            untrained_rows.LEFT["lm_head"]: 3}
    r.update(values(left), step=0)  # attach: what was found
    r.update(values({untrained_rows.INPUT: 5, untrained_rows.LABEL: 2}), step=1)
    assert r.stats["untrained_rows"] == {"embedding": 4, "lm_head": 3}  # kept, not added
    r.update(values({**left, untrained_rows.LEFT["embedding"]: 1, untrained_rows.INPUT: 1}),
             step=2)  # after a repair
    s = r.stats
    assert s["untrained_rows"] == {"embedding": 1, "lm_head": 3}
    assert s["untrained_tokens"] == {"input": 6, "label": 2}
    r.emit()
    report = sent(r).reports[-1]
    assert report.untrained_rows is not None and report.untrained_rows.embedding == 1
    assert report.untrained_tokens.input == 6
    assert r.scalars()["guard/untrained_rows/lm_head"] == 3.0


def test_scalars_flatten_the_last_read_for_a_trainers_loggers() -> None:
    r = record(padding_mass=Action.WARN, coverage=Action.WARN)
    r.add(Verdict((violation("alignment", Action.WARN, 0),)))  # at attach: before any step
    r.update(values(), step=0)  # attach's read of the weights is no step's figures
    assert r.scalars() == {}
    r.update(values({**mass(0.2, 0.3), token_range.LABEL: 3}), step=1)
    r.update(values({token_range.INPUT: 1, token_range.LABEL: 2}), step=2)  # nothing sampled
    r.add(Verdict((violation(step=2),)))
    r.skipped()
    with no_host_reads():
        got = r.scalars()
    assert got == {
        "guard/step": 2.0, "guard/padding_mass": 0.2, "guard/padding_mass_max": 0.3,
        "guard/nonfinite/logits": 0.0, "guard/nonfinite/hidden": 0.0,
        "guard/nonfinite/loss": 0.0, "guard/out_of_range/input": 1.0,
        "guard/out_of_range/label": 5.0, "guard/untrained_tokens/input": 0.0,
        "guard/untrained_tokens/label": 0.0, "guard/violations/padding_mass/warn": 1.0,
        "guard/violations/coverage/warn": 0.0, "guard/violations/alignment/warn": 1.0,
        "guard/skipped_steps": 1.0}
    assert all(type(v) is float for v in got.values())


def test_a_report_is_one_batch_of_the_wire_with_run_and_rank() -> None:
    r = record(padding_mass=Action.WARN)
    r.update(values(mass(0.2, 0.3)), step=4)
    r.add(Verdict((violation(step=4),)))
    r.emit(final=True)
    (batch,) = sent(r).batches
    assert isinstance(batch, ReportBatch) and (batch.run_id, batch.rank) == ("run-1", 3)
    (rep,) = batch.reports
    assert rep.step == 4 and rep.final and rep.violations == {"padding_mass": {"warn": 1}}
    assert [(e.check, e.action, e.step) for e in rep.events] == [("padding_mass", "warn", 4)]
    r.emit()
    assert sent(r).reports[-1].events == []  # events go out once


def test_values_past_the_wire_limits_are_clipped_not_rejected() -> None:
    r = record()
    r.update(values({**mass(math.nan, 1.5), **loss_of(math.inf), token_range.INPUT: 2**60}),
             step=1)
    r.add(Verdict(tuple(violation(message="x" * 5000, module="m." * 200) for _ in range(40))))
    r.emit()
    (rep,) = sent(r).reports
    assert (rep.padding_mass, rep.padding_mass_max, rep.loss) == (None, 1.0, None)
    assert rep.out_of_range.input == MAX_COUNT
    assert len(rep.events) == MAX_EVENTS
    assert len(rep.events[0].message) == MAX_MESSAGE
    assert rep.events[0].module is not None and len(rep.events[0].module) == MAX_MODULE


def test_fail_halts_and_a_note_is_an_event_but_no_count(
        caplog: pytest.LogCaptureFixture) -> None:
    r = record()
    r.note(Note("nonfinite", Action.WARN, 2, "localised: blocks.1", "blocks.1"))
    r.add(Verdict((violation("nonfinite", Action.FAIL, 2),)))
    r.emit()
    (rep,) = sent(r).reports
    assert r.halted == "nonfinite" and rep.halted == "nonfinite"
    assert r.stats["violations"] == {"nonfinite": {"fail": 1}}
    assert [e.module for e in rep.events] == ["blocks.1", None]
    assert "localised: blocks.1" in caplog.text


def test_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    r = record()
    with caplog.at_level(logging.WARNING, logger="guard"):
        for i in range(200):
            r.add(Verdict((violation(step=i + 1),)))
    assert len(caplog.records) == 5 + 2  # the first five, then occurrences 100 and 200


def test_a_failing_sink_never_stops_training(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def emit(self, batch: ReportBatch) -> None:
            raise ConnectionError("down")

        def close(self, timeout: float = 5.0) -> None: ...

    r = record()
    r.sinks.insert(0, Broken())
    r.emit()
    assert len(sent_to_last(r).reports) == 1 and "sink" in caplog.text


def sent_to_last(r: Record) -> MemorySink:
    sink = r.sinks[-1]
    assert isinstance(sink, MemorySink)
    return sink


def test_a_report_that_cannot_be_built_never_stops_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A run_id the wire refuses (what a TORCHELASTIC_RUN_ID read from a file held before it was
    # stripped): no batch can be built. Logged once, counted, said again at detach.
    r = Record("job-7\n", 0, VOCAB, {})
    r.sinks.append(MemorySink())
    with caplog.at_level(logging.ERROR, logger="guard"):
        for step in (1, 2, 3):
            r.update(values(), step)
            r.emit()
        r.summarise()
    assert sent(r).reports == [] and r.unbuilt == 3
    first, summary = (rec.getMessage() for rec in caplog.records)
    assert "step 1 cannot be built" in first and "run_id" in first and "job-7" not in first
    assert "3 reports could not be built" in summary
