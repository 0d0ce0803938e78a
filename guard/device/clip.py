"""The loop's gradient clip, tapped while a guard is attached (in the loop's step, between its
backward and the optimizer's step). Clipping by a total norm that is NaN spreads the NaN to
every gradient, so by the optimizer's step the parameter where it was born can no longer be
told. torch's total norm (`torch.nn.utils.get_total_norm`; `clip_grad_norm_` calls it, and so
do accelerate, the HF Trainer through accelerate, Lightning's `gradient_clip_val` and
torchtitan) is computed here exactly as torch computes it (the same grouping, the same
per-gradient norms, the same total), and its per-gradient norms, taken before the clip scales
anything, go to each attached guard (guard/device/grads.py) in place of a second read of the
gradients. Where the guard's boundary comes first (Lightning's `on_before_optimizer_step`) and
the clip asks for the norms of the gradients the guard just read, unchanged, the clip takes
the guard's. Either way one read of the gradients a step. Device ops only; anything else
(another norm, `error_if_nonfinite=True`, a DTensor or other tensor subclass, a device without
foreach support under `foreach=True`) goes to torch's own function unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.utils as nn_utils
from torch.nn.utils import clip_grad
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from guard.device.hooks import Handle, wrap_call

__all__ = ["Clipped", "tap"]

# The two names torch's total norm goes by: `clip_grad_norm_` looks up the first at each call,
# accelerate and torchtitan the second.
_BINDINGS = ((clip_grad, "_get_total_norm"), (nn_utils, "get_total_norm"))


class Clipped(Protocol):
    """An attached guard's gradient norms: what the clip hands them."""

    def clipped(self, grads: Sequence[torch.Tensor], norms: Sequence[torch.Tensor]) -> None:
        """`norms[k]`: the 2-norm of `grads[k]` (0-dim, its dtype), before any clip."""

    def known(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per gradient, its 2-norm as the guard's boundary read it this step, if unchanged
        since (None: not read, or changed)."""


_LISTENING: list[Clipped] = []
_WRAPPED: list[Handle] = []


class _Tap:
    def __init__(self, norms: Clipped) -> None:
        self._norms: Clipped | None = norms

    def remove(self) -> None:
        """Idempotent; the last guard to leave puts torch's functions back."""
        if self._norms is None:
            return
        _LISTENING.remove(self._norms)
        self._norms = None
        if not _LISTENING:
            for h in _WRAPPED:
                h.remove()
            _WRAPPED.clear()


def tap(norms: Clipped) -> Handle:
    """`norms` hears every total norm torch computes until the handle is removed."""
    if not _WRAPPED:
        _WRAPPED.extend(wrap_call(owner, name, total_norm) for owner, name in _BINDINGS)
    _LISTENING.append(norms)
    return _Tap(norms)


def _foreach(group: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's own choice in `get_total_norm`."""
    return (foreach is None and _has_foreach_support(group, device)) or \
        (foreach is True and _device_has_foreach_support(device))


def _groups(ts: list[torch.Tensor]) -> list[tuple[torch.device, list[torch.Tensor], list[int]]]:
    """torch's grouping by device and dtype, in its order: (device, tensors, their indices)."""
    grouped = _group_tensors_by_device_and_dtype([ts], with_indices=True)  # type: ignore[list-item]
    return [(device, cast(list[torch.Tensor], group), at)
            for (device, _), ([group], at) in grouped.items()]


def _known(ts: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per tensor, its norm as a guard read it at this step's boundary, where unchanged since."""
    per: list[torch.Tensor | None] = [None] * len(ts)
    for listener in _LISTENING:
        for k, n in enumerate(listener.known(ts)):
            if per[k] is None and n is not None:
                per[k] = n.to(ts[k].dtype)  # torch's norm is in the gradient's dtype
    return per


def total_norm(original: Callable[..., torch.Tensor], tensors: Any, norm_type: Any = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch's `get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)`, the same
    numbers: its per-tensor 2-norms handed to the guards listening, or, where a guard's step
    boundary came before the clip (Lightning's) and read these very gradients unchanged, taken
    from that read instead of a second one."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if (not _LISTENING or norm_type != 2 or error_if_nonfinite or not ts
            or any(type(t) is not torch.Tensor for t in ts)):
        return original(ts, norm_type, error_if_nonfinite, foreach)
    groups = _groups(ts)
    if any(foreach and not _foreach(group, device, foreach) for device, group, _ in groups):
        return original(ts, norm_type, error_if_nonfinite, foreach)  # torch raises
    with torch.no_grad():
        known = _known(ts)
        per: list[torch.Tensor] = []
        if all(n is not None for n in known):
            per = cast(list[torch.Tensor], known)
        else:
            per = list(ts)  # overwritten: per[k] is ts[k]'s norm
            for device, group, at in groups:
                norms = list(torch._foreach_norm(group, 2.0)) \
                    if _foreach(group, device, foreach) else \
                    [torch.linalg.vector_norm(g, 2.0) for g in group]
                for k, n in zip(at, norms, strict=True):
                    per[k] = n
            for listener in tuple(_LISTENING):
                listener.clipped(ts, per)
        order = [per[k].to(ts[0].device) for _, _, at in groups for k in at]  # torch's order
        total: torch.Tensor = torch.linalg.vector_norm(torch.stack(order), 2.0)
    return total
