"""Megatron-core's vocab-parallel layers, known by their own attributes (megatron is never
imported): `VocabParallelEmbedding` (`vocab_start_index`, `vocab_end_index`, `num_embeddings`,
`tp_group`) and `ColumnParallelLinear` (`output_size`, `output_size_per_partition`,
`tp_group`), whose forward returns `(output, bias)`."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["columns_of", "group_rank", "is_column_parallel", "is_vocab_parallel_embedding",
           "out_features", "rows_of"]


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
        return int(getattr(m, "output_size"))  # noqa: B009 - typed by the check above
    n = getattr(m, "out_features", None)
    return n if isinstance(n, int) else None


def rows_of(m: nn.Module) -> int | None:
    """Rows of the whole vocab of a Megatron vocab-parallel layer (its weight holds a shard)."""
    if is_vocab_parallel_embedding(m):
        return int(getattr(m, "num_embeddings"))  # noqa: B009
    if is_column_parallel(m):
        return int(getattr(m, "output_size"))  # noqa: B009
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
        return int(m.vocab_start_index), int(m.vocab_end_index), group
    if is_column_parallel(m):
        rank, _ = group_rank(group)
        width = int(getattr(m, "output_size_per_partition"))  # noqa: B009
        return rank * width, (rank + 1) * width, group
    return None
