"""The real vocab from a saved tokenizer's files: tokenizer.json as the tokenizers library reads
it, the slow tokenizers' JSON files and a sentencepiece model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guard.checkpoint.tokenizer_files import load_json, tokenizer_vocab
from guard.errors import CheckpointError


def test_fast_tokenizer_json_counts_the_model_and_its_added_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    # 50 ids in the model, the last of them 60 (a hole), and two added tokens (ids 50, 51).
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in [*range(49), 60]}, unk_token="t0"))
    tok.add_tokens(["<pad>", "<x>"])
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    assert tokenizer_vocab(tmp_path) == (61, "tokenizer.json (50 ids in the model + 2 added tokens "
                                         "not among them)")


def test_real_vocab_from_slow_and_sentencepiece_files(tmp_path: Path) -> None:
    (tmp_path / "vocab.json").write_text(json.dumps({f"t{i}": i for i in range(90)}))
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<a>": 90, "<b>": 99}))
    assert tokenizer_vocab(tmp_path) == (100, "vocab.json + added_tokens.json")
    sp = tmp_path / "sp"
    sp.mkdir()
    # ModelProto: 5 x field 1 (a SentencePiece message), then field 2 (trainer spec).
    piece = b"\x0a\x03abc\x15\x00\x00\x80\x3f"  # piece "abc", score 1.0
    (sp / "tokenizer.model").write_bytes((b"\x0a" + bytes([len(piece)]) + piece) * 5 +
                                         b"\x12\x02\x08\x01")
    assert tokenizer_vocab(sp) == (5, "tokenizer.model (sentencepiece)")


def test_no_tokenizer_files_is_no_size(tmp_path: Path) -> None:
    found, why = tokenizer_vocab(tmp_path)
    assert found is None and "no tokenizer files" in why


def test_load_json_names_the_file_and_what_it_should_hold(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON .*expected a model "
                       r"config"):
        load_json(bad, "a model config")
    with pytest.raises(CheckpointError, match=r"missing; expected a model config"):
        load_json(tmp_path / "absent.json", "a model config")
