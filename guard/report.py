"""The per-step report (wire format, docs/wire.md) built from the guard's host-side state."""

from __future__ import annotations

import math
import time
from typing import Any

from guard.decide import Violation

__all__ = ["build_report", "empty_stats"]

# The server accepts at most this many events per report (docs/wire.md).
MAX_EVENTS = 32
MAX_MESSAGE = 4096


def empty_stats() -> dict[str, Any]:
    """`g.stats` before the first read (DESIGN.md, Public API)."""
    return {
        "step": 0,
        "loss": None,
        "padding_mass": None,
        "padding_mass_max": None,
        "nonfinite": {"logits": 0, "hidden": 0, "loss": 0},
        "out_of_range": {"input": 0, "label": 0},
        "violations": {},
        "skipped_steps": 0,
    }


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _ratio(x: float | None) -> float | None:
    x = _finite(x)
    return None if x is None else min(max(x, 0.0), 1.0)


def build_report(
    stats: dict[str, Any],
    *,
    events: list[Violation],
    halted: str | None,
    vocab: dict[str, int],
    dropped_reports: int = 0,
    final: bool = False,
    zeros: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One step report; floats are finite or null (non-finite values are counted instead).

    `zeros` (check -> action) adds a 0 count for each enabled check that has not fired yet.
    """
    violations = {c: {a: 0} for c, a in (zeros or {}).items()}
    for check, actions in stats["violations"].items():
        violations.setdefault(check, {}).update(actions)
    return {
        "step": stats["step"],
        "timestamp": time.time(),
        "loss": _finite(stats["loss"]),
        "padding_mass": _ratio(stats["padding_mass"]),
        "padding_mass_max": _ratio(stats["padding_mass_max"]),
        "nonfinite": dict(stats["nonfinite"]),
        "out_of_range": dict(stats["out_of_range"]),
        "violations": violations,
        "skipped_steps": stats["skipped_steps"],
        "halted": halted,
        "vocab": dict(vocab),
        "dropped_reports": dropped_reports,
        "final": final,
        "events": [
            {
                "check": v.check,
                "action": v.action,
                "step": v.step,
                "message": v.message[:MAX_MESSAGE],
                "module": v.module,
            }
            for v in events[-MAX_EVENTS:]
        ],
    }
