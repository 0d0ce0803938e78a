"""Where the real vocab comes from: what the user gave (`vocab_size=`, the policy's
`vocab.real_size`, `tokenizer=`), else what the model says of itself (an HF config that keeps
the unpadded size, the tokenizer files of the checkpoint directory it was loaded from), else
nothing. Without it the guard can only take every row as real: it then watches no padding
column and no ghost id, and says so (coverage, at attach)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.checkpoint.tokenizer_files import tokenizer_vocab
from guard.errors import AttachError, CheckpointError
from guard.quote import quote

__all__ = ["GIVE_IT", "Real", "checkpoint_dir", "config_levels", "find_real"]

log = logging.getLogger("guard")

# Configs that keep the unpadded size beside a padded `vocab_size` (HF's Inkling
# `unpadded_vocab_size`, and the names conversions from other frameworks use).
_CONFIG_REAL = ("unpadded_vocab_size", "original_vocab_size", "real_vocab_size",
                "tokenizer_vocab_size")

# The three ways to give it, for every message that asks for it.
GIVE_IT = ("guard.attach(model, tokenizer=tok), guard.attach(model, vocab_size=len(tok)), or "
           "vocab.real_size in the policy")


@dataclass(frozen=True)
class Real:
    """The real vocab and where it came from."""

    size: int
    source: str  # e.g. "len(tokenizer)", "config.unpadded_vocab_size"; "" when not found
    given: bool = False  # by the user (an argument or the policy), not found in the model
    looked: str = ""  # where the guard looked when nothing was given, for the message

    @property
    def found(self) -> bool:
        return bool(self.source)


def _given(sources: dict[str, int | None], tokenizer: Any) -> dict[str, int]:
    given = {name: n for name, n in sources.items() if n is not None}
    if tokenizer is not None:
        try:
            given["len(tokenizer)"] = len(tokenizer)
        except TypeError:
            raise AttachError(
                f"tokenizer= must support len() (got {type(tokenizer).__name__}); "
                "pass vocab_size=<ids the tokenizer can produce> instead"
            ) from None
    for name, n in given.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise AttachError(f"{name} must be a positive int, got {n!r}")
    if len(set(given.values())) > 1:
        seen = ", ".join(f"{k} {v}" for k, v in given.items())
        raise AttachError(f"the real vocab size is ambiguous: {seen}; give one of them")
    return given


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


def config_levels(config: Any) -> list[tuple[str, Any]]:
    """An HF config and, in a multimodal model, its text_config (where the language model's
    settings are), each with the name a message gives it; none for a model without one."""
    levels = [("config", config), ("config.text_config", getattr(config, "text_config", None))]
    return [(prefix, cfg) for prefix, cfg in levels if cfg is not None]


def _from_config(config: Any, rows: int) -> tuple[int, str] | None:
    """An unpadded size the config keeps beside the padded one (or inside text_config)."""
    for prefix, cfg in config_levels(config):
        for name in _CONFIG_REAL:
            n = _int(getattr(cfg, name, None))
            if n is not None and n <= rows:
                return n, f"{prefix}.{name}"
        # Megatron-style: the padded size under its own name, vocab_size the tokenizer's.
        padded, vocab = _int(getattr(cfg, "padded_vocab_size", None)), \
            _int(getattr(cfg, "vocab_size", None))
        if padded == rows and vocab is not None and vocab < rows:
            return vocab, f"{prefix}.vocab_size (beside padded_vocab_size {padded})"
    return None


def checkpoint_dir(model: Any) -> str | None:
    """The local directory an HF model was loaded from (config._name_or_path), if any."""
    config = getattr(model, "config", None)
    where = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not isinstance(where, str | os.PathLike) or not where or not os.path.isdir(where):
        return None
    return os.fspath(where)


def _from_checkpoint(model: Any) -> tuple[int | None, str]:
    """The tokenizer files of the local directory the model was loaded from, if any."""
    where = checkpoint_dir(model)
    if where is None:
        return None, "no local checkpoint directory (config._name_or_path)"
    try:
        n, source = tokenizer_vocab(Path(where))
    except Exception as e:  # untrusted files never stop an attach
        why = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        log.warning("cannot read the tokenizer files of %s (%s); going on without "
                    "them", quote(where, 300), quote(why, 500))
        return None, f"the tokenizer files in {where} (unreadable: {quote(why, 300)})"
    if n is None:
        return None, f"{where}: {source}"
    return n, f"{source} in {where}"


def find_real(model: Any, sources: dict[str, int | None], tokenizer: Any, rows: int) -> Real:
    """The real vocab: given (the sources, name -> int or None, and `len(tokenizer)`; they
    must agree), else found in the model's config or its checkpoint's tokenizer files, else
    `rows` with `found` false."""
    given = _given(sources, tokenizer)
    if given:
        name, n = next(iter(given.items()))
        return Real(n, name, given=True)
    config = getattr(model, "config", None)
    if config is None:
        return Real(rows, "", looked="the model has no config")
    if (hit := _from_config(config, rows)) is not None:
        return Real(hit[0], hit[1])
    saved, where = _from_checkpoint(model)
    if saved is not None:
        return Real(saved, where)
    return Real(rows, "", looked=f"its config keeps no unpadded size; {where}")
