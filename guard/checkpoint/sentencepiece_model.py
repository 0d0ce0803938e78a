"""The pieces of a sentencepiece `tokenizer.model` (a ModelProto: field 1, repeated, is one
SentencePiece each), counted by a bounded protobuf reader rather than the sentencepiece
package: the count is all the audit needs, and the package writes its C++ log lines to the
process's stderr (past Python's logging: a training job's and `guard audit --json`'s) and
needs a native module in every install (docs/audit.md, "Hostile files").

Bounded: a varint has at most 10 bytes (protobuf's own limit; an unbounded one made 1 MB of
0xff run for ever), every field must end inside the file, and each step reads at least one
byte, so the time is linear in the file's size.
"""

from __future__ import annotations

from pathlib import Path

from guard.checkpoint.files import read_bytes
from guard.errors import CheckpointError

__all__ = ["sentencepiece_size"]

_VARINT_BYTES = 10  # a 64-bit value: 7 bits a byte
_WHAT = "a sentencepiece model"


def sentencepiece_size(path: Path) -> int:
    """Pieces in the ModelProto of `path`; a CheckpointError for anything that is not one."""
    data = read_bytes(path, _WHAT)
    end, i, pieces = len(data), 0, 0

    def varint(at: int) -> tuple[int, int]:
        out = 0
        for n in range(_VARINT_BYTES):
            if at + n >= end:
                raise CheckpointError(str(path), f"a varint cut short at byte {at}; expected "
                                      f"{_WHAT} (truncated download?)")
            b = data[at + n]
            out |= (b & 0x7F) << (7 * n)
            if not b & 0x80:
                return out, at + n + 1
        raise CheckpointError(str(path), f"a varint longer than {_VARINT_BYTES} bytes at byte "
                              f"{at}; expected {_WHAT}")

    while i < end:
        at = i
        key, i = varint(i)
        field, wire = key >> 3, key & 7
        if field == 0 or wire not in (0, 1, 2, 5):
            raise CheckpointError(str(path), f"field {field} of wire type {wire} at byte {at}; "
                                  f"expected {_WHAT}")
        if wire == 0:
            _, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            i += n
        else:
            i += 8 if wire == 1 else 4
        if i > end:
            raise CheckpointError(str(path), f"field {field} at byte {at} runs past the end of "
                                  f"the {end}-byte file; expected {_WHAT} (truncated download?)")
        if field == 1:
            if wire != 2:
                raise CheckpointError(str(path), f"field 1 at byte {at} is not a piece; "
                                      f"expected {_WHAT}")
            pieces += 1
    return pieces
