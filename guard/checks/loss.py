"""The step's loss: a figure the checks share (nonfinite counts it, loss_spike compares it),
not a check of its own."""

from __future__ import annotations

from dataclasses import dataclass

from guard.checks.spec import Raw, Slot, Spec, Stats

__all__ = ["SEEN", "SPEC", "VALUE", "Loss"]

SEEN = Slot("loss.seen", "max")  # 1 when a loss was folded in this window
VALUE = Slot("loss.value", "last", written=SEEN)  # the last one folded


@dataclass(frozen=True)
class Loss:
    value: float | None  # None: no loss was seen in the window


def _figures(raw: Raw) -> Loss:
    return Loss(raw[VALUE] if raw[SEEN] else None)


def _stats(f: Loss) -> Stats:
    return {"loss": f.value}


SPEC = Spec("loss", (SEEN, VALUE), _figures, stats=_stats)
