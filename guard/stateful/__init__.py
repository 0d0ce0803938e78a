"""The checks that keep state from attach on, one object each (guard/stateful/state.py): what
it found at attach, the device state its hooks write, its reads before each flags read, its
repair, what it adds to its message and says at attach; their collection (states.py) owns
their lifecycle. Runs at attach, in the hooks and at each read."""

from guard.stateful.state import Attaching, CheckState, Finding
from guard.stateful.states import States
from guard.stateful.table import STATEFUL, attach_states

__all__ = ["STATEFUL", "Attaching", "CheckState", "Finding", "States", "attach_states"]
