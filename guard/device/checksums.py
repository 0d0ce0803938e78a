"""Checksums of a weight's rows, exact integers computed on the device: two copies agree bitwise
exactly when (barring a collision of odds 2**-31 per block) their checksums do. Each row's bits (its
float values viewed as integers, below 2**31 in magnitude) are summed with a fixed multiplier below
2**15 per column and folded modulo a prime below 2**31, and the rows of a block summed with a
multiplier per global row id, so that a swap of two values or two rows shows. Every intermediate
stays below 2**63 (int64, no wrap) for rows up to 2**17 values wide and blocks up to 2**17 rows.

Runs at a read of the flags (the tie check across pipeline stages, guard/stateful/tie_across.py):
device ops only, in chunks of at most 2**22 values, never a host read.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCKS", "PRIME", "block_checksums", "row_checksums"]

PRIME = 2_147_483_629  # the largest prime below 2**31: every checksum is an int32
BLOCKS = 16  # blocks of rows per weight: a drift is narrowed to one block, then to its rows
_CHUNK = 1 << 22  # values per chunk: the int64 temporaries stay at 32 MiB
_MULT = 1 << 15


def _bits(w: torch.Tensor) -> torch.Tensor:
    """The values' bits as integers, in int64."""
    w = w.detach().contiguous()
    if w.dtype.is_floating_point:
        w = w.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[
            w.element_size()])
    return w.to(torch.int64)


def row_checksums(w: torch.Tensor, first_id: int = 0) -> torch.Tensor:
    """(rows,) int64 in [0, PRIME): each row's checksum, times a multiplier of its global id
    (`first_id` + its row), so that the same rows at other ids differ."""
    rows, width = w.shape[0], w.shape[1] if w.dim() > 1 else 1
    g = torch.Generator().manual_seed(38)
    cols = torch.randint(1, _MULT, (width,), generator=g, dtype=torch.int64).to(w.device)
    out = torch.empty(rows, dtype=torch.int64, device=w.device)
    step = max(1, _CHUNK // max(width, 1))
    wide = w.element_size() > 4  # 64-bit values: folded below 2**31 first
    for start in range(0, rows, step):
        part = _bits(w[start:start + step]).reshape(-1, width)
        if wide:
            part = part % PRIME
        out[start:start + step] = (part * cols).sum(dim=1) % PRIME
    ids = torch.arange(first_id, first_id + rows, dtype=torch.int64, device=w.device)
    return out * (ids * 40_503 % (_MULT - 1) + 1) % PRIME


def block_of(rows: int, blocks: int = BLOCKS) -> torch.Tensor:
    """(rows,) the block of each row: `blocks` runs of consecutive rows (fewer if fewer rows)."""
    return torch.arange(rows) * min(blocks, max(rows, 1)) // max(rows, 1)


def block_checksums(w: torch.Tensor, first_id: int = 0, blocks: int = BLOCKS) -> torch.Tensor:
    """(blocks,) int64 in [0, PRIME): the checksum of each block of rows (0 past the rows)."""
    sums = torch.zeros(blocks, dtype=torch.int64, device=w.device)
    sums.index_add_(0, block_of(w.shape[0], blocks).to(w.device), row_checksums(w, first_id))
    return sums % PRIME
