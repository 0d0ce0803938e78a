"""A model that is never trained but whose log-probabilities enter the loss (DPO's reference,
a distillation teacher), masked as the trained model is: the padding columns [real, rows) of
its head get -inf in every forward, fused ones included, until `remove()`.

Over hot padding rows its softmax gives them probability, so with the policy masked and the
reference not, DPO's rewards (`beta * (log pi - log ref)`) are off by their difference even
where the policy equals the reference. No check runs on it: its head's output gets the mask's
-inf on the padding columns, and a fused forward (`fused_lm_head=True`, TRL's) reads the head's
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

__all__ = ["FrozenMask", "mask_frozen"]


class FrozenMask:
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


def mask_frozen(model: nn.Module, vocab_size: int) -> FrozenMask:
    """Mask the padding columns [vocab_size, rows) of a model that is not trained (no hook of a
    check, no read): `.remove()` takes the mask off."""
    return FrozenMask(model, vocab_size)
