"""`guard audit`'s untrained rows, read from safetensors files in pure Python: the same rules,
thresholds and ids as guard.attach's on the device, for every dtype it reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from guard.checkpoint.safetensors_untrained import untrained_stats
from guard.policy import UntrainedRowsCheck
from guard.weights.features import classify, row_features
from guard.weights.sharded import RowShard

RULES = UntrainedRowsCheck()
ZERO_ROWS, TINY_ROWS, SMALL_ROWS, TWIN_ROWS = [3, 9], [4], [12], [20, 30, 31]


def weight(dtype: torch.dtype, rows: int = 40, d: int = 16) -> torch.Tensor:
    """A normal init with every kind of untrained row, and a non-finite one that is none."""
    torch.manual_seed(0)
    w = torch.randn(rows, d) * 0.02
    w[ZERO_ROWS] = 0.0
    w[TINY_ROWS] = 1e-23 if dtype != torch.float16 else 0.0  # float16 has no 1e-23
    w[SMALL_ROWS] = w[SMALL_ROWS] * 1e-5  # a never-seen row weight decay shrank
    w[TWIN_ROWS] = torch.randn(d) * 0.02  # one placeholder vector, three times
    w[25, 1] = float("nan")  # padding_rows' business (and nonfinite's), not this check's
    return w.to(dtype)


def saved(tmp_path: Path, w: torch.Tensor) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"embed.weight": w}, str(path))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_each_rule_finds_its_rows_and_attach_finds_the_same(tmp_path: Path,
                                                             dtype: torch.dtype) -> None:
    w = weight(dtype)
    stats = untrained_stats(saved(tmp_path, w), "embed.weight", 36, RULES)
    assert stats is not None and not stats.ok
    assert {k: v for k, v in stats.to_dict().items() if k in ("near_zero", "small_norm",
                                                            "identical")} == {
        "near_zero": sorted(ZERO_ROWS + TINY_ROWS), "small_norm": SMALL_ROWS,
        "identical": TWIN_ROWS}
    # The device's rules on the same rows: the same ids and reasons.
    why, reference = classify(*row_features(RowShard.of(w, "embed.weight"), 36),
                              epsilon=RULES.epsilon, norm_ratio=RULES.norm_ratio,
                              duplicates=RULES.duplicates)
    ids = why.nonzero().flatten().tolist()
    assert (tuple(ids), tuple(why[ids].tolist())) == (stats.ids, stats.why)
    assert stats.reference == pytest.approx(reference.item(), rel=1e-6)


def test_rows_outside_the_real_vocab_and_exempt_rows_are_not_read_as_untrained(
        tmp_path: Path) -> None:
    path = saved(tmp_path, weight(torch.float32))
    stats = untrained_stats(path, "embed.weight", 10, RULES, exempt=(3,))
    assert stats is not None and stats.ids == (4, 9)  # the twins lie past real; 3 exempt
    assert stats.describe() == ("rows [0, 10) of embed.weight: 2 untrained, ids 4, 9 (2 near "
                                "zero (every |value| <= 1e-16))")


def test_a_healthy_tensor_is_ok_and_an_unread_dtype_is_none(tmp_path: Path) -> None:
    torch.manual_seed(0)
    stats = untrained_stats(saved(tmp_path, torch.randn(64, 8) * 0.02), "embed.weight", 64,
                            RULES)
    assert stats is not None and stats.ok and stats.describe() == (
        "rows [0, 64) of embed.weight: none untrained")
    path = tmp_path / "i.safetensors"
    save_file({"embed.weight": torch.zeros(4, 4, dtype=torch.int32)}, str(path))
    assert untrained_stats(path, "embed.weight", 4, RULES) is None
