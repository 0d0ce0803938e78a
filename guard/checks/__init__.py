"""The per-step checks' specs, one module each: what it measures on the device (its slots), when
it fires (its thresholds), what it needs to see, its figures and its message. Pure Python; a
check that keeps state from attach on has its state in guard/stateful/."""

from guard.checks.spec import Context, Found, Slot, Spec
from guard.checks.table import CHECKS, SPECS, watching

__all__ = ["CHECKS", "SPECS", "Context", "Found", "Slot", "Spec", "watching"]
