"""Which global rows a DTensor's placements give a rank (guard/vocab/parallel.py), worked out
as DTensor itself splits them, on torch's own placement objects; and the tensor-parallel mesh
dims among them, with and without FSDP2."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from guard.vocab.parallel import held_rows, on_rows, tp_dims


@pytest.mark.parametrize(("coordinate", "rows"), [(0, [0, 1, 2]), (1, [3, 4, 5]),
                                                   (2, [6, 7, 8]), (3, [9])])
def test_shard_0_splits_rows_as_torch_chunk_does(coordinate: int, rows: list[int]) -> None:
    assert held_rows(10, (Shard(0),), (4,), (coordinate,), (0,)).tolist() == rows


def test_fsdp2_over_tensor_parallel_holds_one_block_per_rank() -> None:
    # torchtitan's 2-D layout: mesh (dp 2, tp 2), rank (d, t) holds part d of TP shard t.
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    held = {(d, t): held_rows(16, placements, (2, 2), (d, t), (0, 1)).tolist()
            for d in (0, 1) for t in (0, 1)}
    assert held == {(0, 0): [0, 1, 2, 3], (1, 0): [4, 5, 6, 7],
                    (0, 1): [8, 9, 10, 11], (1, 1): [12, 13, 14, 15]}
    # The columns of the head in forward (FSDP2 gathers over dp): tensor parallel's shard.
    assert held_rows(16, placements, (2, 2), (1, 1), (1,)).tolist() == list(range(8, 16))


def test_a_strided_shard_alone_is_no_block() -> None:
    rows = held_rows(8, (_StridedShard(0, split_factor=2),), (2,), (0,), (0,)).tolist()
    assert rows == [0, 1, 4, 5]


def test_the_tensor_parallel_dims() -> None:
    assert [on_rows(p) for p in (Shard(0), Shard(1), Replicate(),
                                 _StridedShard(0, split_factor=2))] == [True, False, False, True]
    assert tp_dims((Shard(0),), fsdp=False) == (0,)  # parallelize_module alone
    assert tp_dims((Shard(0),), fsdp=True) == ()  # fully_shard alone: gathered in forward
    assert tp_dims((Replicate(), Shard(0)), fsdp=True) == ()  # HSDP
    assert tp_dims((_StridedShard(0, split_factor=2), Shard(0)), fsdp=True) == (1,)
    assert tp_dims((Replicate(), _StridedShard(0, split_factor=4), Shard(0)),
                   fsdp=True) == (2,)  # HSDP over tensor parallel
    assert tp_dims((Shard(1),), fsdp=False) == ()  # RowwiseParallel on a head: whole logits
