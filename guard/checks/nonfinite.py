"""nonfinite: NaN / Inf in the lm_head input, the real-vocab logits and the loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from guard.checks import coverage, token_range
from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, Stats, listed
from guard.policy import Policy

__all__ = ["HIDDEN", "LOGITS", "LOSS", "SLOTS", "SPEC", "Nonfinite", "Tensor"]

Tensor = Literal["hidden", "logits", "loss"]

HIDDEN = Slot("nonfinite.hidden")  # non-finite values in the lm_head input
LOGITS = Slot("nonfinite.logits")  # positions whose real-vocab logits hold a NaN or +Inf
LOSS = Slot("nonfinite.loss")  # non-finite losses
# In the order of the message: cause first.
SLOTS: Mapping[Tensor, Slot] = {"hidden": HIDDEN, "logits": LOGITS, "loss": LOSS}
_NAMES = {"hidden": "lm_head input", "logits": "real-vocab logits", "loss": "loss"}


@dataclass(frozen=True)
class Nonfinite:
    counts: Mapping[str, int]  # per tensor (hidden, logits, loss), as on the wire


def _figures(raw: Raw) -> Nonfinite:
    return Nonfinite({k: int(raw[slot]) for k, slot in SLOTS.items()})


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return dict.fromkeys(SLOTS.values(), 0.0)


def _stats(f: Nonfinite) -> Stats:
    # The wire's order (logits, hidden, loss), as g.stats has always shown it.
    return {"nonfinite": {k: f.counts[k] for k in ("logits", "hidden", "loss")}}


def _why(f: Nonfinite, c: Context) -> str:
    """The likely cause. Under the mask a label in [real, rows) has a -inf logit, so its
    cross-entropy is +inf: ghost labels are named as the cause of a non-finite loss whatever
    else the step saw, and labels the guard did not see are named as a suspect before the
    weights are blamed."""
    weights = (f"check the learning rate, the loss scale and the padding rows [{c.real}, "
               f"{c.rows}) of the embedding / lm_head")
    if not (f.counts["loss"] > 0 and c.policy.masks):
        return weights
    ids = c.glob[token_range.SPEC]
    if ids.counts["label"] > 0 and c.real <= ids.max_id < c.rows:
        rest = [_NAMES[k] for k in ("hidden", "logits") if f.counts[k] > 0]
        return (f"the loss is +inf because {ids.counts['label']} labels are ghost ids in "
                f"[{c.real}, {c.rows}) (highest {ids.max_id}), whose logits the mask sets to "
                "-inf (see token_range): fix the labels, or give the real vocab that has these "
                "ids" + (f"; for the {' and the '.join(rest)}, {weights}" if rest else ""))
    if c.glob[coverage.SPEC].blind["labels"] > 0:
        return (f"this step's labels were not checked (token_range is off, or they did not "
                f"reach the guarded forward: see coverage), and a label in [{c.real}, "
                f"{c.rows}) makes the loss +inf under the mask: look at the labels first; "
                f"then {weights}")
    return weights


def _describe(f: Nonfinite, c: Context) -> Found:
    seen, total = listed({_NAMES[k]: n for k, n in f.counts.items()}, "{n} in the {k}", ", ")
    kind = "+".join(k for k, n in f.counts.items() if n > 0)
    why = _why(f, c)
    return Found(total, 0.0, kind=kind, text=(
        f"NaN/Inf values: {seen}; expected none; {c.next}. {why[0].upper()}{why[1:]}."))


SPEC = Spec("nonfinite", tuple(SLOTS.values()), _figures, _thresholds, ("logits", "loss"),
            _stats, _describe)
