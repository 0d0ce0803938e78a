"""The stateful checks, one state each, made at attach; their collection (guard/stateful/
states.py) puts them in the verdict's order."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from guard.stateful.coverage import CoverageState
from guard.stateful.nonfinite import GradState
from guard.stateful.padding_rows import PaddingRowsState
from guard.stateful.state import Attaching, CheckState
from guard.stateful.states import States
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


def attach_states(at: Attaching) -> States:
    """The states of the enabled stateful checks that have something to watch here."""
    return States.make(STATEFUL, at)
