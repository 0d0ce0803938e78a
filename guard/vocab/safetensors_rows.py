"""Rows of a 2-D tensor read straight from a .safetensors file: the header gives its dtype and
byte offsets, so a slice of rows is one seek and one read, never the whole tensor. Pure
Python (struct): `guard audit` imports no torch and no numpy."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from guard.errors import CheckpointError

__all__ = ["DTYPES", "RowStats", "decode", "iter_rows", "read_rows", "row_stats"]

# Bytes per value, and the struct format of the little-endian values (BF16: see decode).
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_FORMATS = {"F64": "d", "F32": "f", "F16": "e"}
DTYPES = tuple(_SIZES)  # the dtypes this reader decodes


def decode(raw: bytes, dtype: str) -> tuple[float, ...]:
    """Little-endian values of `dtype` (F64, F32, F16, BF16) as Python floats."""
    n = len(raw) // _SIZES[dtype]
    if dtype == "BF16":  # the high half of a float32: put two zero bytes below each value
        wide = bytearray(4 * n)
        wide[2::4], wide[3::4] = raw[0::2], raw[1::2]
        return struct.unpack(f"<{n}f", wide)
    return struct.unpack(f"<{n}{_FORMATS[dtype]}", raw)


def _entry(path: Path, name: str) -> tuple[str, tuple[int, int], int, int]:
    """(dtype, (rows, cols), first byte of the tensor in the file, data start)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(str(path), f"cannot read the safetensors header ({e})") from None
    info = header.get(name) if isinstance(header, dict) else None
    if not isinstance(info, dict):
        raise CheckpointError(str(path), f"no tensor {name!r} in the header")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) == 2 and isinstance(offsets, list)):
        raise CheckpointError(str(path), f"tensor {name!r}: expected a 2-D shape and offsets")
    return str(info.get("dtype")), (shape[0], shape[1]), int(offsets[0]), 8 + n


def read_rows(path: Path, name: str, rows: list[int]) -> tuple[str, list[tuple[float, ...]]]:
    """(dtype, the given rows' values) of tensor `name`; runs of rows are read as one slice.
    An unsupported dtype gives no rows."""
    dtype, (nrows, ncols), begin, data = _entry(path, name)
    if dtype not in _SIZES:
        return dtype, []
    width = ncols * _SIZES[dtype]
    out: list[tuple[float, ...]] = []
    try:
        with path.open("rb") as f:
            for r in rows:
                if not 0 <= r < nrows:
                    raise CheckpointError(str(path), f"row {r} outside {name!r} ({nrows} rows)")
                f.seek(data + begin + r * width)
                raw = f.read(width)
                if len(raw) < width:
                    raise CheckpointError(str(path), f"row {r} of {name!r} is cut short; "
                                          "expected a complete file (truncated download?)")
                out.append(decode(raw, dtype))
    except OSError as e:
        raise CheckpointError(str(path), f"cannot read ({e.strerror or e})") from None
    return dtype, out


def iter_rows(path: Path, name: str, start: int, stop: int,
              block: int = 256) -> tuple[str, Iterator[bytes]]:
    """(dtype, each row of [start, stop) of tensor `name` as its raw bytes), read `block` rows
    per read: the memory of a block, whatever the tensor's size. An unsupported dtype gives no
    rows."""
    dtype, (nrows, ncols), begin, data = _entry(path, name)
    if dtype not in _SIZES:
        return dtype, iter(())
    width = ncols * _SIZES[dtype]

    def rows() -> Iterator[bytes]:
        try:
            with path.open("rb") as f:
                f.seek(data + begin + start * width)
                for first in range(start, min(stop, nrows), block):
                    n = min(block, min(stop, nrows) - first)
                    raw = f.read(n * width)
                    if len(raw) < n * width:
                        raise CheckpointError(str(path), f"rows of {name!r} are cut short; "
                                              "expected a complete file (truncated download?)")
                    yield from (raw[i * width : (i + 1) * width] for i in range(n))
        except OSError as e:
            raise CheckpointError(str(path), f"cannot read ({e.strerror or e})") from None

    return dtype, rows()


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

    @property
    def ratio(self) -> float:
        return self.max_norm / self.reference if self.reference > 0 else math.inf

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and (self.max_norm == 0 or self.ratio <= self.factor)

    def describe(self) -> str:
        seen = []
        if self.nonfinite:
            first = ", ".join(str(r) for r in self.nonfinite_rows[:5])
            seen.append(f"{self.nonfinite} non-finite values (rows {first})")
        if self.max_norm > 0 and self.ratio > self.factor:
            seen.append(f"the largest norm {self.max_norm:.3g} (row {self.max_norm_row}) is "
                        f"{self.ratio:.3g}x the largest sampled real row's ({self.reference:.3g})")
        return (f"padding rows [{self.start}, {self.stop}) of {self.tensor}: "
                f"{'; '.join(seen) or 'clean'}")

    def to_dict(self) -> dict[str, object]:
        return {"tensor": self.tensor, "rows": [self.start, self.stop], "dtype": self.dtype,
                "nonfinite": self.nonfinite, "nonfinite_rows": list(self.nonfinite_rows),
                "max_norm": self.max_norm if math.isfinite(self.max_norm) else None,
                "max_norm_row": self.max_norm_row, "reference_norm": self.reference,
                "factor": self.factor, "ok": self.ok}


def _norm(row: tuple[float, ...]) -> float:
    return math.sqrt(math.fsum(x * x for x in row))


def row_stats(path: Path, name: str, start: int, stop: int, *, factor: float = 10.0,
              samples: int = 64) -> RowStats | None:
    """Padding rows [start, stop) of `name`, against `samples` real rows spread over
    [0, start); None for a dtype this reader does not decode (it says which)."""
    real = list(range(0, start, max(1, start // samples)))[:samples]
    dtype, values = read_rows(path, name, real + list(range(start, stop)))
    if not values:
        return None
    reference = max((_norm(v) for v in values[: len(real)]), default=0.0)
    pad = values[len(real) :]
    bad_rows = tuple(start + i for i, v in enumerate(pad) if not all(map(math.isfinite, v)))
    nonfinite = sum(1 for v in pad for x in v if not math.isfinite(x))
    finite_norms = [(_norm(v), start + i) for i, v in enumerate(pad)
                    if start + i not in bad_rows]
    max_norm, max_row = max(finite_norms, key=lambda nr: nr[0], default=(0.0, start))
    return RowStats(name, start, stop, dtype, nonfinite, bad_rows, max_norm, max_row,
                    reference, factor)
