"""From the values read at a step boundary to violations with their messages (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from guard.flags import Slot
from guard.policy import Policy
from guard.vocab import Audit

__all__ = ["Violation", "attach_violations", "evaluate", "thresholds"]

_NEXT = {
    "fail": "stopping (action: fail)",
    "skip": "skipping this optimizer step (action: skip)",
    "mask": "masking the padding columns to -inf (action: mask)",
    "warn": "continuing (action: warn)",
}


@dataclass(frozen=True)
class Violation:
    """One check over its threshold at one read; `rank` is the highest rank that saw it."""

    check: str
    action: str
    step: int
    rank: int
    value: float
    threshold: float
    message: str
    module: str | None = None


def thresholds(policy: Policy) -> list[float]:
    """Per flag slot, the value above which it is a violation (inf: not a check value)."""
    out = [math.inf] * len(Slot)
    out[Slot.PM_MAX] = policy.checks.padding_mass.threshold
    for slot in (Slot.NF_HIDDEN, Slot.NF_LOGITS, Slot.NF_LOSS, Slot.OOR_INPUT, Slot.OOR_LABEL):
        out[slot] = 0.0
    out[Slot.SPIKE] = 0.0
    return out


def _where(who: float, own_rank: int) -> tuple[int, str]:
    rank = int(who) - 1 if who > 0 else own_rank
    return rank, f"rank {rank}"


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x == x and abs(x) < 1e4 else f"{x:.4g}"


def evaluate(
    glob: list[float],
    who: list[float],
    *,
    step: int,
    rank: int,
    policy: Policy,
    real: int,
    rows: int,
) -> list[Violation]:
    """The violations of one read, using the all-rank values so every rank decides alike.

    Ordered cause first: ghost ids explain an infinite loss under the mask, not the reverse.
    """
    out: list[Violation] = []
    checks = policy.checks

    tr = checks.token_range
    if tr.action != "off":
        parts = [(name, glob[slot]) for name, slot in
                 (("input", Slot.OOR_INPUT), ("label", Slot.OOR_LABEL)) if glob[slot] > 0]
        if parts:
            slot = Slot.OOR_INPUT if who[Slot.OOR_INPUT] >= who[Slot.OOR_LABEL] else Slot.OOR_LABEL
            r, where = _where(who[slot], rank)
            seen = " and ".join(f"{int(n)} {name} ids" for name, n in parts)
            exempt = "" if tr.ignore_index is None else f" (ignore index {tr.ignore_index} exempt)"
            out.append(Violation("token_range", tr.action, step, r, sum(n for _, n in parts), 0.0,
                f"token_range on {where} at step {step}: {seen} outside [0, {real}){exempt}: "
                f"ids in [{real}, {rows}) are ghost tokens the tokenizer cannot produce; "
                f"{_NEXT[tr.action]}. Check the tokenizer / data pipeline against vocab {real}."))

    pm = checks.padding_mass
    if pm.action != "off" and glob[Slot.PM_MAX] > pm.threshold:
        r, where = _where(who[Slot.PM_MAX], rank)
        cols = rows - real
        mean = glob[Slot.PM_SUM] / glob[Slot.PM_COUNT] if glob[Slot.PM_COUNT] else 0.0
        fix = (
            "The mask removes it from softmax and gradient."
            if pm.action == "mask"
            else "Set checks.padding_mass.action: mask to mask them instead."
        )
        out.append(Violation("padding_mass", pm.action, step, r, glob[Slot.PM_MAX], pm.threshold,
            f"padding_mass on {where} at step {step}: {_fmt(glob[Slot.PM_MAX])} of the probability "
            f"(mean {_fmt(mean)}) is on the {cols} padding columns [{real}, {rows}), expected "
            f"<= {pm.threshold:g}; {_NEXT[pm.action]}. {fix}"))

    nf = checks.nonfinite
    if nf.action != "off":
        parts = [(name, glob[slot]) for name, slot in
                 (("lm_head input", Slot.NF_HIDDEN), ("real-vocab logits", Slot.NF_LOGITS),
                  ("loss", Slot.NF_LOSS)) if glob[slot] > 0]
        if parts:
            slot = max((Slot.NF_HIDDEN, Slot.NF_LOGITS, Slot.NF_LOSS), key=lambda s: who[s])
            r, where = _where(who[slot], rank)
            seen = ", ".join(f"{int(n)} in the {name}" for name, n in parts)
            out.append(Violation("nonfinite", nf.action, step, r, sum(n for _, n in parts), 0.0,
                f"nonfinite on {where} at step {step}: NaN/Inf values: {seen}; expected none; "
                f"{_NEXT[nf.action]}. Check the learning rate, the loss scale and the padding "
                f"rows [{real}, {rows}) of the embedding / lm_head."))

    ls = checks.loss_spike
    if ls.action != "off" and glob[Slot.SPIKE] > 0:
        r, where = _where(who[Slot.SPIKE], rank)
        out.append(Violation("loss_spike", ls.action, step, r, glob[Slot.SPIKE_RATIO], ls.factor,
            f"loss_spike on {where} at step {step}: loss {_fmt(glob[Slot.LOSS])} is "
            f"{_fmt(glob[Slot.SPIKE_RATIO])}x the median of its last {ls.window} losses, expected "
            f"<= {ls.factor:g}x (or a rise <= {ls.min_delta:g}); {_NEXT[ls.action]}. Look for "
            "unmasked padding columns, a bad batch or a too high learning rate."))
    return out


def attach_violations(audit: Audit, policy: Policy, rank: int) -> list[Violation]:
    """The attach-time checks, alignment and vocab, as violations (step 0)."""
    multiple = audit.pad_multiple * audit.tensor_parallel
    out = []
    for check, problems in (("alignment", audit.alignment_problems),
                            ("vocab", audit.vocab_problems)):
        action = policy.action(check)
        if action == "off" or not problems:
            continue
        next_ = ("stopping before the first step (action: fail)" if action == "fail"
                 else "continuing (action: warn)")
        message = (f"{check} on rank {rank} at attach: {'; '.join(problems)}; {next_}. Fix: "
                   f"build embedding and lm_head with {audit.aligned} rows (a multiple of "
                   f"{multiple}) and mask columns [{audit.real}, {audit.aligned}) with "
                   "checks.padding_mass.action: mask.")
        value = float(audit.rows if check == "alignment" else audit.real)
        threshold = float(multiple if check == "alignment" else audit.rows)
        out.append(Violation(check, action, 0, rank, value, threshold, message))
    return out
