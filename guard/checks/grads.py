"""The gradients' figures, a figure the checks share (not a check of its own): the total norm
of the gradients the optimizer applies and its largest parameter's share, measured before the
update by the nonfinite check's state (guard/stateful/nonfinite.py, in the same pass that counts
the non-finite ones), and the updates the training loop skipped (GradScaler)."""

from __future__ import annotations

from dataclasses import dataclass

from guard.checks.spec import Raw, Slot, Spec, Stats, Total

__all__ = ["NORM", "SEEN", "SKIPPED", "SPEC", "TOP", "TOP_SHARE", "WATCHED", "Grads"]

SEEN = Slot("grads.seen", "max")  # 1 when the window measured gradients
NORM = Slot("grads.norm", "last", written=SEEN)  # the last step's total norm
TOP = Slot("grads.top", "last", written=SEEN)  # its largest parameter, by index
TOP_SHARE = Slot("grads.top_share", "last", written=SEEN)  # of the squared norm
# Steps that ended without an optimizer step although their backward ran (GradScaler found an
# inf/NaN gradient and skipped the update; guard/step/clock.py tells them).
SKIPPED = Slot("grads.skipped")
WATCHED = Slot("grads.watched", "max")  # 1 when the guard watches for such steps


@dataclass(frozen=True)
class Grads:
    norm: float | None  # None: no gradient measured in the window (a figure, never a zero)
    top: int | None  # the index of the largest parameter's gradient, among those measured
    top_share: float | None
    skipped: int | None  # None: nothing watches for skipped updates


def _figures(raw: Raw) -> Grads:
    seen = bool(raw[SEEN])
    return Grads(raw[NORM] if seen else None, int(raw[TOP]) if seen else None,
                 raw[TOP_SHARE] if seen else None,
                 int(raw[SKIPPED]) if raw[WATCHED] else None)


def _stats(f: Grads) -> Stats:
    # The largest parameter's name comes from the state that knows the names: None here.
    return {"grad_norm": f.norm, "grad_norm_top": None, "grad_norm_top_share": f.top_share,
            "scaler_skipped_steps": None if f.skipped is None else Total(f.skipped)}


SPEC = Spec("grads", (SEEN, NORM, TOP, TOP_SHARE, SKIPPED, WATCHED), _figures, stats=_stats)
