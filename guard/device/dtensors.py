"""What the hooks see of a tensor-parallel model, as plain tensors: a DTensor's local shard
(ids, hidden states, logits, a loss) and the DTensor back from a new local one; the logits in
what a head returns (a tensor, a DTensor, Megatron's `(output, bias)`), this rank's columns
of them, and the output with masked logits put back. Device ops only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from guard.device.compile import compiling
from guard.device.ops import mask_padding
from guard.tensors import dtensor_of

__all__ = ["Columns", "HeadOutput", "head_output", "local", "mask_columns", "rewrap"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local tensor (differentiable), else `t` itself."""
    dt = dtensor_of(t)
    return t if dt is None else cast(torch.Tensor, dt.to_local())


def rewrap(like: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new`, a local tensor shaped as `like`'s, as a DTensor laid out as `like` when that is
    one (no collective: each rank gives its own part); else `new`."""
    dt = dtensor_of(like)
    if dt is None:
        return new
    out: torch.Tensor = type(dt).from_local(new, dt.device_mesh, dt.placements, run_check=False,
                                            shape=dt.shape, stride=dt.stride())
    return out


def _function_view(t: torch.Tensor) -> bool:
    """A view made inside a custom autograd Function (DTensor's to_local): autograd forbids
    changing it in place while it needs a gradient."""
    return t._is_view() and isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction)


class _MaskShard(torch.autograd.Function):
    """ops.mask_padding's in-place mask for a DTensor, on its local columns: forward fills
    them, backward zeroes the same columns of the gradient (a DTensor laid out alike), each
    on this rank's part; nothing of (tokens, columns) is allocated."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, real: int) -> torch.Tensor:
        # Autograd is off in a Function's forward: the local view may be written.
        cast(Any, logits).to_local()[..., real:].fill_(float("-inf"))
        ctx.mark_dirty(logits)
        ctx.real = real
        return logits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mine = cast(Any, grad).to_local()
        if any(st == 0 and n > 1 for st, n in zip(mine.stride(), mine.shape, strict=True)):
            grad = grad.clone()  # an expanded gradient (from .sum()) is no one's to change
            mine = cast(Any, grad).to_local()
        mine[..., ctx.real:] = 0.0
        return grad, None


def mask_columns(logits: torch.Tensor, real: int) -> torch.Tensor:
    """Columns [real, ...) of this rank's part to -inf with zero gradient: in place
    (ops.mask_padding; a DTensor's local columns), or, on a view autograd forbids changing in
    place, a masked copy ((..., columns) once; its backward zeroes the same columns)."""
    if dtensor_of(logits) is not None:
        if logits.requires_grad and torch.is_grad_enabled():
            out: torch.Tensor = _MaskShard.apply(logits, real)  # type: ignore[no-untyped-call]
            return out
        cast(Any, logits).to_local()[..., real:].fill_(float("-inf"))
        return logits
    # Traced, ops.mask_padding is out of place already (and grad_fn is no thing to trace).
    if not compiling() and logits.requires_grad and torch.is_grad_enabled() \
            and _function_view(logits):
        pad = torch.arange(logits.shape[-1], device=logits.device) >= real  # (columns,)
        return logits.masked_fill(pad, float("-inf"))
    return mask_padding(logits, real)


@dataclass(frozen=True)
class HeadOutput:
    """The logits in a head's output: this rank's `columns` of them (measured), the tensor
    the mask goes on (the same; the DTensor they are the local part of; all the columns,
    where the head gathered them) with its first padding column in this rank's part, and how
    to put a masked one back into the output."""

    columns: torch.Tensor  # (..., shard's columns): this rank's, a plain tensor
    masked: torch.Tensor  # (..., columns or rows), or a DTensor
    real: int
    put: Callable[[torch.Tensor], Any]


@dataclass(frozen=True)
class Columns:
    """The head's columns on this rank: `columns` of them, real up to `real_columns`, the
    global ids `shard` of a vocab of `rows` (None: the whole vocab), real up to `real`."""

    columns: int
    real_columns: int
    shard: tuple[int, int] | None
    rows: int
    real: int


def head_output(out: Any, c: Columns) -> HeadOutput | None:
    """The logits of `out`, a head's output; None when it holds none."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        first = head_output(out[0], c)
        if first is None:  # Megatron's ColumnParallelLinear: (output, bias)
            return None
        return HeadOutput(first.columns, first.masked, first.real,
                          lambda t: (first.put(t), *out[1:]))
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return None
    # A DTensor is masked as it is, on its local part (its layout kept, no copy).
    mine = local(out)
    if mine.shape[-1] == c.columns:
        return HeadOutput(mine, out, c.real_columns, _same)
    if c.shard is not None and mine.shape[-1] == c.rows:
        # Gathered (ColwiseParallel(output_layouts=Replicate()) seen after its gather,
        # Megatron's gather_output): every rank holds every column, and measures its own.
        return HeadOutput(mine[..., c.shard[0] : c.shard[1]], out, c.real, _same)
    return None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
