"""The gradients the optimizer applies, reduced on the device before the update: one
multi-tensor norm (`torch._foreach_norm`, a fused kernel per device and dtype on a GPU) gives
each parameter's gradient norm, and from those few numbers come the parameters whose
gradient holds a NaN/Inf (a non-finite norm: the test of `clip_grad_norm_(error_if_nonfinite=
True)`, which also counts a norm that overflows), the total norm and the largest parameter's
share of it. No host read; sharded by FSDP2 or DeepSpeed's ZeRO (whose gradients live in its
own buffers: guard/device/zero_grads.py), each rank reduces its shards and the total norm takes
one all-reduce (SUM) of one number at the read. Where the loop clips (guard/device/clip.py),
the norms are the clip's, taken before it spread a NaN to every gradient, and no gradient is
read twice: the clip's norms serve the check, or the check's the clip."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from guard.checks import grads, nonfinite
from guard.device.flags import Flags
from guard.device.ops import not_finite, one_thread
from guard.device.zero_grads import is_zero, owner, partition_grad, zero_group
from guard.tensors import dtensor_of

__all__ = ["GradNorms"]


class _Clip(NamedTuple):
    which: tuple[int, ...]  # the parameters, as indices into GradNorms.params
    # Each one's gradient (not kept alive: a step the optimizer skips frees it as usual) and
    # its version at the clip.
    kept: list[tuple[weakref.ref[torch.Tensor], int]]
    norms: torch.Tensor  # (k,) float32 on the flags' device, before the clip scaled them

_CLIPS = 8  # clips kept for a boundary: a loop clips once a step, a few per param group
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
        # What the loop's clip measured this step (guard/device/clip.py), one entry a clip:
        # the parameters, their gradients and those's versions then, the norms (k,) float32.
        self._clips: list[_Clip] = []
        # What this step's measure read itself, for a clip after the boundary (Lightning's):
        # per gradient (by id) its weak reference, its version then and its place in the norms.
        self._read: tuple[dict[int, tuple[weakref.ref[torch.Tensor], int, int]],
                          torch.Tensor] | None = None

    def known(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per gradient, its float32 2-norm as this step's `measure` read it, where unchanged
        since (None: not read, or changed). Host bookkeeping and views only."""
        if self._read is None:
            return [None] * len(grads)
        at, n = self._read
        out: list[torch.Tensor | None] = []
        for g in grads:
            e = at.get(id(g))
            out.append(n[e[2]] if e is not None and e[0]() is g and g._version == e[1]
                       else None)
        return out

    def clipped(self, grads: Sequence[torch.Tensor], norms: Sequence[torch.Tensor]) -> None:
        """The loop's clip measured `grads` (norms before it scaled them): kept for this
        step's `measure`, which reads no gradient twice. Device ops only."""
        at = {id(g): k for k, g in enumerate(grads)}
        which, kept, mine = [], [], []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and (k := at.get(id(g))) is not None:
                which.append(i)
                kept.append((weakref.ref(g), g._version))
                mine.append(norms[k].to(self.flags.device))
        if which:
            n = torch.stack(mine).to(torch.float32)  # (k,)
            self._clips.append(_Clip(tuple(which), kept, n))
            del self._clips[:-_CLIPS]  # a loop that never reaches a boundary keeps a few

    def _from_clips(self) -> tuple[list[int], list[torch.Tensor]]:
        """The parameters whose norms the clips of this step give, and those norms: a clip
        counts if every gradient it measured is still the parameter's, changed since by the
        clip's one in-place scaling at most, and none was counted by an earlier clip."""
        found: list[int] = []
        norms: list[torch.Tensor] = []
        for c in self._clips:
            if all((g := r()) is not None and self.params[i].grad is g and g._version - v <= 1
                   for i, (r, v) in zip(c.which, c.kept, strict=True)) \
                    and not set(c.which) & set(found):
                found += c.which
                norms.append(c.norms)
        self._clips = []  # this step's, used once
        return found, norms

    def measure(self) -> None:
        """Device ops only: a parameter without a gradient (frozen, unused) is not counted."""
        clipped, from_clips = self._from_clips()
        found, grads_, group, ds = [], [], None, None
        taken = set(clipped)
        for i, p in enumerate(self.params):
            if i in taken:
                continue
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
        if not found and not clipped:
            return
        # DeepSpeed's fp16 with a dynamic loss scale skips every update whose gradients
        # overflow, as a GradScaler does: its business, a skipped update, not a violation.
        # Its gradients are still scaled here (it unscales inside its step).
        scaled = self.scaled or getattr(ds, "dynamic_loss_scale", False) is True
        scale = getattr(ds, "loss_scale", 1.0)  # a Python number (a host value already)
        unscale = scale if isinstance(scale, int | float) and scale > 0 else 1.0
        f = self.flags
        with torch.no_grad(), one_thread(f.device):
            mine = self._norms(grads_, unscale) if grads_ else None
            parts = [*from_clips, *([] if mine is None else [mine])]
            # Read here from the gradients as they are: a clip after this boundary takes them.
            self._read = None if mine is None or group is not None or ds is not None else \
                ({id(g): (weakref.ref(g), g._version, j) for j, g in enumerate(grads_)}, mine)
            n = parts[0] if len(parts) == 1 else torch.cat(parts)  # (k,)
            bad = not_finite(n)
            if scaled:
                f.put(grads.SKIPPED, bad.any())
                f.put(grads.WATCHED, 1.0)
            else:
                f.put(nonfinite.GRAD, bad.sum())
                f.put(nonfinite.GRAD_SEEN, 1.0)
            which = self._which((*clipped, *found))
            self._last = (which, bad)  # named only at a violation (`named_bad`)
            square = n.double().square()  # (k,): float64, no overflow from float32 norms
            top = square.nan_to_num(nan=torch.inf).argmax()
            self._square, self._group = square.sum(), group
            # The last step's figures, in one write (a NaN share is no figure: the record's).
            # take(): one op each, where indexing with a 0-dim tensor reads it to the host
            # on the CPU (an item() and a select).
            f.overwrite(_FIGURES, torch.stack([self._one, self._square.sqrt(), which.take(top),
                                                square.take(top) / self._square]))

    def _norms(self, grads_: list[torch.Tensor], unscale: float) -> torch.Tensor:
        """(k,) float32 on the flags' device: the gradients the clip did not measure."""
        device = self.flags.device
        # One 0-dim float32 norm per gradient (a float16 norm would overflow at 65504).
        norms = torch._foreach_norm(grads_, 2, dtype=torch.float32)
        n = torch.stack(norms) if all(x.device == device for x in norms) else \
            torch.stack([x.to(device) for x in norms])
        return n / unscale if unscale != 1.0 else n

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
