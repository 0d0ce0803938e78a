"""The real vocab of a saved tokenizer, from its files alone (no tokenizers library):
tokenizer.json, else vocab.json / added_tokens.json, else a sentencepiece tokenizer.model."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from guard.errors import CheckpointError

__all__ = ["load_json", "tokenizer_tokens", "tokenizer_vocab"]


def load_json(path: Path, what: str) -> Any:
    """The JSON in `path`, or a CheckpointError naming the file and `what` it should hold."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(str(path), f"missing; expected {what}") from None
    except OSError as e:
        raise CheckpointError(str(path), f"cannot read ({e.strerror or e}); expected {what}") \
            from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(path), f"not valid JSON ({e}); expected {what}") from None


def _sentencepiece_size(path: Path) -> int:
    """Pieces in a sentencepiece ModelProto: field 1 (repeated, length-delimited) entries."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(str(path), f"cannot read ({e.strerror or e})") from None
    i, pieces = 0, 0

    def varint() -> int:
        nonlocal i
        out, shift = 0, 0
        while True:
            if i >= len(data):
                raise CheckpointError(str(path), "truncated protobuf; expected a sentencepiece "
                                      "model")
            b = data[i]
            i += 1
            out |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return out

    while i < len(data):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            varint()
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n = varint()  # not `i += varint()`: that adds to i as it was before the call
            i += n
            pieces += field == 1
        else:
            raise CheckpointError(str(path), f"unexpected protobuf wire type {wire}; expected a "
                                  "sentencepiece model")
    return pieces


def tokenizer_vocab(d: Path) -> tuple[int | None, str]:
    """(ids the tokenizer can produce = highest id + 1, where that came from) or (None, why)."""
    ids: set[int] = set()
    source = ""
    tj = d / "tokenizer.json"
    if tj.exists():
        data = load_json(tj, "a tokenizers JSON file")
        model = data.get("model") if isinstance(data, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
            ids.update(v for v in vocab.values() if isinstance(v, int))
        elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
            ids.update(range(len(vocab)))
        else:
            raise CheckpointError(str(tj), 'expected "model": {"vocab": ...} (a tokenizers file)')
        listed = data.get("added_tokens") or []
        added = [t.get("id") for t in listed if isinstance(t, dict)] if isinstance(listed, list) \
            else []
        # Added tokens include specials the model vocab already has ([UNK], [PAD]): only the
        # new ones add ids.
        new = {a for a in added if isinstance(a, int)} - ids
        source = (f"tokenizer.json ({len(ids)} ids in the model + {len(new)} added tokens not "
                  "among them)")
        ids.update(new)
    elif (d / "vocab.json").exists():
        vocab = load_json(d / "vocab.json", "a JSON object of token -> id")
        if not isinstance(vocab, dict):
            raise CheckpointError(str(d / "vocab.json"), "expected a JSON object of token -> id")
        ids.update(v for v in vocab.values() if isinstance(v, int))
        source = "vocab.json"
        if (d / "added_tokens.json").exists():
            extra = load_json(d / "added_tokens.json", "a JSON object of token -> id")
            if not isinstance(extra, dict):
                raise CheckpointError(str(d / "added_tokens.json"),
                                      "expected a JSON object of token -> id")
            ids.update(v for v in extra.values() if isinstance(v, int))
            source += " + added_tokens.json"
    elif (d / "tokenizer.model").exists():
        ids.update(range(_sentencepiece_size(d / "tokenizer.model")))
        source = "tokenizer.model (sentencepiece)"
    else:
        return None, "no tokenizer files (tokenizer.json, vocab.json, tokenizer.model)"
    tc = d / "tokenizer_config.json"
    if tc.exists():  # slow tokenizers list their added tokens only here
        conf = load_json(tc, "a JSON object")
        decoder = conf.get("added_tokens_decoder") if isinstance(conf, dict) else None
        if isinstance(decoder, dict):
            ids.update(int(k) for k in decoder if str(k).isdigit())
    if not ids:
        return None, f"{source} lists no token ids"
    return max(ids) + 1, source


def _added(listed: object) -> dict[int, str]:
    """id -> content of a list of added tokens ({"id", "content"}, tokenizer.json's form)."""
    if not isinstance(listed, list):
        return {}
    return {t["id"]: t["content"] for t in listed if isinstance(t, dict)
            and isinstance(t.get("id"), int) and isinstance(t.get("content"), str)}


def tokenizer_tokens(d: Path, ids: Iterable[int]) -> dict[int, str]:
    """The tokens of `ids` from the tokenizer files of `d` (tokenizer.json's vocab and added
    tokens, else vocab.json + added_tokens.json; tokenizer_config.json's added_tokens_decoder);
    an id none of them names is left out. A CheckpointError for a file that is not JSON."""
    wanted, out = set(ids), {}
    tj, vj, extra = d / "tokenizer.json", d / "vocab.json", d / "added_tokens.json"
    if tj.exists():
        data = load_json(tj, "a tokenizers JSON file")
        model = data.get("model") if isinstance(data, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
            out.update({i: t for t, i in vocab.items() if i in wanted})
        elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
            out.update({i: vocab[i][0] for i in wanted if 0 <= i < len(vocab)
                        and isinstance(vocab[i], list) and vocab[i]})
        out.update(_added(data.get("added_tokens") if isinstance(data, dict) else None))
    elif vj.exists():
        for path in (vj, extra) if extra.exists() else (vj,):
            vocab = load_json(path, "a JSON object of token -> id")
            if isinstance(vocab, dict):
                out.update({i: t for t, i in vocab.items() if i in wanted})
    tc = d / "tokenizer_config.json"
    conf = load_json(tc, "a JSON object") if tc.exists() else None
    decoder = conf.get("added_tokens_decoder") if isinstance(conf, dict) else None
    if isinstance(decoder, dict):
        out.update(_added([{"id": int(k), **v} for k, v in decoder.items()
                           if str(k).isdigit() and isinstance(v, dict)]))
    return {i: t for i, t in out.items() if i in wanted and isinstance(t, str)}
