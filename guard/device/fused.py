"""A fused LM head that reads the head's weight: the mask cannot reach its logits, so the guard
hands it the real rows instead. TRL's trainers (SFT, DPO, GRPO, RLOO, KTO: trl/trainer/utils.py
`add_fused_lm_head`) call `model(..., fused_lm_head=True)`, whose forward projects the hidden
states through `self.get_output_embeddings().weight` in tiles and returns per-token
log-probabilities: a softmax over every row, padding included. While such a forward runs under
`mask`, the model's `get_output_embeddings()` returns the head's real rows `[0, real)` (a view:
no copy, gradient to the real rows only). A softmax over the real rows is exactly the masked
one: padding at -inf takes no probability and no gradient."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from guard.override import Override, override
from guard.vocab.discover import Heads

__all__ = ["FUSED_KWARG", "FusedHead", "RealRows"]

# The keyword by which TRL asks the model's forward for its fused LM head.
FUSED_KWARG = "fused_lm_head"


class RealRows:
    """What the fused forward reads of its head: `weight` and `bias`, cut to the real rows."""

    def __init__(self, head: nn.Module, real: int) -> None:
        weight = cast(torch.Tensor, head.weight)  # discovery found a 2-D weight
        bias = getattr(head, "bias", None)
        self.weight = weight[:real]  # (real, d): a view of the parameter
        self.bias = bias[:real] if isinstance(bias, torch.Tensor) else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight, self.bias)


def _gives(module: nn.Module, head: nn.Module) -> bool:
    getter = getattr(type(module), "get_output_embeddings", None)
    if not callable(getter):
        return False
    try:
        return cast(Any, module).get_output_embeddings() is head
    except (NotImplementedError, AttributeError):
        return False


class FusedHead:
    """The modules whose `get_output_embeddings()` gives the head (the HF model, under PEFT the
    base model too), and the real rows they give instead while a fused forward runs."""

    def __init__(self, model: nn.Module, heads: Heads, real: int) -> None:
        self.head, self.real = heads.head_holder, real
        self.owners = [m for m in model.modules() if _gives(m, heads.lm_head)]
        self.active = False
        self._overrides: list[Override] = []

    @staticmethod
    def asked(kwargs: dict[str, Any]) -> bool:
        """This forward computes its loss through the fused head."""
        return kwargs.get(FUSED_KWARG) is True

    def on(self) -> None:
        """For this forward, the owners give the real rows (an instance attribute over the
        class's method)."""
        rows = RealRows(self.head, self.real)
        self._overrides += [override(m, "get_output_embeddings", lambda rows=rows: rows)
                            for m in self.owners]
        self.active = True

    def off(self) -> None:
        """The owners give the head again; idempotent (the model's forward hook and detach)."""
        while self._overrides:  # the last first: each puts back what the one before left
            self._overrides.pop().remove()
        self.active = False

    def remove(self) -> None:  # a Handle: detach puts everything back
        self.off()
