"""The rows' checksums of the tie check across pipeline stages (guard/device/checksums.py):
equal copies agree, and one changed bit, two swapped values or two swapped rows do not, in
the block and the row where they sit."""

from __future__ import annotations

import pytest
import torch

from guard.device.checksums import BLOCKS, PRIME, block_checksums, block_of, row_checksums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_changed_bit_shows_in_its_block_and_its_row(dtype: torch.dtype) -> None:
    w = torch.randn(1024, 16).to(dtype)
    copy = w.clone()
    assert torch.equal(block_checksums(w), block_checksums(copy))
    bits = copy.view(torch.int16 if dtype != torch.float32 else torch.int32)
    bits[700, 3] ^= 1  # the lowest bit of one value
    blocks = (block_checksums(w) != block_checksums(copy)).nonzero().flatten().tolist()
    assert blocks == [int(block_of(1024)[700])]
    rows = (row_checksums(w) != row_checksums(copy)).nonzero().flatten().tolist()
    assert rows == [700]
    assert int(block_checksums(w).min()) >= 0 and int(block_checksums(w).max()) < PRIME


def test_swapped_values_and_swapped_rows_show() -> None:
    w = torch.randn(64, 8)
    values = w.clone()
    values[5, [1, 2]] = values[5, [2, 1]]
    rows = w.clone()
    rows[[3, 4]] = rows[[4, 3]]
    for other in (values, rows):
        assert not torch.equal(block_checksums(w), block_checksums(other))
    # The same rows at other ids (a shard's offset) are other checksums.
    assert not torch.equal(row_checksums(w, 0), row_checksums(w, 64))
    assert block_checksums(w).shape == (BLOCKS,)
