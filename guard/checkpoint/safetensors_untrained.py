"""The untrained_rows rules read from a .safetensors file (`guard audit`): the same three rules
and thresholds as guard.attach on the device (guard/weights/features.py), with numpy on
the host, every row of the real vocab [0, real) once, a few MiB of rows per read.

Per row: its largest magnitude and its norm (float64), whether it is finite, and a digest of
its bytes for the identical rows. What it costs: docs/audit.md (a 128k x 4096 bfloat16
embedding).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from guard.checkpoint.safetensors_header import Tensor, read_tensor
from guard.checkpoint.safetensors_rows import DTYPES, blocks, norms
from guard.checkpoint.untrained_rules import (
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
        from guard.quote import shown

        if self.ok:
            return f"rows [0, {self.real}) of {shown(self.tensor)}: none untrained"
        return (f"rows [0, {self.real}) of {shown(self.tensor)}: {len(self.ids)} untrained, ids "
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
                    exempt: tuple[int, ...] = (),
                    tensor: Tensor | None = None) -> UntrainedStats | None:
    """Rows [0, real) of tensor `name` (`tensor`, when its file was validated already) by the
    rules; `exempt` rows are never untrained (the embedding's padding row, zero by design).
    None for a dtype this reader does not decode."""
    t = tensor if tensor is not None else read_tensor(path, name)
    if t.dtype not in DTYPES:
        return None
    real = min(real, t.shape[0])
    top, norm, finite = (np.empty(real) for _ in range(3))
    digests = bytearray()
    for b in blocks(path, t, range(real)):
        at = slice(b.first, b.first + len(b.values))
        top[at] = np.abs(b.values).max(axis=1, initial=0.0)
        norm[at] = norms(b.values)
        finite[at] = np.isfinite(b.values).all(axis=1)
        raw, width = memoryview(b.raw), len(b.raw) // len(b.values)
        for i in range(len(b.values)):
            digests += hashlib.blake2b(raw[i * width:(i + 1) * width], digest_size=16).digest()
    ok = finite > 0
    zero = ok & (top <= rules.epsilon)
    others = ok & ~zero
    # torch's median is the lower middle value: the same reference as on the device.
    kept = np.sort(norm[others])
    reference = float(kept[(len(kept) - 1) // 2]) if len(kept) else 0.0
    small = others & (norm < rules.norm_ratio * reference)
    _, group, count = np.unique(np.frombuffer(bytes(digests), "V16"), return_inverse=True,
                                return_counts=True)
    same = ok & (count[group] >= rules.duplicates)
    why = zero * ZERO | small * SMALL | same * SAME
    if exempt:
        why[[i for i in exempt if 0 <= i < real]] = 0
    ids = tuple(int(i) for i in np.flatnonzero(why))
    return UntrainedStats(name, real, t.dtype, ids, tuple(int(why[i]) for i in ids),
                          reference, rules)
