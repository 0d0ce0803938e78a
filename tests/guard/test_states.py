"""guard/stateful/states.py: the one owner of the stateful checks' lifecycle keeps them in the
table's order (the order of their collectives on every rank), whatever order they come in."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from guard.checks import CHECKS, coverage, nonfinite, padding_rows, untrained_rows, vocab
from guard.checks.spec import Spec
from guard.policy import Policy
from guard.stateful import CheckState, States
from guard_server.wire import IdKind

TABLE = [s.check for s in CHECKS]


def state_of(spec: Spec[Any], calls: list[str], kinds: tuple[IdKind, ...] = ()) -> CheckState:
    """A real CheckState of `spec`'s check that writes down which verb ran on it."""

    class Logged(CheckState):
        at_detach: ClassVar[bool] = spec.check != "untrained_rows"

        def watches(self, kind: IdKind) -> bool:
            return kind in kinds

        def count(self, kind: IdKind, ids: torch.Tensor) -> None:
            calls.append(f"count {kind} {self.check_name}")

        def check(self) -> None:
            calls.append(f"check {self.check_name}")

        def repair(self) -> None:
            calls.append(f"repair {self.check_name}")

    Logged.spec = spec
    return Logged()


def test_the_states_run_in_the_tables_order_whatever_order_they_come_in() -> None:
    calls: list[str] = []
    specs = [coverage.SPEC, padding_rows.SPEC, vocab.SPEC, untrained_rows.SPEC, nonfinite.SPEC]
    states = States(state_of(s, calls) for s in specs)
    names = [s.check_name for s in states]
    assert names == sorted(names, key=TABLE.index) != [s.check for s in specs]
    # A set of names (whose order str hashing decides) repairs in the table's order too.
    states.repair({"coverage", "vocab", "padding_rows"})
    assert calls == ["repair vocab", "repair padding_rows", "repair coverage"]


def test_the_read_of_detach_checks_only_the_states_that_run_there() -> None:
    calls: list[str] = []
    states = States([state_of(untrained_rows.SPEC, calls), state_of(padding_rows.SPEC, calls)])
    states.check(weights=False)
    assert calls == ["check padding_rows"]
    states.check()
    assert calls[1:] == ["check untrained_rows", "check padding_rows"]


def test_ids_go_to_the_states_that_count_their_kind() -> None:
    calls: list[str] = []
    states = States([state_of(padding_rows.SPEC, calls, ("input",)),
                     state_of(untrained_rows.SPEC, calls, ("input", "label"))])
    assert states.watches("label") and not States().watches("input")
    states.count("label", torch.tensor([1]))
    states.count("input", torch.tensor([1]))
    assert calls == ["count label untrained_rows", "count input untrained_rows",
                     "count input padding_rows"]


def test_repair_under_the_policy_repairs_only_the_checks_under_repair() -> None:
    calls: list[str] = []
    states = States([state_of(padding_rows.SPEC, calls), state_of(untrained_rows.SPEC, calls)])
    policy = Policy.model_validate({"checks": {"padding_rows": {"action": "repair"},
                                               "untrained_rows": {"action": "warn"}}})
    states.repair_under(policy)
    assert calls == ["repair padding_rows"]


def test_one_state_per_check() -> None:
    with pytest.raises(ValueError, match="one state per check"):
        States([state_of(vocab.SPEC, []), state_of(vocab.SPEC, [])])
