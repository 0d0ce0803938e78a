"""Where a vocab-parallel weight's rows are: which global ids [start, end) of the vocab this
rank's head columns (or embedding rows) hold, over how many ranks, and the process group
they make. Read from the weight itself where it says: a DTensor's placements and mesh
coordinate (torch's `parallelize_module`, FSDP2 over it), Megatron-core's own attributes
(guard/vocab/megatron.py); a head sharded by hand says it with `vocab_shard=`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["VocabShard", "fsdp_managed", "held_block", "held_rows",
           "on_rows", "tp_dims"]


@dataclass(frozen=True)
class VocabShard:
    """Global ids [start, end) of a vocab of `rows` split over `degree` ranks (`group`)."""

    start: int
    end: int
    rows: int  # of the whole vocab
    degree: int
    group: Any  # the ranks holding the other shards; None: none in this process (no dist)
    source: str  # how the guard knows: "a DTensor Shard(0) on mesh dim 'tp'", ...
    dtensor: bool = False  # the weight is a DTensor: its rows are read in global numbers

    @property
    def width(self) -> int:
        return self.end - self.start


def _strided(p: Any) -> bool:
    return hasattr(p, "split_factor")  # FSDP2's _StridedShard over a tensor-parallel Shard


def on_rows(p: Any) -> bool:
    """A placement that splits a weight by rows: Shard(0), or FSDP2's _StridedShard(0)."""
    if _strided(p):
        return getattr(p, "dim", None) == 0
    return bool(p.is_shard(0)) if hasattr(p, "is_shard") else False


def held_rows(rows: int, placements: tuple[Any, ...], sizes: tuple[int, ...],
              coordinate: tuple[int, ...], dims: tuple[int, ...]) -> torch.Tensor:
    """The global row numbers this rank holds of a (rows, ...) DTensor, (k,) int64, from the
    placements of mesh dims `dims`, applied left to right as DTensor does: Shard(0) takes its
    chunk as torch.chunk cuts them (ceil(n / size) rows, the last fewer or none), FSDP2's
    _StridedShard(0) its chunk of each of `split_factor` pieces."""
    idx = torch.arange(rows)
    for d in dims:
        p, n, c = placements[d], sizes[d], coordinate[d]
        pieces = torch.chunk(idx, p.split_factor) if _strided(p) else (idx,)
        idx = torch.cat([_chunk(piece, n, c) for piece in pieces] or [idx[:0]])
    return idx


def _chunk(idx: torch.Tensor, n: int, c: int) -> torch.Tensor:
    per = -(-idx.shape[0] // n)
    return idx[c * per : (c + 1) * per]


def held_block(rows: int, weight: Any, dims: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, count) of the global rows a DTensor (rows, ...) weight holds on this rank as
    mesh dims `dims` split it ((rows, 0) outside the mesh); None when they are not one block
    of the whole weight (a strided shard whose pieces do not meet)."""
    mesh = weight.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return rows, 0
    sizes = tuple(mesh.size(d) for d in range(mesh.ndim))
    idx = held_rows(rows, tuple(weight.placements), sizes, tuple(coordinate), dims)
    first = int(idx[0]) if idx.numel() else rows
    if not torch.equal(idx, torch.arange(first, first + idx.numel())):
        return None
    return first, idx.numel()


def fsdp_managed(model: nn.Module, name: str) -> bool:
    """The module `name` of `model` is under FSDP2's fully_shard (it or an ancestor is an
    FSDPModule): a Shard(0) of its weight is FSDP2's, gathered in forward."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is None:
        return False
    parts = name.split(".") if name and not name.startswith("<") else []
    prefixes = {".".join(parts[:i]) for i in range(len(parts) + 1)}
    return any(isinstance(m, fsdp) for n, m in model.named_modules() if n in prefixes)


def tp_dims(placements: tuple[Any, ...], fsdp: bool) -> tuple[int, ...]:
    """The mesh dims on which tensor parallelism splits the rows of a DTensor weight placed
    so. Under FSDP2 the leading dims are FSDP2's: all of them alone (Shard(0), HSDP's
    Replicate, Shard(0)), up to its _StridedShard over tensor parallel's Shard(0)
    (torchtitan's 2-D layout)."""
    sharded = tuple(i for i, p in enumerate(placements) if on_rows(p))
    if not fsdp:
        return sharded
    strided = [i for i, p in enumerate(placements) if _strided(p)]
    return tuple(i for i in sharded if strided and i > strided[-1])
