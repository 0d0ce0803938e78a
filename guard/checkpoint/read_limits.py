"""How much of a checkpoint directory `guard audit` and attach read: the directory is untrusted
input (audited because it was downloaded), so every read has a bound, each an environment
variable with the default below (docs/audit.md, "Hostile files"), read once a process: at the
first read, then kept (`limits()`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cache

from guard.errors import CheckpointError

__all__ = ["ENV", "ReadLimits", "limits", "read_limits"]


@dataclass(frozen=True)
class ReadLimits:
    """The bounds, in bytes."""

    # config.json, the shard index and the tokenizer files, each: Gemma-3's tokenizer.json, the
    # largest we know of, is 33 MB (Llama-3's 9 MB).
    file_bytes: int = 64 << 20
    # One safetensors header: ~120 bytes a tensor, so real ones stay under 1 MB (a shard of a
    # 128-expert MoE holds ~1,000 tensors). The library's own bound, 100 MB, let a header of
    # 1.38 M tensors take 2.8 s and 1.2 GiB to open.
    header_bytes: int = 16 << 20
    # One row of a tensor whose rows are read: 262,144 float32 values (hidden sizes are at
    # most 16,384), read a few MiB at a time.
    row_bytes: int = 1 << 20


ENV: Mapping[str, str] = {f.name: f"GUARD_CHECKPOINT_MAX_{f.name.upper()}" for f in
                          fields(ReadLimits)}


def read_limits(environ: Mapping[str, str] = os.environ) -> ReadLimits:
    """The bounds, each from its GUARD_CHECKPOINT_MAX_* variable when set; a CheckpointError
    naming the variable for a value that is not a positive number of bytes."""
    values: dict[str, int] = {}
    for name, variable in ENV.items():
        text = environ.get(variable)
        if text is None:
            continue
        if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
            raise CheckpointError(variable, f"expected a positive number of bytes, got "
                                  f"{text[:40]!r}")
        values[name] = int(text)
    return ReadLimits(**values)


@cache
def limits() -> ReadLimits:
    """The process's bounds: read_limits() of the environment at the first call, kept after (a
    bad value is not kept: it is refused again at the next read)."""
    return read_limits()
