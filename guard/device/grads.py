"""The gradients the optimizer applies, reduced on the device before the update: one
multi-tensor norm (`torch._foreach_norm`, a fused kernel per device and dtype on a GPU) gives
each parameter's gradient norm, and from those few numbers come the parameters whose
gradient holds a NaN/Inf (a non-finite norm: the test of `clip_grad_norm_(error_if_nonfinite=
True)`, which also counts a norm that overflows), the total norm and the largest parameter's
share of it. No host read; sharded by FSDP2 or DeepSpeed's ZeRO (whose gradients live in its
own buffers: guard/device/zero_grads.py), each rank reduces its shards and the total norm takes
one all-reduce (SUM) of one number at the read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from guard.checks import grads, nonfinite
from guard.device.flags import Flags
from guard.device.ops import one_thread
from guard.device.zero_grads import is_zero, owner, partition_grad, zero_group
from guard.tensors import dtensor_of

__all__ = ["GradNorms"]

_FIGURES = (grads.SEEN, grads.NORM, grads.TOP, grads.TOP_SHARE)  # consecutive in the spec


def _local(t: Any) -> tuple[torch.Tensor, Any]:
    """A DTensor gradient's local tensor, and the process group its shards are spread over
    (None: replicated everywhere)."""
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
        # The parameters last measured and which of their gradients were non-finite, read to
        # the host only to name them at a violation.
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._index: tuple[tuple[int, ...], torch.Tensor] | None = None  # (which, as a tensor)
        self._square: torch.Tensor | None = None  # this rank's squared total, for the read
        self._group: Any = None  # the shards' group, when the gradients are sharded
        self._one = torch.ones((), dtype=torch.float64, device=flags.device)

    def measure(self) -> None:
        """Device ops only: a parameter without a gradient (frozen, unused) is not counted."""
        found, grads_, group, ds = [], [], None, None
        for i, p in enumerate(self.params):
            if is_zero(p):  # ZeRO's slice of it, wherever its buffers keep it
                g, ds = partition_grad(p), ds or owner(p)
                group = group or zero_group(p)
            else:
                g = p.grad
            if g is None:
                continue
            if dtensor_of(g) is not None:
                g, g_group = _local(g)
                group = group or g_group
            found.append(i)
            grads_.append(g)
        if not found:
            return
        # DeepSpeed's fp16 with a dynamic loss scale skips every update whose gradients
        # overflow, as a GradScaler does: its business, a skipped update, not a violation.
        # Its gradients are still scaled here (it unscales inside its step).
        scaled = self.scaled or getattr(ds, "dynamic_loss_scale", False) is True
        scale = getattr(ds, "loss_scale", 1.0)  # a Python number (a host value already)
        unscale = scale if isinstance(scale, int | float) and scale > 0 else 1.0
        f = self.flags
        with torch.no_grad(), one_thread(f.device):
            # One 0-dim float32 norm per gradient (a float16 norm would overflow at 65504).
            norms = torch._foreach_norm(grads_, 2, dtype=torch.float32)
            n = torch.stack(norms) if all(x.device == f.device for x in norms) else \
                torch.stack([x.to(f.device) for x in norms])  # (k,)
            if unscale != 1.0:
                n = n / unscale
            bad = torch.isfinite(n).logical_not()
            if scaled:
                f.put(grads.SKIPPED, bad.any())
                f.put(grads.WATCHED, 1.0)
            else:
                f.put(nonfinite.GRAD, bad.sum())
                f.put(nonfinite.GRAD_SEEN, 1.0)
            which = self._which(tuple(found))
            self._last = (which, bad)  # named only at a violation (`named_bad`)
            square = n.double().square()  # (k,): float64, no overflow from float32 norms
            top = square.nan_to_num(nan=torch.inf).argmax()
            self._square, self._group = square.sum(), group
            # The last step's figures, in one write (a NaN share is no figure: the record's).
            f.overwrite(_FIGURES, torch.stack([self._one, self._square.sqrt(), which[top],
                                                square[top] / self._square]))

    def named_bad(self) -> torch.Tensor:
        """(P,) on the flags' device: 1 where the last measured gradient was non-finite."""
        out = torch.zeros(len(self.params), device=self.flags.device)
        if self._last is not None:
            which, bad = self._last
            out.index_copy_(0, which, bad.to(out.dtype))
        return out

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
