"""The untrained_rows rules read from a .safetensors file (`guard audit`): the same three rules
and thresholds as guard.attach on the device (guard/device/untrained_rules.py), in pure Python,
every row of the real vocab [0, real) once, a block of rows per read.

Per row: its norm (math.hypot over the row, in C), its largest magnitude only when the norm
leaves the epsilon rule open (norm between epsilon and sqrt(d) x epsilon), and a digest of its
bytes for the identical rows. What it costs: docs/audit.md (a 128k x 4096 bfloat16 embedding).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from guard.vocab.safetensors_rows import DTYPES, decode, iter_rows
from guard.vocab.untrained_rules import (
    DUPLICATES,
    EPSILON,
    NORM_RATIO,
    SAME,
    SMALL,
    ZERO,
    by_reason,
    id_list,
    reasons,
)

__all__ = ["Rules", "UntrainedStats", "untrained_stats"]


@dataclass(frozen=True)
class Rules:
    """The thresholds (guard.attach takes them from its policy; `guard audit` the defaults)."""

    epsilon: float = EPSILON
    norm_ratio: float = NORM_RATIO
    duplicates: int = DUPLICATES


@dataclass(frozen=True)
class UntrainedStats:
    """The rows of the real vocab [0, real) of one tensor that look never trained."""

    tensor: str
    real: int
    dtype: str
    ids: tuple[int, ...]
    why: tuple[int, ...]  # per id, ZERO | SMALL | SAME bits
    reference: float  # the median norm of the finite rows not near zero
    rules: Rules
    tokens: Mapping[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.ids

    def describe(self) -> str:
        """One line: the ids, their tokens, and what each rule found."""
        if self.ok:
            return f"rows [0, {self.real}) of {self.tensor}: none untrained"
        return (f"rows [0, {self.real}) of {self.tensor}: {len(self.ids)} untrained, ids "
                f"{id_list(self.ids, self.tokens)} "
                f"({reasons(self.ids, self.why, self.rules, self.reference)})")

    def to_dict(self) -> dict[str, object]:
        return {"tensor": self.tensor, "rows": [0, self.real], "dtype": self.dtype,
                "ids": list(self.ids), **by_reason(self.ids, self.why),
                "tokens": {str(i): t for i, t in self.tokens.items()},
                "reference_norm": self.reference, "epsilon": self.rules.epsilon,
                "norm_ratio": self.rules.norm_ratio, "duplicates": self.rules.duplicates,
                "ok": self.ok}


def untrained_stats(path: Path, name: str, real: int, rules: Rules = Rules(), *,
                    exempt: tuple[int, ...] = ()) -> UntrainedStats | None:
    """Rows [0, real) of tensor `name` by the rules; `exempt` rows are never untrained (the
    embedding's padding row, zero by design). None for a dtype this reader does not decode."""
    dtype, rows = iter_rows(path, name, 0, real)
    if dtype not in DTYPES:
        return None
    norms: list[float] = []
    zero: set[int] = set()
    same: dict[bytes, list[int]] = defaultdict(list)
    width = 0
    for i, raw in enumerate(rows):
        values = decode(raw, dtype)
        width = len(values)
        norm = math.hypot(*values)
        norms.append(norm)
        if not math.isfinite(norm):
            continue
        # max |x| <= norm <= sqrt(d) max |x|: the largest value only where that decides.
        if norm <= rules.epsilon or (norm <= math.sqrt(width) * rules.epsilon
                                     and max(map(abs, values)) <= rules.epsilon):
            zero.add(i)
        same[hashlib.blake2b(raw, digest_size=16).digest()].append(i)
    # torch's median is the lower middle value: the same reference as on the device.
    others = [n for i, n in enumerate(norms) if math.isfinite(n) and i not in zero]
    reference = statistics.median_low(others) if others else 0.0
    small = {i for i, n in enumerate(norms) if math.isfinite(n) and i not in zero
             and n < rules.norm_ratio * reference}
    twins = {i for group in same.values() if len(group) >= rules.duplicates for i in group}
    why = {i: (ZERO if i in zero else 0) | (SMALL if i in small else 0) |
           (SAME if i in twins else 0) for i in zero | small | twins if i not in exempt}
    ids = tuple(sorted(why))
    return UntrainedStats(name, real, dtype, ids, tuple(why[i] for i in ids), reference, rules)
