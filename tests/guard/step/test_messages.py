"""The guard's log never goes quiet unannounced: the notice when it starts thinning out, the
violations that always break through, the summary at detach."""

from __future__ import annotations

import logging

import pytest

from guard.policy import Action
from guard.step.messages import Messages
from guard.step.verdict import Violation


def violation(step: int, value: float = 0.5, *, check: str = "padding_mass", kind: str = "",
              action: Action = Action.WARN, once: str | None = None) -> Violation:
    return Violation(check, action, step, f"{check} at step {step}: {value}", rank=0,
                     value=value, threshold=0.1, kind=kind, once=once)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def run(messages: Messages, violations: list[Violation]) -> None:
    counts: dict[str, int] = {}
    for v in violations:
        counts[v.check] = counts.get(v.check, 0) + 1
        messages.violation(v, counts[v.check])


def test_the_last_full_message_says_that_the_log_thins_out_and_where_the_counts_are(
        caplog: pytest.LogCaptureFixture) -> None:
    m = Messages()
    with caplog.at_level(logging.WARNING, logger="guard"):
        run(m, [violation(i) for i in range(1, 22)])  # 21 violations: 5 logged, 16 not
        m.summary()
    logged = lines(caplog)
    assert len(logged) == 6
    assert logged[4] == ("padding_mass at step 5: 0.5 (occurrence 5; from here on 1 in 100 is "
                         "logged, and any that is worse; every one is counted in "
                         "g.stats['violations'] and guard_violations_total)")
    assert logged[5] == ("padding_mass at detach: 21 violation step(s) (warn), the worst "
                         "0.5 at step 21, the last at step 21; 16 not logged one by one")


def test_a_change_of_severity_always_breaks_through(caplog: pytest.LogCaptureFixture) -> None:
    m = Messages()
    with caplog.at_level(logging.WARNING, logger="guard"):
        run(m, [violation(i, 0.03) for i in range(1, 11)]
            + [violation(11, 0.05)]  # worse, but not by an order of magnitude: thinned out
            + [violation(12, 1.0)]  # 33x the largest logged: through
            + [violation(13, 0.5, kind="a fused head")])  # a new kind: through
    logged = lines(caplog)
    assert len(logged) == 7
    assert logged[5] == ("padding_mass at step 12: 1.0 (occurrence 12; 33.3x the largest value "
                         "logged before)")
    assert logged[6] == "padding_mass at step 13: 0.5 (occurrence 13; a new kind: a fused head)"


def test_fail_is_left_to_its_error_and_a_once_key_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    m = Messages()
    with caplog.at_level(logging.WARNING, logger="guard"):
        run(m, [violation(1, action=Action.FAIL, check="nonfinite")])
        run(m, [violation(i, check="coverage", once="coverage:labels") for i in range(1, 4)])
        m.summary()
    assert lines(caplog) == [
        "coverage at step 1: 0.5",
        "nonfinite at detach: 1 violation step(s) (fail), the worst 0.5 at step 1, the "
        "last at step 1",
        "coverage at detach: 3 violation step(s) (warn), the worst 0.5 at step 3, the last "
        "at step 3; 2 not logged one by one",
    ]
