"""Pure tensor functions behind the per-step checks; no hooks, no host reads.

Each returns a tensor on the input's device so the hook can accumulate it without a sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from guard.device.compile import compiling

__all__ = [
    "chunk_positions",
    "logsumexp",
    "logsumexp_rows",
    "mask_padding",
    "mask_padding_",
    "nonfinite_count",
    "nonfinite_positions",
    "not_finite",
    "one_thread",
    "padding_mass",
    "padding_mass_parts",
    "reduction_dtype",
    "sample_positions",
    "sample_positions_at",
    "sample_size",
]

# The guard's share of a forward's logits: at most one position in SAMPLE_SHARE is sampled
# (and at most `sample_tokens`), so its reductions cost a bounded fraction of what the loss
# already spends on the same logits (a log-softmax over every position, forward and backward),
# whatever the vocabulary: a head-dominated model with Qwen2's 151,936 rows measured 1.09x at
# a quarter of the positions (docs/benchmarks.md, "Vocabulary size"). One in 32 (it was 16
# until the gradient check came: the default policy's cost a step stays within 1% of the
# bench model's step, docs/benchmarks.md) keeps the default's 256 positions from 8192
# positions a forward up.
SAMPLE_SHARE = 32
# Exact (all-token) mode's chunks on the CPU: at least a sixteenth of the forward's positions.
CHUNK_SHARE = 16
# Elements per chunk of (positions, rows) work, at least. On the CPU every fresh temporary of
# megabytes is mapped and page-faulted anew, and every large op is a parallel region whose
# threads wait for each other (on a busy machine, for the scheduler): the chunks go through
# one reused buffer (guard/device/logits.py), as few as fit 1/CHUNK_SHARE of the forward's
# logits (a sample, on one thread, has cache-sized chunks instead: SAMPLE_CHUNK_ELEMENTS). On
# CUDA the caching allocator has neither cost, so chunks only bound memory in exact
# (all-token) mode: 1024 x rows.
CPU_CHUNK_ELEMENTS = 1 << 21
# Elements per chunk of a sample's reduction on the CPU, at most: it runs in one thread (no
# parallel region to amortise), so its chunks are sized for the cache, where the passes of
# logsumexp (max, shift, exp, sum) then find them: Qwen2's 32 x 151,665 sampled logits (19 MB)
# took 6.5-7.5 ms a step in one chunk, 4.7-6.3 in 6-row chunks, each run faster than the one
# beside it; at 50,257 no change (docs/benchmarks.md, "Fewer ops a step").
SAMPLE_CHUNK_ELEMENTS = 1 << 20
LOG2E = 1.0 / math.log(2.0)  # logsumexp on the CPU: e^y as 2^(y log2 e)
CUDA_CHUNK_ROWS = 1024


def sample_size(positions: int, sample_tokens: int) -> int:
    """Positions sampled of a forward's `positions`: at most `sample_tokens` and one in
    SAMPLE_SHARE, at least one."""
    return max(1, min(sample_tokens, positions // SAMPLE_SHARE))


def chunk_positions(rows: int, device: torch.device, positions: int = 0, *,
                    sample: bool = False) -> int:
    """Positions per chunk for (positions, rows) reductions on `device`, for a forward of
    `positions` positions (`CPU_CHUNK_ELEMENTS` says why); `sample`: of a sample of them, on
    one thread (`SAMPLE_CHUNK_ELEMENTS`)."""
    if device.type == "cpu":
        if sample:
            return max(1, SAMPLE_CHUNK_ELEMENTS // rows)
        return max(1, CPU_CHUNK_ELEMENTS // rows, positions // CHUNK_SHARE)
    return CUDA_CHUNK_ROWS


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """The guard's own ops on the CPU in the calling thread alone, the thread count restored
    after. Each op over 32768 elements is otherwise a parallel region whose worker threads
    must all be scheduled: on a machine busy with other work a region waits for them (a count
    over 65536 hidden values took 0.1 ms at the median and 15 ms on average with 2 threads at
    a load average of 4, 0.3 ms with one), and the guard's handful of small ops a step paid
    that in full. Outside the CPU, and under torch.compile (a graph break), nothing changes."""
    if device.type != "cpu" or compiling() or (threads := torch.get_num_threads()) == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_real(vocab_real: int, rows: int) -> None:
    if isinstance(vocab_real, bool) or not isinstance(vocab_real, int):
        raise TypeError(f"vocab_real must be an int, got {type(vocab_real).__name__}")
    if not 0 < vocab_real <= rows:
        raise ValueError(
            f"vocab_real must be in [1, {rows}] (the logits' last dim), got {vocab_real}"
        )


def padding_mass_parts(logits: torch.Tensor, vocab_real: int, *, per_chunk: int | None = None,
                       scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, logsumexp of the real columns), both (...), for logits (..., rows) with padding.

    mass = sum(exp(pad)) / (sum(exp(real)) + sum(exp(pad))) = sigmoid(lse(pad) - lse(real)),
    which never forms exp of a large logit, so it is exact for garbage of any size. The
    second value is non-finite exactly when a real column holds NaN or +Inf. The real columns
    of (n, rows) logits go `per_chunk` positions at a time through `scratch` (`logsumexp_rows`).
    """
    lse_real = logsumexp_rows(logits[..., :vocab_real], per_chunk, scratch)
    lse_pad = logsumexp(logits[..., vocab_real:])  # (..., padding): small, no chunks
    mass = torch.sigmoid(lse_pad - lse_real)
    return mass if mass.dtype == torch.float32 else mass.to(torch.float32), lse_real


def reduction_dtype(t: torch.Tensor) -> torch.dtype:
    """What logsumexp computes in: half precision loses small masses (the absolute threshold
    may be 1e-6), so float32; float64 input stays float64."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def logsumexp(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """logsumexp over the last dim in `reduction_dtype`, as torch.logsumexp (+inf, all -inf and
    NaN rows alike), exp(x - max) formed in one buffer and exponentiated in place.

    `scratch`: a flat buffer of at least x.numel() elements of that dtype to form it in. On
    the CPU a fresh temporary of megabytes is mapped and page-faulted anew at each call, which
    costs more than the arithmetic (docs/benchmarks.md, "Vocabulary size"); a reused one
    does not.
    """
    m = x.amax(dim=-1, keepdim=True)  # a new tensor; exact: the max is one of x's
    if m.dtype != (dtype := reduction_dtype(x)):
        m = m.to(dtype)
    m.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # +-inf / NaN rows: shift by 0
    # x - m is promoted to m's dtype: half logits need no float copy first.
    out = None if scratch is None else scratch[: x.numel()].view(x.shape)
    shifted = x - m if out is None else torch.sub(x, m, out=out)
    if shifted.device.type == "cpu":
        # e^y = 2^(y log2 e): torch's CPU exp2 is about 3x its exp (0.47 against 1.42 ms for
        # 1.7M floats, one AVX-512 thread; docs/benchmarks.md), the product one more pass of
        # 0.18 ms. y = x - m is exact as before; the product rounds by half an ulp.
        return m.squeeze(-1) + shifted.mul_(LOG2E).exp2_().sum(dim=-1).log()
    return m.squeeze(-1) + shifted.exp_().sum(dim=-1).log()


def logsumexp_rows(x: torch.Tensor, per_chunk: int | None = None,
                   scratch: torch.Tensor | None = None) -> torch.Tensor:
    """`logsumexp` of (n, k) x, `per_chunk` positions at a time (at once when None): bounded
    memory for any number of positions, one `scratch` for every chunk."""
    if per_chunk is None or x.dim() != 2 or x.shape[0] <= per_chunk:
        return logsumexp(x, scratch)
    return torch.cat([logsumexp(x[i : i + per_chunk], scratch)
                      for i in range(0, x.shape[0], per_chunk)])


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


def not_finite(t: torch.Tensor) -> torch.Tensor:
    """Where floating-point t holds NaN or +-Inf, as a bool tensor of t's shape: x - x is
    exactly 0 for every finite x and NaN for the others. Two ops where torch.isfinite is four
    (it is composite: x == x and |x| != inf) and a not; each of the guard's small ops costs
    several microseconds of host time in a step (docs/benchmarks.md, "Fewer ops a step")."""
    return (t - t).ne(0)


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """Number of NaN / +-Inf elements of t, as a 0-dim int64 tensor."""
    if not t.is_floating_point():
        return torch.zeros((), dtype=torch.int64, device=t.device)
    with one_thread(t.device):
        return not_finite(t).sum()


def nonfinite_positions(t: torch.Tensor) -> torch.Tensor:
    """Number of positions (all but the last dim) of t whose vector holds a NaN / +-Inf, as a
    0-dim int64 tensor: one pass, a float32 sum per position (which a finite vector can only
    make infinite past 3e38: values no lm_head input holds unless its logits overflow too),
    no (..., d) temporary."""
    if not t.is_floating_point():
        return torch.zeros((), dtype=torch.int64, device=t.device)
    with one_thread(t.device):
        return not_finite(t.sum(dim=-1, dtype=torch.float32)).sum()


def mask_padding_(logits: torch.Tensor, vocab_real: int) -> torch.Tensor:
    """Set columns [vocab_real, rows) to -inf in place: zero probability, zero gradient.

    Outside autograd only (no_grad, eval, detached); `mask_padding` is the autograd-aware form.
    """
    rows = logits.shape[-1]
    _check_real(vocab_real, rows)
    if vocab_real < rows:
        with one_thread(logits.device):
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
        with one_thread(logits.device):
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
        with one_thread(grad.device):
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
