"""Checkpoints crafted by whoever publishes them (issue 32), audited in a child process: each a
one-line error naming the file (exit 2, and with --json one JSON error object) or a documented
refusal, within a bound of memory (BOUND_MIB) and a hang guard, never a traceback. Classes:
1 tracebacks, 2 a header never checked against itself, 3 memory and time trusted to the
header, 4 files that are not files, 5 the sentencepiece reader, 6 output that lies."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.guard.checkpoint.hostile import (
    BOUND_MIB,
    EMBEDDING,
    audit,
    audit_json,
    checkpoint,
    entry,
    raw_safetensors,
)

CLEAN = "  verdict: ok"


def test_the_valid_checkpoint_they_start_from_is_clean(tmp_path: Path) -> None:
    run = audit(checkpoint(tmp_path / "m"))
    assert run.code == 0 and CLEAN in run.out.splitlines(), run.out
    assert run.peak_mib < BOUND_MIB


# -- 1. what raised a traceback --------------------------------------------------------------


@pytest.mark.parametrize(("text", "says"), [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deep to read)"),
    ('{"vocab_size": ' + "9" * 5000 + "}", "not valid JSON (an integer of more than"),
])
def test_json_too_deep_or_too_long_for_the_parser(tmp_path: Path, text: str, says: str) -> None:
    d = checkpoint(tmp_path / "m")
    (d / "config.json").write_text(text)
    audit(d).refused(d / "config.json", says)
    run, data = audit_json(d)
    assert run.code == 2 and data["error"]["file"] == str(d / "config.json")


@pytest.mark.parametrize("offsets", [[], ["x", 4096], [None, 1], [10**30, 1], [0.0, 32.0]])
def test_offsets_that_are_not_two_byte_offsets(tmp_path: Path, offsets: object) -> None:
    d = checkpoint(tmp_path / "m")
    raw_safetensors(d / "model.safetensors", {EMBEDDING: entry([128, 8], offsets)}, b"\0" * 4096)
    audit(d).refused(d / "model.safetensors", f"tensor '{EMBEDDING}': data_offsets")


@pytest.mark.parametrize("shape", [[True, 8], [1e8, 8], [-1, 8], "big"])
def test_shapes_that_are_not_shapes(tmp_path: Path, shape: object) -> None:
    d = checkpoint(tmp_path / "m")
    raw_safetensors(d / "model.safetensors", {EMBEDDING: entry(shape, [0, 4096])}, b"\0" * 4096)
    audit(d).refused(d / "model.safetensors", f"tensor '{EMBEDDING}' has no valid shape")


def test_a_weight_map_file_name_with_a_nul_byte(tmp_path: Path) -> None:
    d = checkpoint(tmp_path / "m")
    index = {"weight_map": {EMBEDDING: "model-0\u0000.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    audit(d).refused(d / "model.safetensors.index.json", f"weight_map['{EMBEDDING}'] is "
                     "'model-0\\x00.safetensors'; expected a file name")


@pytest.mark.parametrize(("file", "text", "says"), [
    ("tokenizer_config.json", {"added_tokens_decoder": {"²": {"content": "x"}}},
     "added_tokens_decoder key '²' is not a token id"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"9" * 5000: {"content": "x"}}},
     "added_tokens_decoder key '9999"),  # issue 41: int() refuses 5,000 digits
    ("vocab.json", {"a": [1]}, "token 'a' has id [1]; expected an id in [0, 2**32)"),
    ("vocab.json", {"a": True}, "token 'a' has id True"),
])
def test_tokenizer_keys_and_ids_that_are_not_ids(tmp_path: Path, file: str, text: object,
                                                  says: str) -> None:
    d = checkpoint(tmp_path / "m")
    if file == "vocab.json":
        (d / "tokenizer.json").unlink()
    (d / file).write_text(json.dumps(text))
    audit(d).refused(d / file, says)


def test_a_tokenizer_json_whose_vocab_values_are_lists(tmp_path: Path) -> None:
    d = checkpoint(tmp_path / "m")
    doc = json.loads((d / "tokenizer.json").read_text())
    doc["model"]["vocab"]["t5"] = [5]
    (d / "tokenizer.json").write_text(json.dumps(doc))
    audit(d).refused(d / "tokenizer.json", "not a tokenizer the tokenizers library reads")


def test_a_name_the_terminal_cannot_encode_is_escaped(tmp_path: Path) -> None:
    d = checkpoint(tmp_path / "m", name="modèle.embed_tokens.weight")
    run = audit(d, env={"PYTHONIOENCODING": "ascii"})
    assert run.code == 0 and "mod\\xe8le.embed_tokens.weight [128, 8]" in run.out, run.err


# -- 2. a header never checked against itself ------------------------------------------------


F32 = {"dtype": "F32", "shape": [2, 2]}


@pytest.mark.parametrize(("header", "data", "says"), [
    ({EMBEDDING: {**F32, "data_offsets": [16, 0]}}, 16, "invalid offset"),
    ({EMBEDDING: {**F32, "data_offsets": [0, 16]}}, 8, "the header's tensors end at byte"),
    ({EMBEDDING: {**F32, "data_offsets": [0, 16]}, "b": {**F32, "data_offsets": [0, 16]}}, 16,
     "invalid offset"),
    ({EMBEDDING: {**F32, "data_offsets": [0, 12]}}, 12, "invalid shape, data type, or offset"),
    ({EMBEDDING: {**F32, "dtype": "Q7", "data_offsets": [0, 16]}}, 16, "unknown variant `Q7`"),
    ({EMBEDDING: {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, 16,
     "overflow"),
])
def test_headers_the_safetensors_library_refuses(tmp_path: Path, header: dict[str, object],
                                                  data: int, says: str) -> None:
    d = checkpoint(tmp_path / "m", rows=2, cols=2, real=2)
    raw_safetensors(d / "model.safetensors", header, b"\0" * data)
    audit(d).refused(d / "model.safetensors", says)


# -- 3. memory and time trusted to the header ------------------------------------------------


def test_a_header_of_millions_of_tensors_is_refused_unread(tmp_path: Path) -> None:
    # 95 MB of header (1.55 M tensors took 11 s and 660 MiB): refused by its length alone.
    d = checkpoint(tmp_path / "m")
    with (d / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", 95_000_000) + b'{"')
        f.truncate(8 + 95_000_000)  # sparse: nothing written but the length
    run = audit(d)
    run.refused(d / "model.safetensors", "a header of 95000000 bytes, over the 16777216-byte "
                "bound (GUARD_CHECKPOINT_MAX_HEADER_BYTES)")


def test_many_padding_rows_are_read_a_block_at_a_time(tmp_path: Path) -> None:
    # 100,000 x 256 float32 (98 MiB) for a 100-id tokenizer: every padding row used to be held
    # as Python floats (over 1 GiB); a block of rows at a time holds a few MiB.
    d = checkpoint(tmp_path / "m", rows=100_000, cols=256)
    run, data = audit_json(d)
    assert run.code == 1 and data["padding_rows"][0]["rows"] == [100, 100_000], run.err
    assert run.peak_mib < BOUND_MIB + 100, run.peak_mib  # the file's pages are mapped once


def test_rows_wider_than_the_bound_are_refused(tmp_path: Path) -> None:
    d = checkpoint(tmp_path / "m", rows=128, cols=8)
    run = audit(d, env={"GUARD_CHECKPOINT_MAX_ROW_BYTES": "16"})
    run.refused(d / "model.safetensors", "are 32 bytes, over the 16-byte bound "
                "(GUARD_CHECKPOINT_MAX_ROW_BYTES); not read")
    audit(d, env={"GUARD_CHECKPOINT_MAX_ROW_BYTES": "lots"}).refused(
        "GUARD_CHECKPOINT_MAX_ROW_BYTES", "expected a positive number of bytes, got 'lots'")


# -- 4. files that are not files -------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors",
                                  "tokenizer_config.json"])
def test_a_link_to_dev_zero(tmp_path: Path, name: str) -> None:
    d = checkpoint(tmp_path / "m")
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to("/dev/zero")
    audit(d).refused(d / name, "a character device, not a regular file")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_never_blocks(tmp_path: Path, name: str) -> None:
    d = checkpoint(tmp_path / "m")
    (d / name).unlink()
    os.mkfifo(d / name)
    audit(d).refused(d / name, "a named pipe (FIFO), not a regular file")


def test_a_weight_map_entry_that_is_a_fifo(tmp_path: Path) -> None:
    d = checkpoint(tmp_path / "m")
    (d / "model.safetensors").rename(d / "shard.safetensors")
    os.mkfifo(d / "model.safetensors")  # never opened: the index says where the tensors are
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {EMBEDDING: "pipe.safetensors"}}))
    os.mkfifo(d / "pipe.safetensors")
    audit(d).refused(d / "pipe.safetensors", "a named pipe (FIFO)")


# -- 5. the sentencepiece reader -------------------------------------------------------------


@pytest.mark.parametrize(("blob", "says"), [
    (b"\xff" * 1_000_000, "a varint longer than 10 bytes at byte 0"),
    (b"\x0a\x64\x0a\x03abc", "field 1 at byte 0 runs past the end of the 7-byte file"),
    (b"\x0a", "a varint cut short at byte 1"),
    (b"\x0b\x00", "field 1 of wire type 3 at byte 0"),
])
def test_sentencepiece_models_that_are_not(tmp_path: Path, blob: bytes, says: str) -> None:
    d = checkpoint(tmp_path / "m")
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.model").write_bytes(blob)
    audit(d).refused(d / "tokenizer.model", says)


# -- 6. output that lies ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["x\n  verdict: ok\n.embed_tokens.weight",
                                  "\x1b[2J\x1b]0;owned\x07.embed_tokens.weight"])
def test_names_are_printed_escaped(tmp_path: Path, name: str) -> None:
    d = checkpoint(tmp_path / "m", rows=100, name=name)  # unaligned: NOT OK
    run = audit(d)
    assert run.code == 1 and CLEAN not in run.out.splitlines(), run.out
    assert "\x1b" not in run.out and "\x1b" not in run.err
    assert repr(name)[1:-1] in run.out
    run, data = audit_json(d)
    assert data["embedding"]["name"] == name  # the JSON carries it as it is, escaped by JSON


@pytest.mark.parametrize(("file", "text", "says"), [
    ("vocab.json", {"a": 0, "b": -5}, "token 'b' has id -5"),
    ("added_tokens.json", {"<x>": -1}, "token '<x>' has id -1"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"-1": {"content": "x"}}},
     "added_tokens_decoder key '-1' is not a token id"),
])
def test_negative_ids_are_blamed_on_their_file(tmp_path: Path, file: str, text: object,
                                               says: str) -> None:
    d = checkpoint(tmp_path / "m")
    (d / "tokenizer.json").unlink()
    (d / "vocab.json").write_text(json.dumps({"a": 0}))
    (d / file).write_text(json.dumps(text))
    audit(d).refused(d / file, says)


@pytest.mark.parametrize("where", ["../outside/shard.safetensors", "ABSOLUTE"])
def test_weight_map_paths_outside_the_directory_say_what_was_read(tmp_path: Path,
                                                                  where: str) -> None:
    d = checkpoint(tmp_path / "m")
    (tmp_path / "outside").mkdir()
    shard = (d / "model.safetensors").rename(tmp_path / "outside" / "shard.safetensors")
    file = str(shard) if where == "ABSOLUTE" else where
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {EMBEDDING: file}}))
    run = audit(d)
    assert run.code == 0, run.err
    assert f"in {file} (outside the checkpoint directory: read {shard})" in run.out
    run, data = audit_json(d)
    assert data["embedding"]["outside"] == str(shard) and data["embedding"]["file"] == file


_ATTACH = """\
import logging, os, sys, types
import guard
from tests.conftest import policy, tiny_gpt
warnings = []
logging.getLogger("guard").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, record: warnings.append(record.getMessage())})())
m = tiny_gpt()
m.config = types.SimpleNamespace(_name_or_path=sys.argv[1])
with guard.attach(m, policy=policy()) as g:
    print(g.real, g.rows)
print(sum("cannot read the tokenizer files" in w for w in warnings))
print(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


@pytest.mark.parametrize("make", ["zero", "fifo", "negative"])
def test_attach_warns_and_goes_on_without_the_checkpoints_tokenizer(tmp_path: Path,
                                                                      make: str) -> None:
    import subprocess
    import sys

    from tests.guard.checkpoint.hostile import HANG_S

    d = tmp_path / "m"
    d.mkdir()
    if make == "zero":  # grew by 795 MiB, then MemoryError
        (d / "tokenizer.json").symlink_to("/dev/zero")
    elif make == "fifo":  # blocked for ever
        os.mkfifo(d / "tokenizer.json")
    else:  # a RuntimeError from torch.zeros
        (d / "vocab.json").write_text(json.dumps({"a": -100}))
    done = subprocess.run([sys.executable, "-c", _ATTACH, str(d)], capture_output=True,
                          text=True, timeout=HANG_S, check=True)
    sizes, warned, peak_kib = done.stdout.split("\n")[:3]
    assert sizes == "128 128" and warned == "1"  # every row taken as real, and said
    assert int(peak_kib) / 1024 < 1024  # torch's own ~400 MiB; /dev/zero read whole: no end


def test_a_header_at_its_bound_is_read_within_memory_that_follows_the_bound(
        tmp_path: Path) -> None:
    # 25,000 tiny tensors beside the embedding, a 2 MB header under a 2 MiB bound: read (the
    # library's check and the JSON, one after the other), in memory of ~15x the header.
    import numpy as np

    d = checkpoint(tmp_path / "m")
    w = np.random.default_rng(0).normal(0, 0.02, (128, 8)).astype(np.float32).tobytes()
    header: dict[str, object] = {EMBEDDING: entry([128, 8], [0, len(w)])}
    header |= {f"t{i}": entry([1], [len(w) + i, len(w) + i + 1], "U8") for i in range(25_000)}
    raw_safetensors(d / "model.safetensors", header, w + b"\0" * 25_000)
    assert (d / "model.safetensors").stat().st_size < 2 << 20
    run = audit(d, env={"GUARD_CHECKPOINT_MAX_HEADER_BYTES": str(2 << 20)})
    assert run.code == 0, run.err
    assert run.peak_mib < BOUND_MIB


def test_whatever_goes_wrong_is_one_line_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # The last guard of the CLI: an error no reader foresaw is still one line (and with
    # --json, the error object), never a traceback.
    from guard.cli import main

    def broken(*args: object, **kwargs: object) -> None:
        raise RecursionError("maximum recursion depth exceeded\n  File forged")

    monkeypatch.setattr("guard.checkpoint_audit.audit_checkpoint", broken)
    assert main(["audit", str(tmp_path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["file"] == str(tmp_path)
    assert err.count("\n") == 1 and "unexpected RecursionError" in err and "\\n" in err
