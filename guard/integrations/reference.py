"""The frozen reference model of DPO-style training (TRL's `ref_model`), masked as the policy
is: put on by `guard_trainer` under `padding_mass: mask` when it is built (so log-probs TRL
precomputes before training are masked too) and again at each train begin; removed by the
callback's `release()`.

The reference's log-probabilities enter the loss (DPO's rewards are `beta * (log pi - log
ref)`): over hot padding rows its softmax gives them probability, so with the policy masked and
the reference not, the rewards are off by their difference even where the policy equals the
reference. No check runs on it (it is never trained): its head's output gets the mask's -inf
on the padding columns, and a fused forward (`fused_lm_head=True`, TRL's) reads the head's
real rows, as the guard does for the policy (guard/device/fused.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.device.fused import FusedHead
from guard.device.hooks import hook
from guard.device.probe import mask_hook
from guard.vocab.discover import discover

__all__ = ["ReferenceMask", "reference_of"]


class ReferenceMask:
    """The padding columns [real, rows) of `model`'s head masked in every forward, fused ones
    included, until `remove()` (nothing where it has no padding rows)."""

    def __init__(self, model: nn.Module, real: int) -> None:
        heads = discover(model)
        self.rows = heads.head_rows
        self.real = real
        self._fused = fused = FusedHead(model, heads, real)
        self._handles: list[RemovableHandle | FusedHead] = [] if real >= self.rows else [
            hook(heads.lm_head, mask_hook(real, self.rows), kind="forward"),
            hook(model, self._fused_on, kind="forward_pre", with_kwargs=True),
            hook(model, self._fused_off, kind="forward"), fused]

    def _fused_on(self, module: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
        if FusedHead.asked(kwargs):
            self._fused.on()

    def _fused_off(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self._fused.off()

    def remove(self) -> None:
        """Every hook off, the head's own rows back; idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []


def reference_of(trainer: Any) -> nn.Module | None:
    """The trainer's reference model (TRL's `ref_model`) unwrapped, or None (none, or the
    policy itself with its adapters off under PEFT, which the policy's guard covers)."""
    ref = getattr(trainer, "ref_model", None)
    accelerator = getattr(trainer, "accelerator", None)
    if ref is not None and accelerator is not None:
        ref = accelerator.unwrap_model(ref)
    model = getattr(trainer, "model", None)
    return ref if isinstance(ref, nn.Module) and ref is not model else None

