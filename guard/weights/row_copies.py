"""Padding rows that hold a real row's values (a checkpoint converter that pads the vocab for a
new tensor-parallel size copies the last real row into each new one): each such ghost id then
takes exactly that id's probability wherever the padding columns are not masked, and their
norms pass the padding_rows rule. Found once, at attach (guard/device/rows.py puts them in the
flags at the attach read), on the device: one pass over the weight, a block of rows at a time,
each row reduced to its projection on one fixed random vector (equal rows, equal numbers;
distinct rows collide with probability ~0), then the padding rows' numbers are looked up among
the real rows' (sorted). A weight whose rows are split over ranks (FSDP2, ZeRO-3) is not
looked at: its rows would need a gather."""

from __future__ import annotations

import torch

from guard.weights.rows import Rows
from guard.weights.sharded import RowShard

__all__ = ["real_row_copies"]

_BLOCK = 4096  # rows projected at a time: a float64 copy of one block, never of the weight


def real_row_copies(shard: Rows, real: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(how many padding rows [real, rows) equal a real row, 1 + the real row they copy, 0 if
    none), both 0-dim on the weight's device; None where the weight is not held whole here or
    has no padding row. All-zero rows are no copies (a zeroed padding row is no token's)."""
    if not isinstance(shard, RowShard) or shard.group is not None:
        return None
    w = shard.local().detach()
    rows = w.shape[0]
    if not 0 < real < rows or w.dim() != 2:
        return None
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(w.shape[1], generator=gen, dtype=torch.float64).to(w.device)
    h = torch.cat([w[i:i + _BLOCK].double() @ v for i in range(0, rows, _BLOCK)])  # (rows,)
    ordered, order = h[:real].sort()
    pad = h[real:]
    at = torch.searchsorted(ordered, pad).clamp(max=real - 1)
    used = w[real:].abs().amax(dim=1) > 0
    match = (ordered[at] == pad) & torch.isfinite(pad) & used
    copied = torch.where(match, order[at] + 1, 0).amax()
    return match.sum(), copied
