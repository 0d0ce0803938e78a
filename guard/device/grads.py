"""The gradients the optimizer applies, reduced on the device before the update: one
multi-tensor norm (`torch._foreach_norm`, a fused kernel per device and dtype on a GPU) gives
each parameter's gradient norm, and from those few numbers come the parameters whose
gradient holds a NaN/Inf (a non-finite norm: the test of `clip_grad_norm_(error_if_nonfinite=
True)`, which also counts a norm that overflows), the total norm and the largest parameter's
share of it. No host read; sharded by FSDP2, each rank reduces its shards and the total norm
takes one all-reduce (SUM) of one number at the read."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from guard.checks import grads, nonfinite
from guard.device.flags import Flags

__all__ = ["GradNorms"]


def _local(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A gradient's local tensor, and the process group its shards are spread over (None: a
    plain tensor, or one replicated everywhere)."""
    dt = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor exists
    if dt is None or not isinstance(t, dt.DTensor):
        return t, None
    sharded = [i for i, p in enumerate(t.placements) if not p.is_replicate()]
    group = t.device_mesh.get_group(sharded[0]) if len(sharded) == 1 else None
    return t.to_local(), group


class GradNorms:
    """The norms of `params`' gradients, each boundary (`measure`), into the flags."""

    def __init__(self, params: Sequence[torch.Tensor], flags: Flags, *,
                 scaled: bool = False) -> None:
        self.params = list(params)
        self.flags = flags
        # A GradScaler skips every update whose gradients are not finite: such a step is its
        # business, counted as a skipped update, not as non-finite gradients.
        self.scaled = scaled
        # Per parameter, 1 where its last measured gradient was non-finite; (P,) on the flags'
        # device, read to the host only to name them at a violation.
        self.bad: torch.Tensor | None = None
        self._index: tuple[tuple[int, ...], torch.Tensor] | None = None  # (which, as a tensor)
        self._square: torch.Tensor | None = None  # this rank's squared total, for the read
        self._group: Any = None  # the shards' group, when the gradients are sharded

    def measure(self) -> None:
        """Device ops only: a parameter without a gradient (frozen, unused) is not counted."""
        found = [(i, *_local(p.grad)) for i, p in enumerate(self.params) if p.grad is not None]
        if not found:
            return
        f = self.flags
        with torch.no_grad():
            # One 0-dim float32 norm per gradient (a float16 norm would overflow at 65504).
            norms = torch._foreach_norm([g for _, g, _ in found], 2, dtype=torch.float32)
            one = all(x.device == norms[0].device for x in norms)
            n = (torch.stack(norms) if one else torch.stack([x.to(f.device) for x in norms]))
            n = n.to(f.device)  # (k,)
            bad = torch.isfinite(n).logical_not()
            if self.scaled:
                f.put(grads.SKIPPED, bad.any())
                f.put(grads.WATCHED, 1.0)
            else:
                f.put(nonfinite.GRAD, bad.sum())
                f.put(nonfinite.GRAD_SEEN, 1.0)
            which = self._which(tuple(i for i, _, _ in found))
            self.bad = torch.zeros(len(self.params), device=f.device).index_copy_(
                0, which, bad.float())
            square = n.double().square()  # (k,): float64, no overflow from float32 norms
            top = square.nan_to_num(nan=torch.inf).argmax()
            self._square = square.sum()
            self._group = next((g for _, _, g in found if g is not None), None)
            f.put(grads.TOP, which[top])
            f.put(grads.TOP_SHARE, (square[top] / self._square).nan_to_num(nan=0.0).clamp(0, 1))
            f.put(grads.NORM, self._square.sqrt())
            f.put(grads.SEEN, 1.0)

    def before_read(self) -> None:
        """Sharded gradients: the total norm of every rank's shards (one all-reduce of one
        number; every rank of the group reads at the same boundary)."""
        if self._group is None or self._square is None:
            return
        total = self._square.clone()
        dist.all_reduce(total, group=self._group)
        self.flags.put(grads.NORM, total.sqrt())

    def _which(self, indices: tuple[int, ...]) -> torch.Tensor:
        """The parameters measured, as a device tensor: made once while they stay the same."""
        if self._index is None or self._index[0] != indices:
            self._index = (indices, torch.tensor(indices, device=self.flags.device))
        return self._index[1]
