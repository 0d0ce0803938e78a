"""The gradients DeepSpeed's ZeRO keeps out of `param.grad`: after the backward, stage 2 and 3
reduce each gradient into their own buffers (and free `.grad`), stage 1 at the step, so the
gradient the update applies is found through DeepSpeed's own mapping of each parameter: under
ZeRO-3 the fp32 gradient of this rank's partition (`_z3_optimizer.
get_local_fp32_grad_for_param`), under ZeRO-1/2 the fragment of the reduced gradient that
this rank's partition holds (`_hp_mapping.get_lp_grad_fragment`, what DeepSpeed's
`safe_get_full_grad` reads). Each rank holds a slice of each gradient, so the total norm needs
the squares of every rank (one all-reduce over the partition's group, guard/device/grads.py).
Nothing here imports DeepSpeed: a parameter is ZeRO's by the attributes DeepSpeed gives it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_zero", "owner", "partition_grad", "zero_group"]


def is_zero(p: torch.Tensor) -> bool:
    """A parameter a ZeRO optimizer partitioned (stage 3) or mapped (stage 1/2)."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def owner(p: torch.Tensor) -> Any:
    """The DeepSpeed optimizer that updates `p` (None: none that this rank's part maps)."""
    return getattr(p, "_z3_optimizer", None) or getattr(p, "_zero_optimizer", None)


def zero_group(p: torch.Tensor) -> Any:
    """The process group over which `p`'s partitions (and their gradients) are spread."""
    return getattr(p, "ds_process_group", None) or getattr(p, "_dp_group", None)


def partition_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's slice of the gradient ZeRO will apply to `p`, flat; None when it holds
    none (a ZeRO-1/2 parameter outside this rank's partition, no backward yet, frozen)."""
    if not p.requires_grad:
        return None
    if hasattr(p, "ds_id"):
        z3: Any = getattr(p, "_z3_optimizer", None)
        if z3 is None:
            return None
        try:
            grad: torch.Tensor | None = z3.get_local_fp32_grad_for_param(p)
        except (KeyError, ValueError):  # no gradient buffer yet
            return None
        return grad
    mapping: Any = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        frag: torch.Tensor | None = mapping.get_lp_grad_fragment(p._index_in_param_group)  # type: ignore[attr-defined]
    except (ValueError, KeyError, IndexError):  # "only available after backward"
        frag = None
    if frag is None:
        # Inside ZeRO's step, a group whose turn came has its reduced gradient on the fp32
        # partition itself (found when the guard attached before deepspeed.initialize and
        # the torch optimizer's first call of the update is the boundary).
        flat: Any = getattr(mapping.hp_fragment, "_base", None)
        whole: torch.Tensor | None = getattr(flat, "grad", None)
        if whole is None:
            return None
        at = mapping.hp_fragment_address
        return whole.reshape(-1).narrow(0, at.start, at.numel)
    frag = frag.reshape(-1)
    if frag.numel() == p.numel() and mapping.lp_fragment_address.numel != p.numel():
        # A whole-parameter buffer (DeepSpeed's bf16 optimizer): only this rank's fragment
        address = mapping.lp_fragment_address
        frag = frag.narrow(0, address.start, address.numel)
    return frag
