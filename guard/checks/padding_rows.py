"""padding_rows: the padding rows [real, rows) of the embedding and lm_head weights, at attach
and at each read: non-finite values, or a norm far above the largest real row's (what an
uninitialised resize leaves). Its state (guard/stateful/padding_rows.py) reads and repairs the
rows (guard/device/rows.py) and names the weights in the message (`Context.detail`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks import nonfinite
from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, fmt
from guard.policy import Action, Policy

__all__ = ["COPIED", "COPIES", "NONFINITE", "RATIO", "SPEC", "PaddingRowsFigures"]

NONFINITE = Slot("padding_rows.nonfinite")  # non-finite values in the padding rows
RATIO = Slot("padding_rows.ratio", "max")  # their largest norm / the largest real row's
# Padding rows that hold a real row's values, and 1 + that row (0: none): at attach only.
COPIES = Slot("padding_rows.copies")
COPIED = Slot("padding_rows.copied", "max")


@dataclass(frozen=True)
class PaddingRowsFigures:
    nonfinite: int
    ratio: float  # inf where a padding row is non-finite or the real rows are all zero
    copies: int = 0  # padding rows that hold a real row's values (read at attach)
    copied: int = -1  # the real row they copy


def _figures(raw: Raw) -> PaddingRowsFigures:
    return PaddingRowsFigures(int(raw[NONFINITE]), raw[RATIO], int(raw[COPIES]),
                              int(raw[COPIED]) - 1)


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return {NONFINITE: 0.0, RATIO: policy.checks.padding_rows.factor, COPIES: 0.0}


def _describe(f: PaddingRowsFigures, c: Context) -> Found:
    weights = c.detail or "the padding rows"
    factor = c.policy.checks.padding_rows.factor
    seen = ", ".join(part for part in (
        f"{f.nonfinite} non-finite values" if f.nonfinite else "",
        f"the largest norm {fmt(f.ratio)}x the largest real row's" if RATIO in c.crossed else "",
        f"{f.copies} rows that copy real row {f.copied} (what a checkpoint converter padding for "
        f"a new tensor-parallel size leaves: each such ghost id takes exactly id {f.copied}'s "
        "probability)" if COPIES in c.crossed else "",
    ) if part)
    fix = ("" if c.policy.action("padding_rows") is Action.REPAIR else
           " Set checks.padding_rows.action: repair to overwrite them with the mean real row.")
    copies = COPIES in c.crossed and not f.nonfinite and RATIO not in c.crossed
    kind = "non-finite rows" if f.nonfinite else "copies" if copies else ""
    value = float(f.nonfinite) if f.nonfinite else float(f.copies) if copies else f.ratio
    limit = 0.0 if copies else factor
    real = c.glob[nonfinite.SPEC].counts
    if real["logits"] or real["hidden"]:
        # The real logits are non-finite too: the weights diverged (a NaN spread through the
        # update), and the mean of the real rows is no repair (guard/device/rows.py skips it).
        then = ("not repairing them: the real rows are no finite mean to repair from, so "
                "the rows are left as they are (action: repair)"
                if c.policy.action("padding_rows") is Action.REPAIR else c.next)
        return Found(value, limit, kind="diverged", text=(
            f"rows [{c.real}, {c.rows}) of {weights}: {seen}, and the real-vocab logits or "
            "the lm_head input are non-finite (see nonfinite): the weights diverged, which no "
            f"resize explains; {then}. Find the first non-finite step (nonfinite names the "
            "module) and restart from a checkpoint before it."))
    expected = ("no copy of a real row" if copies else
                f"finite and <= {factor:g}x: what an uninitialised resize leaves")
    return Found(value, limit, kind=kind, text=(
        f"rows [{c.real}, {c.rows}) of {weights}: {seen}, expected {expected}, which poisons "
        f"the logits wherever the mask is not (evaluation, generation, a saved checkpoint); "
        f"{c.next}.{fix}"))


SPEC = Spec("padding_rows", (NONFINITE, RATIO, COPIES, COPIED), _figures, _thresholds,
            describe=_describe)
