"""A .safetensors file's header: an 8-byte little-endian length, then that many bytes of JSON
naming every tensor's dtype, shape and byte offsets. Read within GUARD_CHECKPOINT_MAX_HEADER_
BYTES from a regular file; its JSON is read to name the tensors (and the one at fault), and a
file whose rows are read is validated by the safetensors library itself (offsets in order,
no overlap, every byte covered, shape x dtype = bytes), as `safe_open` does before loading.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.checkpoint.files import opened
from guard.checkpoint.read_limits import ENV, limits
from guard.errors import CheckpointError

__all__ = ["Tensor", "read_tensor", "read_tensors", "safetensors_shapes"]

_WHAT = "a safetensors file"
_TRUNCATED = "expected a complete safetensors file (truncated download?)"
_MISSING = "cannot read (no such file)"


@dataclass(frozen=True)
class Tensor:
    """One tensor of a validated file: where its bytes are (absolute offsets in the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _length(path: Path, fd: int, size: int) -> int:
    """The header's length, checked against the file and the bound before a byte of it is read."""
    limit = limits().header_bytes
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise CheckpointError(str(path), f"{len(prefix)} bytes; expected a safetensors file "
                              "starting with an 8-byte little-endian header length")
    (n,) = struct.unpack("<Q", prefix)
    if 8 + n > size:
        raise CheckpointError(str(path), f"header length {n} does not fit in the {size}-byte "
                              f"file; {_TRUNCATED}")
    if n > limit:
        raise CheckpointError(str(path), f"a header of {n} bytes, over the {limit}-byte bound "
                              f"({ENV['header_bytes']}); real headers take ~120 bytes a tensor")
    return int(n)


def _parsed(path: Path, fd: int, n: int) -> dict[str, Any]:
    """The header's JSON object."""
    try:
        header = json.loads(os.pread(fd, n, 8).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deep to read" if isinstance(e, RecursionError) else str(e)[:200]
        raise CheckpointError(str(path), f"the safetensors header is not valid JSON ({why})") \
            from None
    if not isinstance(header, dict):
        raise CheckpointError(str(path), "the safetensors header is not a JSON object")
    return header


def _ints(value: object, n: int | None = None) -> bool:
    return isinstance(value, list) and (n is None or len(value) == n) and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**64 for d in value)


def _entries(path: Path, header: dict[str, Any], *, strict: bool) -> dict[str, dict[str, Any]]:
    """The tensor entries (not __metadata__), each with a valid shape, and with `strict` a
    dtype and two offsets too; the error names the tensor."""
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not _ints(info.get("shape")):
            raise CheckpointError(str(path), f"tensor {name!r} has no valid shape in the header")
        if strict and not isinstance(info.get("dtype"), str):
            raise CheckpointError(str(path), f"tensor {name!r} has no dtype in the header")
        if strict and not _ints(info.get("data_offsets"), 2):
            raise CheckpointError(str(path), f"tensor {name!r}: data_offsets "
                                  f"{str(info.get('data_offsets'))[:40]} are not two byte "
                                  "offsets [begin, end]")
        out[name] = info
    return out


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the header alone (what the tensors are, to find the
    embedding and the head); the data is checked where it is read (read_tensor)."""
    with opened(path, _WHAT, _MISSING) as (fd, size):
        header = _parsed(path, fd, _length(path, fd, size))
    return {name: tuple(info["shape"]) for name, info in
            _entries(path, header, strict=False).items()}


def _refusal(fd: int, path: Path) -> str | None:
    """What the safetensors library finds wrong with the file, or None: its own check, of the
    descriptor we opened (what was checked to be a regular file is what it reads)."""
    from safetensors import SafetensorError, safe_open

    where = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
    try:
        with safe_open(where, framework="numpy"):
            return None
    except (SafetensorError, OSError) as e:
        return str(e).removeprefix("Error while deserializing header: ")


def read_tensors(path: Path, names: Iterable[str]) -> dict[str, Tensor]:
    """Tensors `names` of a file the safetensors library validates whole: one check of the
    file, however many of its tensors are read."""
    with opened(path, _WHAT, _MISSING) as (fd, size):
        n = _length(path, fd, size)
        # The library first, then the JSON: each holds ~10-15x the header while it reads it,
        # and one after the other peaks at the larger, not the sum.
        why = _refusal(fd, path)
        entries = _entries(path, _parsed(path, fd, n), strict=True)  # names a tensor at fault
    if why is not None and why.startswith("incomplete metadata"):
        end = 8 + n + max((i["data_offsets"][1] for i in entries.values()), default=0)
        raise CheckpointError(str(path), f"the header's tensors end at byte {end} of a "
                              f"{size}-byte file; {_TRUNCATED}")
    if why is not None:
        raise CheckpointError(str(path), f"not a valid safetensors file ({why[:200]}, the "
                              "safetensors library says)")
    out = {}
    for name in names:
        info = entries.get(name)
        if info is None:
            raise CheckpointError(str(path), f"no tensor {name!r} in the header")
        begin, end = info["data_offsets"]
        out[name] = Tensor(name, info["dtype"], tuple(info["shape"]), 8 + n + begin,
                           8 + n + end)
    return out


def read_tensor(path: Path, name: str) -> Tensor:
    """Tensor `name` of a file the safetensors library validates whole."""
    return read_tensors(path, [name])[name]
