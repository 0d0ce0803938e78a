"""The rows of a weight this rank holds, whatever holds them: one interface, `Rows`, made by
one factory, `rows_of`. Callers read and write rows through it and never ask the layout; the
layout is asked here once (`holding_of`), by the factory and by the master copies."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal, Protocol

import torch

from guard.tensors import dtensor_of
from guard.weights.sharded import RowShard
from guard.weights.zero_rows import ZeroRows, is_partitioned

__all__ = ["Holding", "Rows", "holding_of", "rows_of"]

# zero3: DeepSpeed ZeRO-3's partitions (`ds_id`); zero12: ZeRO-1/2, the weight whole and an
# fp32 fragment beside it (`_hp_mapping`); dtensor: FSDP2 or tensor parallel; plain: the rest.
Holding = Literal["zero3", "zero12", "dtensor", "plain"]


def holding_of(weight: object) -> Holding:
    """How `weight`'s rows are held, as it is now (DeepSpeed's attributes, torch's DTensor;
    neither library is imported here)."""
    if is_partitioned(weight):
        return "zero3"
    if hasattr(weight, "_hp_mapping"):
        return "zero12"
    return "dtensor" if dtensor_of(weight) is not None else "plain"


class Rows(Protocol):
    """The rows of a (rows, d) weight (a bias: (rows,)) that this rank holds, read and written
    in place. Every method marked a collective is called by every rank of the weight's group,
    in the same order (the states' table order)."""

    def local(self) -> torch.Tensor:
        """The storage this rank holds (writes to it are in place)."""
        ...

    def blocks(self, end: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, (b, d) rows) of rows [0, end) as this rank sees them, a block at a time."""
        ...

    def whole(self, t: torch.Tensor) -> None:
        """`t`, per row and filled from `blocks`, made the same on every rank (a collective
        where the blocks were the rank's own rows)."""
        ...

    def norm_from(self, first: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The largest norm and the non-finite count of rows [first, rows); None: none here."""
        ...

    def mean_below(self, end: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Float32: the mean of rows [0, end) (of those `keep` marks); a collective."""
        ...

    def largest_norm_below(self, end: int) -> torch.Tensor:
        """0-dim float32: the largest norm of rows [0, end); a collective."""
        ...

    def fill(self, first: int, end: int, value: torch.Tensor,
             ok: torch.Tensor | None = None) -> None:
        """Rows [first, end) held here set to `value` where `ok` holds (no host read)."""
        ...

    def fill_ids(self, ids: Sequence[int], value: torch.Tensor, write: torch.Tensor) -> None:
        """Rows `ids` held here set to `value` where `write` (one bool per id) says."""
        ...


def rows_of(weight: torch.Tensor, name: str, check: str = "padding_rows") -> Rows:
    """The rows of `weight` this rank holds, as they are now: a ZeRO-3 partition (slices of
    the flattened weight, zero_rows.py), else a RowShard (all rows, or a DTensor's shard; an
    AttachError naming `check` for a DTensor split otherwise). Taken at each use, since
    deepspeed.initialize may partition a weight after the guard attached."""
    return ZeroRows(weight) if holding_of(weight) == "zero3" else RowShard.of(weight, name, check)
