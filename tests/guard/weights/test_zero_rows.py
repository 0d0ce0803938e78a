"""Rows of a ZeRO-3 weight from its partitions (guard/weights/zero_rows.py): each rank holds a
contiguous slice of the flattened weight, so a row may straddle two ranks. Here three slices of
one weight, laid out as DeepSpeed lays them (`ds_tensor` elements [r * n, r * n + n), the last
padded), are read one by one as each rank would, and what the ranks' all-reduce would add up
is added here: it equals the whole weight's figures. Two real ranks under DeepSpeed:
tests/integrations/test_deepspeed.py."""

from __future__ import annotations

import torch
from torch import nn

from guard.weights.zero_rows import ZeroRows, unreadable

ROWS, D, RANKS = 10, 7, 3


def slices(w: torch.Tensor) -> list[ZeroRows]:
    """One ZeroRows per rank of a (ROWS, D) weight partitioned over RANKS."""
    n = -(-w.numel() // RANKS)
    flat = torch.cat([w.reshape(-1), w.new_zeros(n * RANKS - w.numel())])
    out = []
    for r in range(RANKS):
        p = nn.Parameter(torch.empty(0))
        p.ds_id, p.ds_shape = 0, torch.Size([ROWS, D])  # type: ignore[attr-defined]
        p.ds_tensor = flat[r * n : (r + 1) * n].clone()  # type: ignore[attr-defined]
        p.ds_tensor.ds_numel = n  # type: ignore[attr-defined]
        rows = ZeroRows(p)
        rows.start = r * n  # this rank's (one process here: dist is not initialised)
        rows.valid = max(0, min(n, w.numel() - rows.start))
        out.append(rows)
    return out


def test_the_slices_straddle_rows_and_their_sums_are_the_whole_weights() -> None:
    torch.manual_seed(0)
    w = torch.randn(ROWS, D)
    w[8, 3] = float("nan")
    parts = slices(w)
    assert any(p.start % D for p in parts)  # a row split between two ranks
    squares = sum(p.row_squares(6, ROWS)[0] for p in parts)
    bad = sum(p.row_squares(6, ROWS)[1] for p in parts)
    assert isinstance(squares, torch.Tensor) and isinstance(bad, torch.Tensor)
    expect = w[6:].double().square().sum(dim=1)
    assert torch.allclose(squares[[0, 1, 3]], expect[[0, 1, 3]]) and squares[2].isnan()
    assert bad.tolist() == [0, 0, 1, 0]
    keep = torch.ones(ROWS, dtype=torch.bool)
    keep[2] = False
    total = sum(p.mean_below(6, keep) * keep[:6].sum() for p in parts)
    assert torch.allclose(torch.as_tensor(total), w[:6][keep[:6]].sum(dim=0), atol=1e-5)


def test_a_fill_writes_each_ranks_elements_of_the_rows() -> None:
    w = torch.randn(ROWS, D)
    parts = slices(w)
    value = torch.arange(D, dtype=torch.float32)
    for p in parts:
        p.fill(4, 6, value, torch.tensor(True))
        p.fill(7, 8, value, torch.tensor(False))  # a device select: left as it was
    whole = torch.cat([p.local() for p in parts]).view(ROWS, D)
    assert torch.equal(whole[4:6], value.expand(2, D))
    assert torch.equal(whole[:4], w[:4]) and torch.equal(whole[6:], w[6:])


def test_blocks_assemble_the_rows_a_rank_holds() -> None:
    w = torch.randn(ROWS, D)
    blocks = [dict(p.blocks(ROWS)) for p in slices(w)]
    assert torch.equal(sum(b[0] for b in blocks), w)  # type: ignore[arg-type]


def test_a_partition_on_disk_cannot_be_read() -> None:
    p = nn.Parameter(torch.empty(0))
    assert unreadable(p) is None  # no ZeRO-3 weight: read as it is
    p.ds_id, p.ds_tensor = 0, torch.empty(0)  # type: ignore[attr-defined]
    p.ds_tensor.final_location = "nvme"  # type: ignore[attr-defined]
    assert unreadable(p) == "its partition is offloaded (final_location nvme, status AVAILABLE)"
