"""The token_range check's device ops: ids outside the vocabulary counted and keyed for the
message (which id, where), and replaced before they index a row that does not exist. Device
ops only, no host read (tests/guard/device/test_hot_path.py)."""

from __future__ import annotations

import torch

from guard.checks.token_range import POSITIONS
from guard.device.ops import one_thread

__all__ = ["flat_positions", "out_of_range_parts", "within_rows"]

# The key of an id and its position (guard/checks/token_range.py), exact in float64.
_ID_LIMIT = (1 << 53) // POSITIONS


def out_of_range_parts(
    ids: torch.Tensor, vocab_real: int, ignore_index: int | None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids outside [0, vocab_real), those of them below 0, the highest id >= vocab_real with
    its flat position as one key: id * POSITIONS + position, or 0 when there is none), each
    0-dim: the counts and what the message needs to tell a ghost from a setting and to say
    where it is. `positions`: `flat_positions` of at least ids.numel() (kept by the caller
    from forward to forward), else made here.

    Each mask is formed once: in a hook, between the model's large ops, a small op costs
    several microseconds of host time, and this runs on every forward's ids and labels."""
    with one_thread(ids.device):
        flat = ids.reshape(-1)
        below, high = flat < 0, flat >= vocab_real
        bad = below | high
        if ignore_index is not None:
            kept = flat != ignore_index
            bad &= kept
            below &= kept
        n = flat.numel()
        if not n:
            return bad.sum(), below.sum(), flat.new_zeros((), dtype=torch.int64)
        # A new int64 tensor either way (clamp of int64, or the copy of a narrower dtype).
        key = flat.clamp(max=_ID_LIMIT - 1) if flat.dtype == torch.int64 else \
            flat.to(torch.int64).clamp_(max=_ID_LIMIT - 1)
        held = flat_positions(n, ids.device) if positions is None else positions
        key.mul_(POSITIONS).add_(held[:n] if held.numel() > n else held)
        top = torch.where(high, key, 0).amax()
        return bad.sum(), below.sum(), top


def flat_positions(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int64 0, 1, ..., n - 1, clamped at POSITIONS - 1: the positions of a key."""
    return torch.arange(n, device=device).clamp_(max=POSITIONS - 1)


def within_rows(ids: torch.Tensor, rows: int, fill: int, *,
                negative: bool = True) -> torch.Tensor:
    """`ids` with every id at or past `rows` (and, with `negative`, below 0) replaced by
    `fill`, so that nothing downstream indexes a row that does not exist (a new tensor; no
    host read)."""
    bad = ids >= rows
    if negative:
        bad |= ids < 0
    return torch.where(bad, fill, ids)  # a Python fill keeps ids' dtype
