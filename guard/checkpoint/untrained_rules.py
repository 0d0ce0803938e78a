"""The rules of the untrained_rows check, where a row of the real vocab counts as never trained,
and how a message names what they found. One definition for guard.attach (on the device:
guard/weights/features.py) and `guard audit` (guard/checkpoint/safetensors_untrained.py); the
thresholds' defaults, with where each comes from: guard/constants.py (the policy's too). Pure
Python: `guard audit` imports it without torch and without the server's wire.

A row is untrained when it is finite and
- ZERO: every |value| <= EPSILON;
- SMALL: its norm is under NORM_RATIO x the median norm of the other finite rows;
- SAME: at least DUPLICATES rows hold exactly its bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from guard.constants import DUPLICATES, EPSILON, NORM_RATIO

__all__ = ["DUPLICATES", "EPSILON", "NORM_RATIO", "REASONS", "SAME", "SMALL", "ZERO",
           "Thresholds", "by_reason", "id_list", "reasons"]

ZERO, SMALL, SAME = 1, 2, 4  # why a row looks untrained: one bit each
REASONS: Mapping[int, str] = {ZERO: "near_zero", SMALL: "small_norm", SAME: "identical"}
_NAMED = 12  # ids named one by one in a message; more are given as runs


def id_list(ids: Sequence[int], tokens: Mapping[int, str]) -> str:
    """`280 '<|eot_id|>', 281 ...`, or for many ids their runs and the first few named."""
    def one(i: int) -> str:
        return f"{i} {tokens[i]!r}" if i in tokens else str(i)

    if len(ids) <= _NAMED:
        return ", ".join(map(one, ids))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    spans = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs[:_NAMED])
    more = ", ..." if len(runs) > _NAMED else ""
    return f"{spans}{more} ({len(ids)} ids; the first: {', '.join(map(one, ids[:4]))})"


def by_reason(ids: Sequence[int], whys: Sequence[int]) -> dict[str, list[int]]:
    """Ids per reason (REASONS' names), each under its first: zero rows are identical too."""
    out: dict[str, list[int]] = {name: [] for name in REASONS.values()}
    for i, why in zip(ids, whys, strict=True):
        out[REASONS[next(bit for bit in REASONS if why & bit)]].append(i)
    return out


class Thresholds(Protocol):
    """The rules' thresholds: the policy's (guard.attach), or the defaults (`guard audit`)."""

    @property
    def epsilon(self) -> float: ...

    @property
    def norm_ratio(self) -> float: ...

    @property
    def duplicates(self) -> int: ...


def reasons(ids: Sequence[int], whys: Sequence[int], rules: Thresholds, reference: float) -> str:
    """How many rows each rule found: `3 near zero (every |value| <= 1e-16), ...`."""
    n = {k: len(v) for k, v in by_reason(ids, whys).items()}
    parts = [f"{n['near_zero']} near zero (every |value| <= {rules.epsilon:g})"
             if n["near_zero"] else "",
             f"{n['small_norm']} with a norm under {rules.norm_ratio:g}x the median row's "
             f"({reference:.3g})" if n["small_norm"] else "",
             f"{n['identical']} identical to another row" if n["identical"] else ""]
    return ", ".join(p for p in parts if p)
