"""The real vocab of a saved tokenizer, from its files: tokenizer.json (read by the tokenizers
library, as transformers loads it), else vocab.json / added_tokens.json, else a sentencepiece
tokenizer.model; plus tokenizer_config.json's added_tokens_decoder. Every file through one
bounded reader (guard/checkpoint/files.py); every problem a CheckpointError naming the file and
the key."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from guard.checkpoint.files import load_json, read_bytes
from guard.checkpoint.sentencepiece_model import sentencepiece_size
from guard.constants import MAX_IDS
from guard.errors import CheckpointError
from guard.quote import quote

__all__ = ["load_json", "tokenizer_tokens", "tokenizer_vocab"]

_IDS = MAX_IDS  # token ids are unsigned 32-bit in the tokenizers library and every format read
_ID_DIGITS = len(str(_IDS))
_MAP = "a JSON object of token -> id"


def _fast(path: Path) -> Any:
    """tokenizer.json as the tokenizers library loads it (imported here: attach needs it only
    for a checkpoint that has the file)."""
    raw = read_bytes(path, "a tokenizers JSON file")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a Rust panic is a BaseException (pyo3)
        raise CheckpointError(str(path), f"not a tokenizer the tokenizers library reads "
                              f"({quote(str(e), 200)}); expected a tokenizers JSON file") \
            from None


def _token_id(path: Path, key: object, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _IDS:
        raise CheckpointError(str(path), f"token {quote(key)} has id {quote(value)}; expected "
                              f"an id in [0, 2**32)")
    return value


def _ids_file(path: Path) -> dict[str, int]:
    """vocab.json or added_tokens.json: token -> id, every id checked."""
    vocab = load_json(path, _MAP)
    if not isinstance(vocab, dict):
        raise CheckpointError(str(path), f"expected {_MAP}")
    return {k: _token_id(path, k, v) for k, v in vocab.items()}


def _decoder(d: Path) -> dict[int, str | None]:
    """tokenizer_config.json's added_tokens_decoder (slow tokenizers list their added tokens
    only here): id -> its content; {} without the file or the key."""
    path = d / "tokenizer_config.json"
    if not path.exists():
        return {}
    conf = load_json(path, "a JSON object")
    decoder = conf.get("added_tokens_decoder") if isinstance(conf, dict) else None
    if decoder is None:
        return {}
    if not isinstance(decoder, dict):
        raise CheckpointError(str(path), "added_tokens_decoder: expected a JSON object of "
                              "id -> token")
    out: dict[int, str | None] = {}
    for key, token in decoder.items():
        # ASCII digits only: "²" passes str.isdigit() and fails int(); transformers int()s them.
        # Counted before int(): a key past 4,300 digits is a ValueError there, not an id.
        if not (key.isascii() and key.isdigit()) or len(key) > _ID_DIGITS or int(key) >= _IDS:
            raise CheckpointError(str(path), f"added_tokens_decoder key {quote(key)} is not a "
                                  "token id (a decimal integer in [0, 2**32))")
        if not isinstance(token, dict):
            raise CheckpointError(str(path), f"added_tokens_decoder[{key}]: expected an object "
                                  '{"content": ...}')
        content = token.get("content")
        out[int(key)] = content if isinstance(content, str) else None
    return out


def tokenizer_vocab(d: Path) -> tuple[int | None, str]:
    """(ids the tokenizer can produce = highest id + 1, where that came from) or (None, why)."""
    ids: set[int] = set()
    tj, vj, extra, sp = (d / n for n in ("tokenizer.json", "vocab.json", "added_tokens.json",
                                         "tokenizer.model"))
    if tj.exists():
        tok = _fast(tj)
        ids.update(tok.get_vocab(with_added_tokens=False).values())
        # Added tokens include specials the model vocab already has ([UNK], [PAD]): only the
        # new ones add ids.
        new = set(tok.get_added_tokens_decoder()) - ids
        source = (f"tokenizer.json ({len(ids)} ids in the model + {len(new)} added tokens not "
                  "among them)")
        ids.update(new)
    elif vj.exists():
        ids.update(_ids_file(vj).values())
        source = "vocab.json"
        if extra.exists():
            ids.update(_ids_file(extra).values())
            source += " + added_tokens.json"
    elif sp.exists():
        ids.update(range(sentencepiece_size(sp)))
        source = "tokenizer.model (sentencepiece)"
    else:
        return None, "no tokenizer files (tokenizer.json, vocab.json, tokenizer.model)"
    ids.update(_decoder(d))
    if not ids:
        return None, f"{source} lists no token ids"
    return max(ids) + 1, source


def tokenizer_tokens(d: Path, ids: Iterable[int]) -> dict[int, str]:
    """The tokens of `ids` from the tokenizer files of `d` (tokenizer.json's vocab and added
    tokens, else vocab.json + added_tokens.json; tokenizer_config.json's added_tokens_decoder);
    an id none of them names is left out. A CheckpointError for a file that cannot be read."""
    wanted = set(ids)
    out: dict[int, str] = {}
    tj, vj, extra = d / "tokenizer.json", d / "vocab.json", d / "added_tokens.json"
    if tj.exists():
        tok = _fast(tj)
        out.update({i: t for i in wanted if isinstance(t := tok.id_to_token(i), str)})
    elif vj.exists():
        for path in (vj, extra) if extra.exists() else (vj,):
            out.update({i: t for t, i in _ids_file(path).items() if i in wanted})
    out.update({i: t for i, t in _decoder(d).items() if i in wanted and t is not None})
    return out
