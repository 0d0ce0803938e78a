"""guard.checkpoint_audit: the vocab audit of model directories written by save_pretrained."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch

from guard.checkpoint_audit import audit_checkpoint, safetensors_shapes
from guard.errors import CheckpointError


def write_model(d: Path, rows: int, *, real: int | None = None, tie: bool = True,
                shard: bool = False, resize_to: int | None = None,
                padding: float | None = None, dtype: torch.dtype | None = None,
                copy_last: bool = False) -> Path:
    """A 1-layer GPT-2 with `rows` vocab rows saved by save_pretrained, and, with `real`, a
    local tokenizer of `real` ids (3 of them added tokens) saved beside it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=rows, n_embd=8, n_layer=1, n_head=2, n_positions=8,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie)
    m = GPT2LMHeadModel(cfg)
    if resize_to is not None:
        m.resize_token_embeddings(resize_to, mean_resizing=False)
    if padding is not None and real is not None:  # what an uninitialised resize leaves
        with torch.no_grad():
            for w in {id(m.get_input_embeddings().weight): m.get_input_embeddings().weight,
                      id(m.get_output_embeddings().weight): m.get_output_embeddings().weight
                      }.values():
                w[real:] = padding
    if copy_last and real is not None:  # a converter padding for a new tensor-parallel size
        with torch.no_grad():
            for w in {id(p): p for p in (m.get_input_embeddings().weight,
                                         m.get_output_embeddings().weight)}.values():
                w[real:] = w[real - 1]
    if dtype is not None:
        m = m.to(dtype)
    m.save_pretrained(d, max_shard_size="5KB" if shard else "5GB")
    if real is not None:
        write_tokenizer(d, real)
    return d


def write_tokenizer(d: Path, real: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = real - 3
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(base)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.add_tokens(["<tool>", "<think>"])
    fast.add_special_tokens({"pad_token": "<pad>"})
    assert len(fast) == real
    fast.save_pretrained(d)


def write_safetensors(path: Path, header: bytes, *, length: int | None = None,
                      data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


# -- clean and flawed models -----------------------------------------------------------------


def test_aligned_tied_model_with_padding_rows(tmp_path: Path) -> None:
    # The seed's fix done right: 100 real ids, rows padded to 128, lm_head tied (not saved).
    a = audit_checkpoint(write_model(tmp_path, 100, real=100, resize_to=128))
    assert a.ok and a.config_vocab_size == 128
    assert (a.audit.real, a.audit.rows, a.audit.embedding_rows, a.audit.aligned) == \
        (100, 128, 128, 128)
    assert a.audit.tied and a.lm_head is None and a.tie_source == "no lm_head weight in the " \
        "checkpoint"
    assert a.embedding.name == "transformer.wte.weight" and a.embedding.shape == (128, 8)
    assert a.audit.aligned_for_tp == {1: True, 2: True, 4: False, 8: False}
    # 97 ids + 3 added tokens (the 4th added one, the unk t0, is one of the 97) = 100.
    assert a.real_source == "tokenizer.json (97 ids in the model + 3 added tokens not among them)"
    text = str(a)
    assert "verdict: ok" in text and "columns [100, 128) are padding" in text
    assert "transformer.wte.weight [128, 8] in model.safetensors" in text


def test_unaligned_rows_name_the_fix(tmp_path: Path) -> None:
    a = audit_checkpoint(write_model(tmp_path, 100, real=100))
    assert not a.ok
    assert a.audit.alignment_problems == ("head rows 100 are not a multiple of 64 (64 x "
                                          "tensor_parallel 1); next aligned size is 128",)
    assert "fix: build embedding and lm_head with 128 rows" in str(a)
    assert "resize_token_embeddings(100, pad_to_multiple_of=64)" in str(a)


def test_tokenizer_larger_than_the_rows(tmp_path: Path) -> None:
    a = audit_checkpoint(write_model(tmp_path, 128, real=130))
    assert not a.ok and a.audit.alignment_problems == ()
    assert a.audit.vocab_problems[0].startswith("real vocab 130 > head rows 128")


def test_untied_head_is_read_from_its_own_tensor(tmp_path: Path) -> None:
    a = audit_checkpoint(write_model(tmp_path, 128, real=100, tie=False))
    assert a.ok and not a.audit.tied
    assert a.lm_head is not None and (a.lm_head.name, a.lm_head.shape) == ("lm_head.weight",
                                                                           (128, 8))
    assert a.tie_source == "config.json tie_word_embeddings: false"
    assert "weights untied" in str(a)


def test_sharded_checkpoint_reads_only_the_shards_it_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = write_model(tmp_path, 128, real=100, tie=False, shard=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    read: list[str] = []
    real_reader = safetensors_shapes
    monkeypatch.setattr("guard.checkpoint_audit.safetensors_shapes",
                        lambda p: read.append(p.name) or real_reader(p))
    a = audit_checkpoint(d)
    assert a.ok and a.embedding.file == index["transformer.wte.weight"]
    assert a.lm_head is not None and a.lm_head.file == index["lm_head.weight"]
    assert sorted(read) == sorted({index["transformer.wte.weight"], index["lm_head.weight"]})
    assert len(set(index.values())) > len(read)  # the other shards were never opened


def test_tensor_parallel_and_pad_multiple(tmp_path: Path) -> None:
    d = write_model(tmp_path, 128, real=100)
    assert not audit_checkpoint(d, tensor_parallel=4).ok  # 128 rows cannot split 4 x 64
    assert audit_checkpoint(d, tensor_parallel=4, pad_multiple=32).ok
    assert audit_checkpoint(d, vocab_size=128).audit.real == 128


def test_config_disagreeing_with_the_weights(tmp_path: Path) -> None:
    d = write_model(tmp_path, 128, real=100)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "vocab_size": 50257,
                                               "tie_word_embeddings": False}))
    a = audit_checkpoint(d)
    assert not a.ok
    problems = " | ".join(a.audit.vocab_problems)
    assert "tie_word_embeddings: false but the checkpoint has no lm_head weight" in problems
    assert "config.json vocab_size 50257 != 128 rows of transformer.wte.weight" in problems


def test_no_tokenizer_assumes_rows(tmp_path: Path) -> None:
    a = audit_checkpoint(write_model(tmp_path, 128))
    assert a.ok and a.audit.real == 128
    assert a.real_source.startswith("no tokenizer files") and "--vocab-size" in a.real_source


# -- the readers -----------------------------------------------------------------------------


def test_header_agrees_with_the_safetensors_library(tmp_path: Path) -> None:
    from safetensors import safe_open

    d = write_model(tmp_path, 128, tie=False)
    shapes = safetensors_shapes(d / "model.safetensors")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert shapes == {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def test_only_the_header_is_read(tmp_path: Path) -> None:
    # A 1e9-row embedding declared in the header, no data behind it: the shapes still read.
    header = json.dumps({"__metadata__": {"format": "pt"}, "model.embed_tokens.weight":
                         {"dtype": "BF16", "shape": [10**9, 4096],
                          "data_offsets": [0, 2 * 4096 * 10**9]}}).encode()
    p = write_safetensors(tmp_path / "model.safetensors", header)
    assert safetensors_shapes(p) == {"model.embed_tokens.weight": (10**9, 4096)}


# -- the padding rows, read from the safetensors files -----------------------------------------


@pytest.mark.parametrize(("padding", "dtype", "seen"), [
    (1e6, None, r"the largest norm 2\.83e\+06 \(row 100\) is .*x the largest sampled real row's"),
    (float("nan"), None, r"224 non-finite values \(rows 100, 101, 102, 103, 104\)"),
    (1e6, torch.bfloat16, r"the largest norm 2\.83e\+06"),
    (float("inf"), torch.float16, r"224 non-finite values"),
])
def test_garbage_padding_rows_are_a_violation(tmp_path: Path, padding: float,
                                              dtype: torch.dtype | None, seen: str) -> None:
    a = audit_checkpoint(write_model(tmp_path, 100, real=100, resize_to=128, padding=padding,
                                     dtype=dtype))
    assert a.audit.ok and not a.ok  # the sizes are right, the rows are not
    (rows,) = a.padding_rows
    assert (rows.tensor, rows.start, rows.stop) == ("transformer.wte.weight", 100, 128)
    text = str(a)
    assert re.search(r"padding rows NOT OK: padding rows \[100, 128\) of "
                     r"transformer\.wte\.weight: " + seen, text), text
    assert "fix: overwrite them with the mean real row" in text
    assert "verdict: NOT OK (sizes ok, padding rows not)" in text and "verdict: ok" not in text
    assert a.to_dict()["padding_rows"][0]["ok"] is False


@pytest.mark.parametrize("tie", [True, False])
def test_padding_rows_that_copy_the_last_real_row_are_named(tmp_path: Path, tie: bool) -> None:
    """Issue 39 item 1: each ghost id would take exactly id 99's probability; the norms pass."""
    a = audit_checkpoint(write_model(tmp_path, 100, real=100, tie=tie, resize_to=128,
                                     copy_last=True))
    assert a.audit.ok and not a.ok
    assert [(r.copies, r.copied_row, r.max_norm <= r.reference * r.factor)
            for r in a.padding_rows] == [(28, 99, True)] * (1 if tie else 2)
    text = str(a)
    assert "padding rows NOT OK: padding rows [100, 128) of transformer.wte.weight: 28 are " \
           "bit copies of real row 99 (what a checkpoint converter padding for a new " \
           "tensor-parallel size leaves: each such ghost id takes exactly id 99's " \
           "probability)" in text, text
    assert a.to_dict()["padding_rows"][0]["copies"] == 28


def test_sharded_untied_rows_are_read_from_their_own_shards(tmp_path: Path) -> None:
    d = write_model(tmp_path, 100, real=100, tie=False, shard=True, resize_to=128,
                    padding=float("nan"))
    a = audit_checkpoint(d)
    assert [(r.tensor, r.nonfinite) for r in a.padding_rows] == [
        ("transformer.wte.weight", 224), ("lm_head.weight", 224)]
    assert not a.ok


def test_the_rows_are_read_once_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = write_model(tmp_path, 8160, real=8160, resize_to=8192)  # 8192 x 8 float32: 256 KiB
    read = {"bytes": 0}
    real_open = Path.open

    def counting_open(self: Path, *args: object, **kwargs: object) -> object:
        f = real_open(self, *args, **kwargs)  # type: ignore[call-overload]
        if self.suffix != ".safetensors":
            return f
        original = f.read

        def read_counted(n: int = -1) -> bytes:
            data: bytes = original(n)
            read["bytes"] += len(data)
            return data

        f.read = read_counted
        return f

    monkeypatch.setattr(Path, "open", counting_open)
    a = audit_checkpoint(d)
    assert a.ok and a.padding_rows[0].stop == 8192
    # Each real row once (untrained_rows), the 32 padding rows and 64 sampled real rows (32
    # bytes each) and the headers: one pass, not a tensor loaded per question.
    assert read["bytes"] < (8160 + 32 + 64) * 32 + 20_000 < 2 * 8192 * 32


# -- unreadable input ------------------------------------------------------------------------


def test_missing_config(tmp_path: Path) -> None:
    d = write_model(tmp_path, 128)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: missing; expected the model's "
                       r"config.json") as e:
        audit_checkpoint(d)
    assert e.value.path == str(d / "config.json")


def test_garbage_config_json(tmp_path: Path) -> None:
    d = write_model(tmp_path, 128)
    (d / "config.json").write_text("{vocab_size: 128,")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        audit_checkpoint(d)


@pytest.mark.parametrize(("blob", "expected"), [
    (b"\x10\x00", "2 bytes; expected a safetensors file starting with an 8-byte"),
    (struct.pack("<Q", 10_000) + b'{"a": 1', "header length 10000 does not fit in the 15-byte "
     "file; expected a complete safetensors file"),
    (struct.pack("<Q", 7) + b"garbage", "the safetensors header is not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "the safetensors header is not a JSON object"),
    (struct.pack("<Q", 23) + b'{"w": {"shape": "big"}}', "tensor 'w' has no valid shape"),
])
def test_broken_safetensors(tmp_path: Path, blob: bytes, expected: str) -> None:
    d = write_model(tmp_path, 128)
    (d / "model.safetensors").write_bytes(blob)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: ") as e:
        audit_checkpoint(d)
    assert expected in str(e.value)


def test_sharded_index_pointing_at_a_missing_or_truncated_shard(tmp_path: Path) -> None:
    d = write_model(tmp_path, 128, shard=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = d / index["transformer.wte.weight"]
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="does not fit"):
        audit_checkpoint(d)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: cannot read"):
        audit_checkpoint(d)


def test_no_safetensors_or_no_embedding(tmp_path: Path) -> None:
    d = write_model(tmp_path, 128)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors"
                       r"\.index\.json; found pytorch_model\.bin"):
        audit_checkpoint(d)
    write_safetensors(d / "model.safetensors",
                      json.dumps({"encoder.w": {"shape": [4, 4]}}).encode())
    with pytest.raises(CheckpointError, match="no token embedding tensor"):
        audit_checkpoint(d)


def test_a_missing_path_and_a_file_are_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope: does not exist; expected a Hugging Face"):
        audit_checkpoint(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match=r"f: not a directory; expected a Hugging Face"):
        audit_checkpoint(tmp_path / "f")
