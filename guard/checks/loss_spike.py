"""loss_spike: the loss far above the median of its recent history (the rule and its defaults:
guard/device/loss.py, docs/loss_spike.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks import loss
from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, fmt
from guard.policy import Policy

__all__ = ["RATIO", "SPEC", "SPIKE", "LossSpike"]

SPIKE = Slot("loss_spike.spike", "max")  # 1 when a loss crossed the spike rule
RATIO = Slot("loss_spike.ratio", "max")  # loss / median of the history at the worst step


@dataclass(frozen=True)
class LossSpike:
    ratio: float  # at the worst spike, else 0


def _figures(raw: Raw) -> LossSpike:
    return LossSpike(raw[RATIO])


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    # The rule itself runs on the device and writes 1 to SPIKE when it holds.
    return {SPIKE: 0.0}


def _describe(f: LossSpike, c: Context) -> Found:
    ls = c.policy.checks.loss_spike
    value = c.glob[loss.SPEC].value
    shown = fmt(value if value is not None else float("nan"))
    return Found(f.ratio, ls.factor, (
        f"loss {shown} is {fmt(f.ratio)}x the median of its last {ls.window} losses, "
        f"expected <= {ls.factor:g}x (or a rise <= {ls.min_delta:g}); {c.next}. Look for "
        "unmasked padding columns, a bad batch or a too high learning rate."))


SPEC = Spec("loss_spike", (SPIKE, RATIO), _figures, _thresholds, ("loss",),
            describe=_describe)
