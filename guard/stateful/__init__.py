"""The checks that keep state from attach on, one object each (guard/stateful/state.py): what
it found at attach, the device state its hooks write, its reads before each flags read, its
repair, what it adds to its message and says at attach. Runs at attach, in the hooks and at
each read; the collectives among them in the table's order on every rank."""

from guard.stateful.state import Attaching, CheckState, Finding
from guard.stateful.table import STATEFUL, attach_states

__all__ = ["STATEFUL", "Attaching", "CheckState", "Finding", "attach_states"]
