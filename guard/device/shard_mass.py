"""The padding mass of a vocab-parallel head over the whole vocab. A rank holds the logits of
its own columns only, and the whole vocab's softmax has every shard's columns in its
denominator: so, per sampled position, each rank keeps the logsumexp of its real columns and
of its padding columns (two floats, on the device, until the read), and at the read one
all_gather over the tensor-parallel group gives every rank all the shards' (2 x degree floats
a position), combined as the loss's cross-shard logsumexp is:

    lse(real) = logsumexp over shards of lse_k(real),   lse(pad) likewise,
    mass = sigmoid(lse(pad) - lse(real)).

Every rank of the group then writes the same padding_mass figures, so its threshold is the
whole vocab's, its message quotes that one and `g.stats` says the same on every rank. (The
non-finite real-vocab logits stay each rank's count, of its own columns, so that a NaN is
named on the rank whose columns hold it.) No host read; the collective is the read's."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from guard.checks import padding_mass
from guard.device.flags import Flags
from guard.device.ops import logsumexp, logsumexp_rows

__all__ = ["ShardedMass", "shard_parts", "whole_vocab"]


def shard_parts(positions: torch.Tensor, real: int, per_chunk: int | None = None,
                scratch: torch.Tensor | None = None) -> torch.Tensor:
    """(2, n) float32: per position of (n, columns) logits the logsumexp of its real columns
    [0, real) and of its padding columns (-inf where the shard has none)."""
    lse_real = logsumexp_rows(positions[:, :real], per_chunk, scratch).float()
    if real < positions.shape[-1]:
        lse_pad = logsumexp(positions[:, real:]).float()
    else:
        lse_pad = torch.full_like(lse_real, float("-inf"))
    return torch.stack([lse_real, lse_pad])


def whole_vocab(every: torch.Tensor) -> torch.Tensor:
    """(2, n) of the whole vocab from (shards, 2, n) shard_parts: each logsumexp over the
    shards, as the loss's cross-shard logsumexp combines them."""
    return torch.logsumexp(every, dim=0)


class ShardedMass:
    """The sampled positions' parts since the last read, combined over `group` at it."""

    def __init__(self, flags: Flags, group: Any) -> None:
        self.flags, self.group = flags, group
        self._parts: list[torch.Tensor] = []  # (3, n) each: lse real, lse padding, visible

    def add(self, parts: torch.Tensor, *, masked: bool) -> None:
        """A forward's (2, n) parts; `masked`: the loss saw them masked (no padding mass)."""
        visible = parts.new_full((1, parts.shape[1]), 0.0 if masked else 1.0)
        self._parts.append(torch.cat([parts, visible]))

    def combine(self, *, reduce: bool) -> None:
        """At a read: every rank of the group gathers the others' parts and writes the whole
        vocab's figures. Not `reduce` (detach: one rank may detach alone) the window's parts
        are dropped: a shard's own columns are no whole-vocab figure. The ranks of a group
        run the same forwards, so they hold as many positions and call it alike."""
        parts, self._parts = self._parts, []
        if not parts or not reduce:
            return
        mine = torch.cat(parts, dim=1)  # (3, n)
        lse = self._gathered(mine[:2].contiguous())  # (2, n): the whole vocab's
        real, pad = lse[0], lse[1]
        # A NaN mass means NaN on the padding columns: count it as all the mass.
        mass = torch.sigmoid(pad - real).nan_to_num(nan=1.0)  # (n,)
        f = self.flags
        f.put(padding_mass.SUM, mass.sum())
        f.put(padding_mass.MAX, mass.max())
        f.put(padding_mass.LOSS_MAX, torch.where(mine[2] > 0, mass, 0.0).max())
        f.put(padding_mass.COUNT, mine.shape[1])
        f.put(padding_mass.LSE_SUM, real.sum())
        f.put(padding_mass.LSE_MAX, real.max().to(f.t.dtype) + padding_mass.LSE_SHIFT)

    def _gathered(self, lse: torch.Tensor) -> torch.Tensor:
        """(2, n) of every shard of the group combined by logsumexp."""
        size = 1 if self.group is None else dist.get_world_size(self.group)
        if size == 1:
            return whole_vocab(lse.unsqueeze(0))
        every = lse.new_empty((size * lse.shape[0], lse.shape[1]))  # the ranks' (2, n), stacked
        dist.all_gather_into_tensor(every, lse, group=self.group)
        return whole_vocab(every.view(size, *lse.shape))
