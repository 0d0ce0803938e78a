"""Megatron-core's vocab-parallel layers, known by their own attributes (megatron is never
imported): `VocabParallelEmbedding` (`vocab_start_index`, `vocab_end_index`, `num_embeddings`,
`tp_group`) and `ColumnParallelLinear` (`output_size`, `output_size_per_partition`,
`tp_group`), whose forward returns `(output, bias)`."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["columns_of", "group_rank", "is_column_parallel", "is_vocab_parallel_embedding",
           "out_features", "rows_of"]


def _int(m: object, name: str) -> int:
    """An int attribute the checks below found (megatron's layers are not typed here)."""
    return int(getattr(m, name))


def is_vocab_parallel_embedding(m: object) -> bool:
    return isinstance(m, nn.Module) and all(
        isinstance(getattr(m, a, None), int) for a in
        ("vocab_start_index", "vocab_end_index", "num_embeddings"))


def is_column_parallel(m: object) -> bool:
    return isinstance(m, nn.Module) and all(
        isinstance(getattr(m, a, None), int) for a in
        ("output_size", "output_size_per_partition", "input_size"))


def out_features(m: nn.Module) -> int | None:
    """The outputs of a Linear, or of the whole of a ColumnParallelLinear."""
    if is_column_parallel(m):
        return _int(m, "output_size")
    n = getattr(m, "out_features", None)
    return n if isinstance(n, int) else None


def rows_of(m: nn.Module) -> int | None:
    """Rows of the whole vocab of a Megatron vocab-parallel layer (its weight holds a shard)."""
    if is_vocab_parallel_embedding(m):
        return _int(m, "num_embeddings")
    if is_column_parallel(m):
        return _int(m, "output_size")
    return None


def group_rank(group: Any) -> tuple[int, int]:
    """(rank in, size of) a process group; (0, 1) for None (no torch.distributed)."""
    if group is None:
        return 0, 1
    return int(group.rank()), int(group.size())


def columns_of(m: nn.Module) -> tuple[int, int, Any] | None:
    """(start, end, tp group) of the global ids a Megatron layer's local rows hold."""
    group = getattr(m, "tp_group", None)
    if is_vocab_parallel_embedding(m):
        return _int(m, "vocab_start_index"), _int(m, "vocab_end_index"), group
    if is_column_parallel(m):
        rank, _ = group_rank(group)
        width = _int(m, "output_size_per_partition")
        return rank * width, (rank + 1) * width, group
    return None
