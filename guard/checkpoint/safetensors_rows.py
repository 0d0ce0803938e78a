"""Rows of a 2-D tensor read straight from a .safetensors file: the validated header gives its
dtype and byte range, so a slice of rows is one read, never the whole tensor. The bytes are
read a few MiB at a time and widened with numpy (bfloat16 is the top half of a float32, which
numpy's safetensors backend cannot slice); `guard audit` imports no torch."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from guard.checkpoint.files import opened
from guard.checkpoint.read_limits import ENV, limits
from guard.checkpoint.safetensors_header import Tensor, read_tensor
from guard.errors import CheckpointError

__all__ = ["DTYPES", "Block", "RowStats", "blocks", "norms", "row_stats"]

# Bytes per value and numpy's little-endian type for the bytes (BF16: widened, see _widen).
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
DTYPES = tuple(_SIZES)  # the dtypes this reader decodes
# Bytes read at a time: 128 rows of a 4096-wide bfloat16 embedding; with their float32 and
# float64 copies ~8 MiB held, whatever the tensor's size (4 MiB took no less time).
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Block:
    """Consecutive rows [first, first + len(values)): their bytes and their values."""

    first: int
    raw: bytes  # (b * width) bytes as in the file
    values: np.ndarray  # (b, cols) float32 (float64 for F64)


def _widen(raw: bytes, dtype: str, cols: int) -> np.ndarray:
    if dtype == "BF16":  # the high half of a float32: shift the bits up by 16
        wide = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        wide = np.frombuffer(raw, _NUMPY[dtype]).astype(np.float64 if dtype == "F64"
                                                          else np.float32)
    return wide.reshape(-1, cols)


def _width(path: Path, t: Tensor) -> int:
    if len(t.shape) != 2:
        raise CheckpointError(str(path), f"expected a 2-D tensor {t.name!r}, got "
                              f"{list(t.shape)}")
    width, limit = t.shape[1] * _SIZES[t.dtype], limits().row_bytes
    if width > limit:
        raise CheckpointError(str(path), f"rows of {t.name!r} are {width} bytes, over the "
                              f"{limit}-byte bound ({ENV['row_bytes']}); not read")
    return width


def blocks(path: Path, t: Tensor, rows: range) -> Iterator[Block]:
    """The rows of `rows` (a step-1 range within the tensor) of `t`, a few MiB per read."""
    width = _width(path, t)
    per = max(1, _READ_BYTES // max(width, 1))
    with opened(path, "a safetensors file") as (fd, _):
        for first in range(rows.start, rows.stop, per):
            n = min(per, rows.stop - first)
            try:
                raw = os.pread(fd, n * width, t.begin + first * width)
            except OSError as e:
                raise CheckpointError(str(path), f"cannot read ({e.strerror or e})") from None
            if len(raw) < n * width:
                raise CheckpointError(str(path), f"rows of {t.name!r} are cut short; expected "
                                      "a complete file (truncated download?)")
            yield Block(first, raw, _widen(raw, t.dtype, t.shape[1]))


def norms(values: np.ndarray) -> np.ndarray:
    """(b, d) -> (b,) float64 row norms (inf or NaN where a row holds one). float64 values are
    scaled by each row's largest magnitude first, so values near its limit do not overflow
    (a float32 squared never does in float64)."""
    x = values.astype(np.float64)
    if values.dtype != np.float64:
        out: np.ndarray = np.sqrt(np.einsum("ij,ij->i", x, x))
        return out
    top = np.abs(x).max(axis=1, initial=0.0)
    scale = np.where(np.isfinite(top) & (top > 0), top, 1.0)
    x /= scale[:, None]
    out = np.sqrt(np.einsum("ij,ij->i", x, x)) * scale
    return out


@dataclass(frozen=True)
class RowStats:
    """The padding rows [start, stop) of one tensor against a sample of its real rows."""

    tensor: str
    start: int
    stop: int
    dtype: str
    nonfinite: int  # values
    nonfinite_rows: tuple[int, ...]
    max_norm: float
    max_norm_row: int
    reference: float  # the largest norm among the sampled real rows
    factor: float
    # Padding rows holding exactly the bits of a real row (the last one, or a sampled one):
    # what a checkpoint converter leaves when it pads for a new tensor-parallel size.
    copies: int = 0
    copied_row: int = -1  # the real row they copy (the highest, when several)

    @property
    def ratio(self) -> float:
        return self.max_norm / self.reference if self.reference > 0 else math.inf

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.copies == 0 and (
            self.max_norm == 0 or self.ratio <= self.factor)

    def describe(self) -> str:
        from guard.quote import shown

        seen = []
        if self.nonfinite:
            first = ", ".join(str(r) for r in self.nonfinite_rows[:5])
            seen.append(f"{self.nonfinite} non-finite values (rows {first})")
        if self.max_norm > 0 and self.ratio > self.factor:
            seen.append(f"the largest norm {self.max_norm:.3g} (row {self.max_norm_row}) is "
                        f"{self.ratio:.3g}x the largest sampled real row's ({self.reference:.3g})")
        if self.copies:
            seen.append(f"{self.copies} are bit copies of real row {self.copied_row} (what a "
                        "checkpoint converter padding for a new tensor-parallel size leaves: "
                        f"each such ghost id takes exactly id {self.copied_row}'s probability)")
        return (f"padding rows [{self.start}, {self.stop}) of {shown(self.tensor)}: "
                f"{'; '.join(seen) or 'clean'}")

    def to_dict(self) -> dict[str, object]:
        return {"tensor": self.tensor, "rows": [self.start, self.stop], "dtype": self.dtype,
                "nonfinite": self.nonfinite, "nonfinite_rows": list(self.nonfinite_rows),
                "max_norm": self.max_norm if math.isfinite(self.max_norm) else None,
                "max_norm_row": self.max_norm_row, "reference_norm": self.reference,
                "factor": self.factor, "copies": self.copies,
                "copied_row": self.copied_row if self.copies else None, "ok": self.ok}


def row_stats(path: Path, name: str, start: int, stop: int, *, factor: float = 10.0,
              samples: int = 64, tensor: Tensor | None = None) -> RowStats | None:
    """Padding rows [start, stop) of `name` (`tensor`, when its file was validated already),
    against `samples` real rows spread over [0, start) and the last real row (its norm, and
    padding rows that are bit copies of one); None for a dtype this reader does not decode
    (it says which)."""
    t = tensor if tensor is not None else read_tensor(path, name)
    if t.dtype not in _SIZES:
        return None
    stop = min(stop, t.shape[0])
    reference = 0.0
    real_bits: dict[bytes, int] = {}  # the sampled real rows' bytes (non-zero rows), and row
    sampled = list(range(0, start, max(1, start // samples)))[:samples]
    for r in sorted({*sampled, *([start - 1] if start > 0 else [])}):
        for b in blocks(path, t, range(r, r + 1)):
            n = norms(b.values)
            reference = max(reference, float(n[0])) if np.isfinite(n[0]) else reference
            if n[0] > 0:
                real_bits[b.raw] = r
    copies, copied = 0, -1
    nonfinite, bad_rows = 0, []
    max_norm, max_row = 0.0, start
    for b in blocks(path, t, range(start, stop)):
        finite = np.isfinite(b.values)
        nonfinite += int(finite.size - np.count_nonzero(finite))
        bad = ~finite.all(axis=1)
        bad_rows += (b.first + np.flatnonzero(bad)).tolist()
        n = np.where(bad, -1.0, norms(b.values))
        width = len(b.raw) // max(len(b.values), 1)
        for i in range(len(b.values)):
            if (row := real_bits.get(b.raw[i * width:(i + 1) * width])) is not None:
                copies, copied = copies + 1, max(copied, row)
        if len(n) and (top := float(n.max())) > max_norm:
            max_norm, max_row = top, b.first + int(n.argmax())
    return RowStats(name, start, stop, t.dtype, nonfinite, tuple(bad_rows), max_norm, max_row,
                    reference, factor, copies, copied)
