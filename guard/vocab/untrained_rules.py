"""The rules of the untrained_rows check, where a row of the real vocab counts as never trained,
and how a message names what they found. One definition for guard.attach (on the device:
guard/device/untrained_rules.py; the policy's defaults, guard/policy.py) and `guard audit`
(guard/vocab/safetensors_untrained.py). Pure Python: `guard audit` imports it without torch and
without the server's wire. The measurements behind the numbers: docs/checks.md.

A row is untrained when it is finite and
- ZERO: every |value| <= EPSILON;
- SMALL: its norm is under NORM_RATIO x the median norm of the other finite rows;
- SAME: at least DUPLICATES rows hold exactly its bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["DUPLICATES", "EPSILON", "NORM_RATIO", "REASONS", "SAME", "SMALL", "ZERO",
           "Thresholds", "by_reason", "id_list", "reasons"]

# Unsloth's bound (fix_untrained_tokens). Llama-3 base's reserved rows hold 0, or ~1e-23 in
# bfloat16 (it keeps float32's exponent); a trained row's values are 1e-3..1, and no optimizer
# update leaves a value under 1e-16.
EPSILON = 1e-16
# A never-seen row that weight decay shrank but left above EPSILON (0.1 decay at lr 3e-4 takes
# a row to 1e-3 of its init in 230k steps). Healthy rows measured 0.6-1.6x the median (a normal
# init, rows trained on Zipf ids), the trained mean a repair writes 0.1x, a decayed row 1e-4x
# (bench/untrained_norms.py).
NORM_RATIO = 1e-3
# Placeholders (Llama-3.1's head rows of its reserved tokens are one vector repeated): rows
# that trained never coincide bit for bit.
DUPLICATES = 2

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
