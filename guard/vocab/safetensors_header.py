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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.errors import CheckpointError
from guard.vocab.files import opened
from guard.vocab.read_limits import ENV, read_limits

__all__ = ["Tensor", "read_tensor", "safetensors_shapes"]

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


def _header(path: Path, fd: int, size: int) -> tuple[dict[str, Any], int]:
    """(the header's JSON object, the first byte of the data)."""
    limit = read_limits().header_bytes
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
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deep to read" if isinstance(e, RecursionError) else str(e)[:200]
        raise CheckpointError(str(path), f"the safetensors header is not valid JSON ({why})") \
            from None
    if not isinstance(header, dict):
        raise CheckpointError(str(path), "the safetensors header is not a JSON object")
    return header, 8 + n


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
        header, _ = _header(path, fd, size)
    return {name: tuple(info["shape"]) for name, info in
            _entries(path, header, strict=False).items()}


def _validated(path: Path, fd: int, data: int, size: int, entries: dict[str, Any]) -> None:
    """The safetensors library's own check of the file (the descriptor we opened, not the name
    again: what was checked to be a regular file is what the library reads)."""
    from safetensors import SafetensorError, safe_open

    where = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
    try:
        with safe_open(where, framework="numpy"):
            pass
    except (SafetensorError, OSError) as e:
        why = str(e).removeprefix("Error while deserializing header: ")
        if why.startswith("incomplete metadata"):
            end = data + max((i["data_offsets"][1] for i in entries.values()), default=0)
            raise CheckpointError(str(path), f"the header's tensors end at byte {end} of a "
                                  f"{size}-byte file; {_TRUNCATED}") from None
        raise CheckpointError(str(path), f"not a valid safetensors file ({why[:200]}, the "
                              "safetensors library says)") from None


def read_tensor(path: Path, name: str) -> Tensor:
    """Tensor `name` of a file the safetensors library validates whole."""
    with opened(path, _WHAT, _MISSING) as (fd, size):
        header, data = _header(path, fd, size)
        entries = _entries(path, header, strict=True)
        _validated(path, fd, data, size, entries)
    info = entries.get(name)
    if info is None:
        raise CheckpointError(str(path), f"no tensor {name!r} in the header")
    begin, end = info["data_offsets"]
    return Tensor(name, info["dtype"], tuple(info["shape"]), data + begin, data + end)
