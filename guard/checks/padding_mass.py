"""padding_mass: the softmax probability on the padding columns [real, rows) of the logits,
over a sample of positions (all of them with `exact`).

Two levels. The figure is the mass before any mask, always measured and exported. A violation
is mass the loss trains on beyond what healthy padding rows take: a padding row like a real
token's (a normal init, HF's mean resize, a trained model's rows) gives its column about an
average real id's probability, so P padding columns of N + P take about P / (N + P) of it, or
much less once the real rows are trained; the seed's garbage rows take nearly all of it. Under
`mask` the loss sees no padding column at all, so the mask doing its job is no violation; a
loss computed where the mask cannot reach (a fused kernel that reads the head's weight) is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, Stats, fmt
from guard.policy import Policy

__all__ = ["COUNT", "FUSED", "LOSS_MAX", "LSE_MAX", "LSE_SHIFT", "LSE_SUM", "MAX", "SPEC", "SUM",
           "PaddingMass", "bound", "mask_note", "reported_bound"]

SUM = Slot("padding_mass.sum")  # the masses of the sampled positions, summed
COUNT = Slot("padding_mass.count")  # positions sampled
MAX = Slot("padding_mass.max", "max")  # the largest position's mass, before any mask
# The largest position's mass in the logits the loss used: the same as MAX where nothing masks
# them, none where the mask did (written by guard/device/logits.py). What fires the check.
LOSS_MAX = Slot("padding_mass.loss_max", "max")
FUSED = Slot("padding_mass.fused")  # forwards measured from the final hidden states (no head)
# log Z of the real columns at the sampled positions (the padding mass's own logsumexp): a
# figure, what PaLM's and OLMo's z-loss keeps near 0; logits that grow before they diverge.
# Over the COUNT positions, so a non-finite one (the nonfinite check's) makes it no figure.
LSE_SUM = Slot("padding_mass.lse_sum")
# Their largest, plus LSE_SHIFT: a slot's max starts from 0 at each window, and a log Z may be
# negative (logits pushed down by a z-loss); no finite float32 logits give one under -1e6.
LSE_MAX = Slot("padding_mass.lse_max", "max")
LSE_SHIFT = 1e6


@dataclass(frozen=True)
class PaddingMass:
    mean: float | None  # over the sampled positions, before any mask; None: none sampled
    max: float | None
    loss_max: float  # the largest mass the loss trained on
    fused: int  # forwards whose head was not called (a fused loss kernel read its weight)
    logsumexp: float | None = None  # log Z, mean over the sampled positions; None: none
    logsumexp_max: float | None = None


def bound(policy: Policy, real: int, columns: int) -> float:
    """The largest mass per position that is no violation, for `real` real columns of
    `columns`: the policy's absolute `threshold` where one is set, else the mass at which each
    padding column takes `excess` times an average real id's probability."""
    c = policy.checks.padding_mass
    if c.threshold is not None:
        return c.threshold
    padding = columns - real
    if padding <= 0:
        return float("inf")
    # m / P per padding column = excess * (1 - m) / N per real id  <=>  m = eP / (N + eP)
    return c.excess * padding / (real + c.excess * padding)


def reported_bound(policy: Policy, real: int, columns: int) -> float | None:
    """The bound as the reports carry it (padding_mass_bound, beside the mass): None when the
    check is off or there is no padding column (no bound)."""
    if not policy.enabled("padding_mass"):
        return None
    limit = bound(policy, real, columns)
    return limit if math.isfinite(limit) else None


def _figures(raw: Raw) -> PaddingMass:
    count = raw[COUNT]
    measured = count and raw[LSE_MAX] != 0  # log Z is only where the mass was measured
    return PaddingMass(raw[SUM] / count if count else None, raw[MAX] if count else None,
                       raw[LOSS_MAX], int(raw[FUSED]), raw[LSE_SUM] / count if measured else None,
                       raw[LSE_MAX] - LSE_SHIFT if measured else None)


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return {LOSS_MAX: bound(policy, setup.real, setup.columns)}


def _stats(f: PaddingMass) -> Stats:
    return {"padding_mass": f.mean, "padding_mass_max": f.max, "logsumexp": f.logsumexp,
            "logsumexp_max": f.logsumexp_max}


def _describe(f: PaddingMass, c: Context) -> Found:
    top, mean = f.loss_max, f.mean or 0.0
    # Over the whole vocab, or the columns of a shard alone in its process: the threshold's.
    real, columns = c.mass or (c.real, c.rows)
    padding, limit = columns - real, bound(c.policy, real, columns)
    of = "" if c.mass is None else f" (over this shard's {columns} columns, the others' absent)"
    healthy = padding / columns  # each padding column at an average real id's probability
    times = top * real / (padding * (1.0 - top)) if top < 1.0 else float("inf")
    share = f"{fmt(times)}x" if times < 1e6 else "over 1e6x"
    expected = (f"expected <= {limit:g} (checks.padding_mass.threshold)"
                if c.policy.checks.padding_mass.threshold is not None else
                f"{share} an average real id's share per padding column (healthy rows "
                f"take about 1x, {fmt(healthy)} in all, or less once trained), expected <= "
                f"{c.policy.checks.padding_mass.excess:g}x")
    fix = ("Set checks.padding_mass.action: mask to take them out of softmax and gradient, and "
           "look at the padding rows of the head (checks.padding_rows).")
    if f.fused and c.policy.masks:
        fix = (f"{c.head} was not called: a fused kernel computed the loss from its weight "
               "(measured here from the final hidden states) and the guard cannot mask a "
               f"kernel's logits. Pass it the real rows {c.head}.weight[:{c.real}] "
               "(docs/integrations.md, fused heads): then the padding takes no part in the loss.")
    return Found(top, limit, kind="a fused head" if f.fused else "", text=(
        f"the loss trained on {fmt(top)} of the probability (mean {fmt(mean)}) on the "
        f"{c.rows - c.real} padding columns [{c.real}, {c.rows}){of}: {expected}; {c.next}. "
        f"{fix}"))


def mask_note(policy: Policy, real: int, rows: int) -> str:
    """What attach says under the mask of a loss over every column (a loop of one's own)."""
    if not policy.masks or real >= rows:
        return ""
    return (f"; padding_mass: mask sets the padding columns [{real}, {rows}) to -inf, so a loss "
            f"over every column (label smoothing) is inf: compute it over logits[..., :{real}]")


SPEC = Spec("padding_mass", (SUM, COUNT, MAX, LOSS_MAX, FUSED, LSE_SUM, LSE_MAX),
            _figures, _thresholds,
            ("logits",), _stats, _describe)
