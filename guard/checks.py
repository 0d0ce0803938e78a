"""Pure tensor functions behind the per-step checks; no hooks, no host reads.

Each returns a tensor on the input's device so the hook can accumulate it without a sync.
"""

from __future__ import annotations

import torch

__all__ = [
    "mask_padding_",
    "nonfinite_count",
    "out_of_range_count",
    "padding_mass",
    "sample_rows",
]

# Positions per chunk for exact (all-token) padding mass: bounds the float32 temporary to
# 1024 x rows (200 MB at rows = 50304) whatever the batch.
EXACT_CHUNK = 1024


def _check_real(vocab_real: int, rows: int) -> None:
    if isinstance(vocab_real, bool) or not isinstance(vocab_real, int):
        raise TypeError(f"vocab_real must be an int, got {type(vocab_real).__name__}")
    if not 0 < vocab_real <= rows:
        raise ValueError(f"vocab_real must be in [1, {rows}] (the logits' last dim), got {vocab_real}")


def padding_mass(logits: torch.Tensor, vocab_real: int) -> torch.Tensor:
    """Softmax probability on columns [vocab_real, rows): (..., rows) -> (...), float32.

    mass = sum(exp(pad)) / (sum(exp(real)) + sum(exp(pad))) = sigmoid(lse(pad) - lse(real)),
    which never forms exp of a large logit, so it is exact for garbage of any size.
    """
    rows = logits.shape[-1]
    _check_real(vocab_real, rows)
    if vocab_real == rows:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    # Half precision loses the small masses we alert on (1e-6); float64 input stays float64.
    x = logits if logits.dtype == torch.float64 else logits.float()
    lse_real = torch.logsumexp(x[..., :vocab_real], dim=-1)
    lse_pad = torch.logsumexp(x[..., vocab_real:], dim=-1)
    return torch.sigmoid(lse_pad - lse_real).to(torch.float32)


def sample_rows(flat: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    """A strided view of at most k rows of (N, rows): no copy, no RNG (dropout stays bitwise)."""
    n = flat.shape[0]
    if n <= k:
        return flat
    stride = n // k
    return flat[offset % stride :: stride][:k]


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """Number of NaN / +-Inf elements of t, as a 0-dim int64 tensor."""
    if not t.is_floating_point():
        return torch.zeros((), dtype=torch.int64, device=t.device)
    return torch.isfinite(t).logical_not().sum()


def out_of_range_count(ids: torch.Tensor, vocab_real: int, ignore_index: int | None) -> torch.Tensor:
    """Token ids outside [0, vocab_real): ghost ids [real, rows) and impossible ones alike."""
    bad = (ids < 0) | (ids >= vocab_real)
    if ignore_index is not None:
        bad &= ids != ignore_index
    return bad.sum()


def mask_padding_(logits: torch.Tensor, vocab_real: int) -> torch.Tensor:
    """Set columns [vocab_real, rows) to -inf in place: zero probability, zero gradient."""
    rows = logits.shape[-1]
    _check_real(vocab_real, rows)
    if vocab_real < rows:
        logits[..., vocab_real:].fill_(float("-inf"))
    return logits
