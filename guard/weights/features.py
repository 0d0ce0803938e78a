"""Which rows of a weight look never trained, decided on the device at attach by the rules of
guard/checkpoint/untrained_rules.py (ZERO, SMALL, SAME; the thresholds from the policy).

Per row of the real vocab [0, real): its largest magnitude, its norm, whether it is finite and
two fingerprints of its bits. O(rows x hidden) once, a block of rows at a time; under FSDP2
each rank fills the rows it holds and one all-reduce (SUM) gives every rank all of them, so
every rank decides alike; under DeepSpeed ZeRO-3 every rank gathers one block of rows at a time
(guard/weights/zero_rows.py) and computes them all.
"""

from __future__ import annotations

import torch

from guard.checkpoint.untrained_rules import SAME, SMALL, ZERO
from guard.weights.rows import Rows

__all__ = ["classify", "row_features"]
# Fingerprint weights below 2**24: a piece (< 2**16) times a weight stays under 2**40, and a
# row's sum of up to 2**20 pieces under 2**60, so int64 never overflows and the fingerprint is
# exact whatever the order of the sum (a float sum may differ between two blocks' shapes).
_WEIGHT_BITS = 24


def _pieces(block: torch.Tensor) -> torch.Tensor:
    """(b, d) values -> (b, m) int64: their bits as 16-bit pieces (bytes for 1-byte types)."""
    wide = torch.int16 if block.element_size() % 2 == 0 else torch.uint8
    return block.contiguous().view(wide).to(torch.int64)


def row_features(shard: Rows, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [0, real) of the whole weight: (real, 3) float64 (max |value|, norm, finite) and
    (real, 2) int64 fingerprints of their bits; collective when sharded (every rank calls)."""
    device = shard.local().device
    # One int64 buffer: the features' float64 bits beside the fingerprints, so that sharded,
    # one all-reduce (SUM) gathers both; each row is filled on one rank and 0 elsewhere, and
    # x + 0 is x bit for bit.
    packed = torch.zeros(real, 5, dtype=torch.int64, device=device)
    features, prints = packed[:, :3].view(torch.float64), packed[:, 3:]
    weights = None
    for first, block in shard.blocks(real):  # held here, or ZeRO-3's gathered
        if weights is None:
            seed = torch.Generator().manual_seed(21)  # the same weights on every rank
            weights = torch.randint(1, 1 << _WEIGHT_BITS, (2, _pieces(block[:1]).shape[1]),
                                    generator=seed).to(device)
        if block.shape[0]:
            x = block.float()  # (b, d)
            at = slice(first, first + block.shape[0])
            features[at, 0] = x.abs().amax(dim=1).double()
            features[at, 1] = x.norm(dim=1).double()
            features[at, 2] = torch.isfinite(x).all(dim=1).double()
            bits = _pieces(block)  # (b, m)
            for j in range(2):
                prints[at, j] = (bits * weights[j]).sum(dim=1)
    shard.whole(packed)  # sharded rows summed over ranks; ZeRO-3's blocks were gathered
    return features, prints


def classify(features: torch.Tensor, prints: torch.Tensor, *, epsilon: float, norm_ratio: float,
             duplicates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, why it looks untrained ((real,) int64 of ZERO | SMALL | SAME bits, 0: trained),
    and the reference norm (0-dim: the median norm of the finite rows that are not ZERO, NaN
    when there are none)."""
    top, norm, finite = features[:, 0], features[:, 1], features[:, 2] > 0
    zero = finite & (top <= epsilon)
    others = finite & ~zero
    reference = torch.where(others, norm, float("nan")).nanmedian()
    small = others & (norm < norm_ratio * reference)  # False against a NaN reference
    _, group, size = torch.unique(prints, dim=0, return_inverse=True, return_counts=True)
    same = finite & (size[group] >= duplicates)
    why = zero.long() * ZERO | small.long() * SMALL | same.long() * SAME
    return why, reference
