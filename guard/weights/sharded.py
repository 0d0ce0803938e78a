"""Weights sharded by rows (FSDP2's `fully_shard`, a DTensor `Shard(0)`): which rows of the
whole weight this rank holds, read and written in place without a collective; the scale taken
at attach and a repair's mean row cost one all-reduce each."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from guard.errors import AttachError
from guard.tensors import dtensor_of
from guard.vocab.parallel import held_block, on_rows

__all__ = ["RowShard", "register_sharded"]

# Rows per block where a whole weight would otherwise be copied to float32 at once (a 128k x
# 4096 embedding is 2 GiB in float32): 4096 x 4096 is 64 MiB.
_BLOCK = 4096
# Rows per block handed out by `blocks` (the untrained rows' features: 1024 x 4096 is 16 MiB
# in float32 and 32 MiB as int64 pieces).
_FEATURE_BLOCK = 1024


@dataclass(frozen=True)
class RowShard:
    """Rows [first, first + count) of a (rows, d) weight: the ones this rank holds."""

    weight: torch.Tensor  # the parameter the optimizer updates: a plain tensor or a DTensor
    first: int
    count: int
    dtensor: bool = False
    # The process group of the mesh dim that splits the rows, a tuple of them for several
    # (FSDP2 over tensor parallel); None: not sharded.
    group: Any = None

    @classmethod
    def of(cls, weight: torch.Tensor, name: str, check: str = "padding_rows") -> RowShard:
        """All rows of a plain tensor; a DTensor's local rows, found from its placements (one
        mesh dimension `Shard(0)`, the others `Replicate()`: FSDP2, HSDP). Else AttachError
        naming `check`, the one that reads them."""
        rows = weight.shape[0]
        dt = dtensor_of(weight)
        if dt is None:
            return cls(weight, 0, rows)
        placements = tuple(dt.placements)
        sharded = tuple(i for i, p in enumerate(placements) if not p.is_replicate())
        # Rows in one block of the whole weight on every mesh dim that splits it: FSDP2's
        # Shard(0), tensor parallel's, FSDP2 over it (_StridedShard(0), Shard(0)); Shard(1)
        # splits each row's norm over ranks.
        held = None if any(not on_rows(placements[i]) for i in sharded) else \
            held_block(rows, weight, sharded)
        if held is None:
            raise AttachError(
                f"{check} reads the rows of {name} that this rank holds, but it is a "
                f"DTensor with placements {placements}: the guard reads weights whose rows "
                "each rank holds in one block (Shard(0) on the mesh dims that split them, as "
                "fully_shard and tensor parallel's vocab plans do) or replicated. Set "
                f"checks.{check}.action: off to attach without it (those rows are then neither "
                "checked nor repaired; the other checks and the mask still work)")
        if not sharded:
            return cls(weight, 0, rows, dtensor=True)
        mesh = dt.device_mesh
        groups = tuple(mesh.get_group(d) for d in sharded)
        shard = cls(weight, held[0], held[1], dtensor=True,
                    group=groups[0] if len(groups) == 1 else groups)
        if (local := shard.local().shape[0]) != shard.count:
            raise AttachError(
                f"{check}: this rank's shard of {name} has {local} rows, expected "
                f"{shard.count} (rows [{shard.first}, {shard.first + shard.count}) of {rows}, "
                f"split as DTensor splits them); set checks.{check}.action: off to attach "
                "without it")
        return shard

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> None:
        """`t` summed (or `op`) over the ranks that hold the other rows, in place: over each
        mesh dim that splits them in turn (a 2-D mesh: its dp dim, then its tp dim)."""
        groups = self.group if isinstance(self.group, tuple) else (self.group,)
        for group in groups:
            if group is not None:
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)

    def local(self) -> torch.Tensor:
        """The rows this rank holds, (count, d): the storage itself, so writes are in place.
        Taken at each use: FSDP2 may replace a DTensor's local tensor (`model.to()`)."""
        if not self.dtensor:
            return self.weight
        local: torch.Tensor = cast(Any, self.weight).to_local()
        return local

    def _held(self, row: int) -> int:
        """How many of the rows held here come before row `row` of the whole weight."""
        return min(max(row - self.first, 0), self.count)

    def rows_from(self, start: int) -> torch.Tensor:
        """The rows held here whose number in the whole weight is >= start, (k, d); k may be 0."""
        return self.local()[self._held(start) :]

    def rows_below(self, end: int) -> torch.Tensor:
        """The rows held here whose number in the whole weight is < end, (k, d); k may be 0."""
        return self.local()[: self._held(end)]

    def mean_below(self, end: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Float32: the mean of rows [0, end) of the whole weight, (d,) (a scalar for a bias);
        with `keep`, a (rows,) bool of the whole weight, of the rows it marks only (a block of
        rows at a time: no float32 copy of the whole weight). Sharded by rows, each rank sums
        the rows it holds and the sums are all-reduced over the shard dimension's group: a
        collective, so every rank of that group calls it."""
        held = self.rows_below(end).detach()
        if keep is None:
            total = held.float().sum(dim=0)
        else:
            mine = keep[self.first : self.first + held.shape[0]].to(held.device, torch.float32)
            total = held.new_zeros(held.shape[1:], dtype=torch.float32)
            for i in range(0, held.shape[0], _BLOCK):
                total += mine[i : i + _BLOCK] @ held[i : i + _BLOCK].float()  # (d,)
        self.all_reduce(total)
        if keep is None:
            return total / max(end, 1)
        return total / keep[:end].sum().clamp_min(1).to(total)

    def largest_norm_below(self, end: int) -> torch.Tensor:
        """0-dim float32: the largest norm of rows [0, end) of the whole weight (0 for none).
        A row is whole on the rank that holds it, so each rank takes the largest norm of its
        own and, sharded, they are all-reduced (MAX) over the shard dimension's group: one
        number, a collective (at attach), so every rank of that group calls it."""
        rows = self.local().detach()[: self._held(end)].float()
        largest = rows.norm(dim=-1).amax() if rows.shape[0] else rows.new_zeros(())
        self.all_reduce(largest, dist.ReduceOp.MAX)
        return largest

    def blocks(self, end: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row of the whole weight, (b, d) rows) of rows [0, end) held here, a block at
        a time; no collective (`whole` combines what each rank makes of them)."""
        held = self.rows_below(end).detach()  # (k, d): the rows held here
        for i in range(0, held.shape[0], _FEATURE_BLOCK):
            yield self.first + i, held[i : i + _FEATURE_BLOCK]

    def whole(self, t: torch.Tensor) -> None:
        """`t`, per row of the whole weight and filled from `blocks` (0 on the rows other ranks
        hold), summed over the ranks that hold them, in place: a collective when sharded."""
        self.all_reduce(t)

    def norm_from(self, first: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The largest norm and the count of non-finite values of rows [first, rows) held here,
        None where this rank holds none of them (the other ranks report; the read's
        all-reduce (MAX) combines them). No collective."""
        rows = self.rows_from(first).float()  # (rows held here from first, d)
        if rows.shape[0] == 0:
            return None
        return rows.norm(dim=-1).amax(), torch.isfinite(rows).logical_not().sum()

    def fill(self, first: int, end: int, value: torch.Tensor,
             ok: torch.Tensor | None = None) -> None:
        """Rows [first, end) held here set to `value` ((d,), or a scalar for a bias) where `ok`
        (0-dim bool, on the device) holds: a device select, no host read."""
        rows = self.local()[self._held(first) : self._held(end)]
        new = value.to(rows.dtype).expand_as(rows)
        rows.copy_(new if ok is None else torch.where(ok, new, rows))

    def fill_ids(self, ids: Sequence[int], value: torch.Tensor, write: torch.Tensor) -> None:
        """The rows `ids` held here (all of them, unless FSDP2 shards them) set to `value` where
        `write` ((len(ids),) bool, on the device) says."""
        local = self.local()
        here = [j for j, i in enumerate(ids) if self.first <= i < self.first + self.count]
        if here:
            at = torch.tensor(here, device=local.device)
            rows = torch.tensor([ids[j] - self.first for j in here], device=local.device)
            fill = torch.where(write[at].unsqueeze(1).to(local.device),
                               value.to(local.dtype).to(local.device),
                               local.index_select(0, rows))
            local.index_copy_(0, rows, fill)


def register_sharded(model: nn.Module) -> None:
    """FSDP2 keeps the root's parameters gathered after a forward without grad (an evaluation
    before attach, the guard's own re-run to localise a NaN), and the next forward reuses them:
    put the sharded ones back, so the guard holds the parameters the optimizer updates (not
    copies whose storage FSDP2 frees) and no forward runs on weights from before an update.
    No collective; the next forward gathers them again."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: nothing is sharded
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return
    for m in model.modules():
        if isinstance(m, fsdp_module):
            m.reshard()
