"""The stateful checks, one state each, made at attach in the verdict's order (guard/checks/
table.py): the order in which every rank checks, details and repairs them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from guard.checks import CHECKS
from guard.stateful.coverage import CoverageState
from guard.stateful.nonfinite import GradState
from guard.stateful.padding_rows import PaddingRowsState
from guard.stateful.state import Attaching, CheckState
from guard.stateful.tie_across import tie_state
from guard.stateful.untrained_rows import UntrainedRowsState
from guard_server.wire import CheckName

__all__ = ["STATEFUL", "attach_states"]

# Per stateful check, what makes its state at attach (None: nothing to watch on this model).
STATEFUL: Mapping[CheckName, Callable[[Attaching], CheckState | None]] = {
    "vocab": tie_state,
    "untrained_rows": UntrainedRowsState.attach,
    "nonfinite": GradState.attach,
    "padding_rows": PaddingRowsState.attach,
    "coverage": CoverageState.attach,
}


def attach_states(at: Attaching) -> tuple[CheckState, ...]:
    """The states of the enabled stateful checks, in the table's order (never a mapping's or a
    set's: their collectives must run in one order on every rank)."""
    out = []
    for spec in CHECKS:
        make = STATEFUL.get(spec.check)
        if make is not None and at.policy.enabled(spec.check) and \
                (state := make(at)) is not None:
            out.append(state)
    return tuple(out)
