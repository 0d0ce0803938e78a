"""padding_mass: the softmax probability on the padding columns [real, rows) of the logits,
before any mask, over a sample of positions (all of them with `exact`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks.spec import Context, Found, Raw, Slot, Spec, Stats, Watching, fmt
from guard.policy import Policy

__all__ = ["COUNT", "FUSED", "MAX", "SPEC", "SUM", "PaddingMass"]

SUM = Slot("padding_mass.sum")  # the masses of the sampled positions, summed
COUNT = Slot("padding_mass.count")  # positions sampled
MAX = Slot("padding_mass.max", "max")  # the largest position's mass: what fires the check
FUSED = Slot("padding_mass.fused")  # forwards measured from the final hidden states (no head)


@dataclass(frozen=True)
class PaddingMass:
    mean: float | None  # over the sampled positions; None: none sampled
    max: float | None
    fused: int  # forwards whose head was not called (a fused loss kernel read its weight)


def _figures(raw: Raw) -> PaddingMass:
    count = raw[COUNT]
    return PaddingMass(raw[SUM] / count if count else None, raw[MAX] if count else None,
                       int(raw[FUSED]))


def _thresholds(policy: Policy, watching: Watching) -> Mapping[Slot, float]:
    return {MAX: policy.checks.padding_mass.threshold}


def _stats(f: PaddingMass) -> Stats:
    return {"padding_mass": f.mean, "padding_mass_max": f.max}


def _describe(f: PaddingMass, c: Context) -> Found:
    top, mean = f.max or 0.0, f.mean or 0.0
    threshold = c.policy.checks.padding_mass.threshold
    fix = ("The mask removes it from softmax and gradient." if c.policy.masks
           else "Set checks.padding_mass.action: mask to mask them instead.")
    if f.fused and c.policy.masks:
        fix = (f"But {c.head} was not called: a fused kernel computed the loss from its weight "
               "(measured here from the final hidden states) and the guard cannot mask a "
               f"kernel's logits. Pass it the real rows {c.head}.weight[:{c.real}] "
               "(docs/integrations.md, fused heads): then the padding takes no part in the loss.")
    # Over ranks each slot is the largest rank's: with the same sample size on every rank (the
    # usual case) the mean is the highest rank's mean, not the mean over ranks.
    return Found(top, threshold, (
        f"{fmt(top)} of the probability (mean {fmt(mean)}) is on the {c.rows - c.real} "
        f"padding columns [{c.real}, {c.rows}), expected <= {threshold:g}; {c.next}. {fix}"))


SPEC = Spec("padding_mass", (SUM, COUNT, MAX, FUSED), _figures, _thresholds, ("logits",),
            _stats, _describe)
