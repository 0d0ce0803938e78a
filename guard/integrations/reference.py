"""The frozen reference model of DPO-style training (TRL's `ref_model`), masked as the policy
is (`guard.mask_frozen`, guard/device/frozen.py): put on by `guard_trainer` under
`padding_mass: mask` when it is built (so log-probs TRL precomputes before training are masked
too) and again at each train begin; removed by the callback's `release()`."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["reference_of"]


def reference_of(trainer: Any) -> nn.Module | None:
    """The trainer's reference model (TRL's `ref_model`) unwrapped, or None (none, or the
    policy itself with its adapters off under PEFT, which the policy's guard covers)."""
    ref = getattr(trainer, "ref_model", None)
    accelerator = getattr(trainer, "accelerator", None)
    if ref is not None and accelerator is not None:
        ref = accelerator.unwrap_model(ref)
    model = getattr(trainer, "model", None)
    return ref if isinstance(ref, nn.Module) and ref is not model else None
