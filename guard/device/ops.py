"""Pure tensor functions behind the per-step checks; no hooks, no host reads.

Each returns a tensor on the input's device so the hook can accumulate it without a sync.
"""

from __future__ import annotations

import torch

from guard.checks.token_range import POSITIONS
from guard.device.compile import compiling

__all__ = [
    "chunk_positions",
    "logsumexp",
    "mask_padding",
    "mask_padding_",
    "nonfinite_count",
    "out_of_range_parts",
    "padding_mass",
    "padding_mass_parts",
    "sample_positions",
    "sample_positions_at",
    "within_rows",
]

# Elements per chunk of (positions, rows) work. On the CPU a fresh temporary of a few hundred
# MB costs more in page faults than the arithmetic; 2M elements (8 MB in float32) stay in the
# allocator's reused heap. On CUDA the caching allocator has no such cost, so chunks only
# bound memory in exact (all-token) mode: 1024 x rows.
CPU_CHUNK_ELEMENTS = 1 << 21
CUDA_CHUNK_ROWS = 1024


def chunk_positions(rows: int, device: torch.device) -> int:
    """Positions per chunk for (positions, rows) reductions on `device`."""
    if device.type == "cpu":
        return max(1, CPU_CHUNK_ELEMENTS // rows)
    return CUDA_CHUNK_ROWS


def _check_real(vocab_real: int, rows: int) -> None:
    if isinstance(vocab_real, bool) or not isinstance(vocab_real, int):
        raise TypeError(f"vocab_real must be an int, got {type(vocab_real).__name__}")
    if not 0 < vocab_real <= rows:
        raise ValueError(
            f"vocab_real must be in [1, {rows}] (the logits' last dim), got {vocab_real}"
        )


def padding_mass_parts(logits: torch.Tensor, vocab_real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, logsumexp of the real columns), both (...), for logits (..., rows) with padding.

    mass = sum(exp(pad)) / (sum(exp(real)) + sum(exp(pad))) = sigmoid(lse(pad) - lse(real)),
    which never forms exp of a large logit, so it is exact for garbage of any size. The
    second value is non-finite exactly when a real column holds NaN or +Inf.
    """
    # Half precision loses small masses (the absolute threshold may be 1e-6); float64 input
    # stays float64.
    x = logits if logits.dtype == torch.float64 else logits.float()
    lse_real = logsumexp(x[..., :vocab_real])
    lse_pad = logsumexp(x[..., vocab_real:])
    return torch.sigmoid(lse_pad - lse_real).to(torch.float32), lse_real


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, as torch.logsumexp (+inf, all -inf and NaN rows alike) in
    one temporary with an in-place exp: a third faster on the CPU, where this is the cost."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # +-inf / NaN rows: shift by 0
    return m.squeeze(-1) + (x - m).exp_().sum(dim=-1).log()


def padding_mass(logits: torch.Tensor, vocab_real: int) -> torch.Tensor:
    """Softmax probability on columns [vocab_real, rows): (..., rows) -> (...), float32."""
    rows = logits.shape[-1]
    _check_real(vocab_real, rows)
    if vocab_real == rows:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return padding_mass_parts(logits, vocab_real)[0]


def sample_positions(flat: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    """A strided view of at most k positions of (N, rows): no copy, no RNG (dropout stays
    bitwise)."""
    n = flat.shape[0]
    if n <= k:
        return flat
    stride = n // k
    return flat[offset % stride :: stride][:k]


def sample_positions_at(flat: torch.Tensor, k: int, offset: torch.Tensor) -> torch.Tensor:
    """The positions `sample_positions` picks, with the offset a device tensor (a copy of at
    most k positions).

    Under torch.compile a Python offset is a constant of the graph, so a new one every step
    would recompile every step; a tensor offset is an input of one graph.
    """
    n = flat.shape[0]
    if n <= k:
        return flat
    stride = n // k
    idx = torch.arange(k, device=flat.device) * stride + offset.to(flat.device) % stride  # (k,)
    return flat.index_select(0, idx)


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """Number of NaN / +-Inf elements of t, as a 0-dim int64 tensor."""
    if not t.is_floating_point():
        return torch.zeros((), dtype=torch.int64, device=t.device)
    return torch.isfinite(t).logical_not().sum()


# The key of an id and its position (guard/checks/token_range.py), exact in float64.
_ID_LIMIT = (1 << 53) // POSITIONS


def out_of_range_parts(
    ids: torch.Tensor, vocab_real: int, ignore_index: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids outside [0, vocab_real), those of them below 0, the highest id >= vocab_real with
    its flat position as one key: id * POSITIONS + position, or 0 when there is none), each
    0-dim: the counts and what the message needs to tell a ghost from a setting and to say
    where it is."""
    bad = (ids < 0) | (ids >= vocab_real)
    if ignore_index is not None:
        bad &= ids != ignore_index
    negative = bad & (ids < 0)
    if not ids.numel():
        return bad.sum(), negative.sum(), ids.new_zeros((), dtype=torch.int64)
    flat = ids.reshape(-1).to(torch.int64)
    position = torch.arange(flat.numel(), device=ids.device).clamp_(max=POSITIONS - 1)
    key = flat.clamp(max=_ID_LIMIT - 1) * POSITIONS + position  # (n,)
    top = torch.where(flat >= vocab_real, key, 0).amax()
    return bad.sum(), negative.sum(), top


def within_rows(ids: torch.Tensor, rows: int, fill: int, *,
                negative: bool = True) -> torch.Tensor:
    """`ids` with every id at or past `rows` (and, with `negative`, below 0) replaced by
    `fill`, so that nothing downstream indexes a row that does not exist (a new tensor; no
    host read)."""
    bad = ids >= rows
    if negative:
        bad |= ids < 0
    return torch.where(bad, torch.full_like(ids, fill), ids)


def mask_padding_(logits: torch.Tensor, vocab_real: int) -> torch.Tensor:
    """Set columns [vocab_real, rows) to -inf in place: zero probability, zero gradient.

    Outside autograd only (no_grad, eval, detached); `mask_padding` is the autograd-aware form.
    """
    rows = logits.shape[-1]
    _check_real(vocab_real, rows)
    if vocab_real < rows:
        logits[..., vocab_real:].fill_(float("-inf"))
    return logits


class _MaskPadding(torch.autograd.Function):
    """In-place mask whose backward zeroes the padding columns of the gradient in place.

    A plain in-place fill on a slice is recorded as CopySlices, whose backward clones the whole
    (tokens, rows) gradient; this one allocates nothing of that size.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: torch.Tensor,
                vocab_real: int) -> torch.Tensor:
        logits[..., vocab_real:].fill_(float("-inf"))
        ctx.mark_dirty(logits)
        ctx.vocab_real = vocab_real  # type: ignore[attr-defined]
        return logits

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        real: int = ctx.vocab_real  # type: ignore[attr-defined]
        # The incoming gradient is a temporary of the engine's, handed to this node alone, so
        # it is zeroed in place; only an expanded one (stride 0, e.g. from .sum()) can't be.
        if any(st == 0 and n > 1 for st, n in zip(grad.stride(), grad.shape, strict=True)):
            grad = grad.clone()
        grad[..., real:] = 0.0
        return grad, None


def mask_padding(logits: torch.Tensor, vocab_real: int) -> torch.Tensor:
    """`mask_padding_` that keeps autograd exact: padding columns get exactly zero gradient."""
    rows = logits.shape[-1]
    _check_real(vocab_real, rows)
    if vocab_real == rows:
        return logits
    if logits.requires_grad and torch.is_grad_enabled():
        if compiling():
            # Traced, the functional form: the compiler owns the buffers (and fuses the fill),
            # and dynamo would instantiate _MaskPadding to trace it (deprecated in torch 2.13).
            pad = torch.arange(rows, device=logits.device) >= vocab_real  # (rows,)
            return logits.masked_fill(pad, float("-inf"))
        out: torch.Tensor = _MaskPadding.apply(logits, vocab_real)  # type: ignore[no-untyped-call]
        return out
    return mask_padding_(logits, vocab_real)
