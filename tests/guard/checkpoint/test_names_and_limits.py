"""Discovery and the audit look for the output head under one table of names; the checkpoint
read limits come from the environment once a process."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import guard.checkpoint_audit as checkpoint
from guard.checkpoint_audit import audit_checkpoint
from guard.vocab import discover, names
from tests.guard.checkpoint.test_checkpoint import write_model


def test_discovery_and_the_audit_share_one_table() -> None:
    assert discover.HEAD_NAMES is names.HEAD_NAMES and checkpoint.HEAD_NAMES is names.HEAD_NAMES
    assert set(names.NESTED_HEADS) <= set(names.HEAD_NAMES)


@pytest.mark.parametrize("head", ["head", "output_layer", "output"])
def test_the_audit_finds_a_top_level_head_under_any_of_the_names(tmp_path: Path,
                                                                   head: str) -> None:
    d = write_model(tmp_path, 128, real=100, tie=False)
    tensors = load_file(d / "model.safetensors")
    tensors[f"{head}.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    a = audit_checkpoint(d)
    assert a.lm_head is not None and (a.lm_head.name, a.lm_head.shape) == (f"{head}.weight",
                                                                           (128, 8))


def test_the_read_limits_are_read_from_the_environment_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.checkpoint.read_limits import limits

    limits.cache_clear()
    try:
        monkeypatch.setenv("GUARD_CHECKPOINT_MAX_ROW_BYTES", "16")
        first = limits()
        monkeypatch.setenv("GUARD_CHECKPOINT_MAX_ROW_BYTES", "32")
        assert limits() is first and first.row_bytes == 16
    finally:
        limits.cache_clear()
