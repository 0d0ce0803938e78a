"""Label smoothing over the real columns: the HF Trainer's `label_smoother` (TRL's SFTTrainer
uses the same one), replaced by `guard_trainer` at train begin under `padding_mass: mask`.

The Trainer's LabelSmoother averages -log_softmax over every column of the logits; under the
mask the padding columns are -inf there, so that loss is +inf, and unmasked it teaches the
model to give ghost ids probability. The right loss is the same smoothing over the real columns
`logits[..., :real]`: what a head without padding rows would train on. The wrapper also hands
the labels, which the Trainer takes from the inputs before the model sees them, to the guard's
label checks, and the loss it returns (the one the Trainer backpropagates) to the guard, in the
training step (under grad; evaluation computes losses too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import guard

__all__ = ["RealColumnsSmoother", "refused"]


class RealColumnsSmoother:
    """`smoother(model_output, labels, shift_labels=, num_items_in_batch=)` over the logits'
    first `real` columns, its labels checked and its loss recorded by `g` (`g.loss_fn`)."""

    def __init__(self, smoother: Callable[..., Any], real: int, g: guard.Guard) -> None:
        self.smoother, self.real = smoother, real
        # The Trainer and TRL read these two off its label_smoother.
        self.epsilon = getattr(smoother, "epsilon", None)
        self.ignore_index = getattr(smoother, "ignore_index", -100)
        self._options: dict[str, Any] = {}
        self._guarded = g.loss_fn(self._loss)

    def __call__(self, model_output: Any, labels: torch.Tensor, shift_labels: bool = False,
                 **kwargs: Any) -> Any:
        self._options = {"shift_labels": shift_labels, **kwargs}
        try:
            return self._guarded(model_output, labels)
        finally:
            self._options = {}

    def _loss(self, model_output: Any, labels: Any) -> Any:
        logits = model_output["logits"] if isinstance(model_output, dict) else model_output[0]
        # A tuple: the LabelSmoother takes its [0] as the logits.
        return self.smoother((logits[..., :self.real],), labels, **self._options)


def refused(smoothing: float, rows: int, real: int, bare: bool) -> str:
    """Why a Trainer's label smoothing over a head with padding rows is refused (`bare`: the
    callback was given as callbacks=[...])."""
    why = ("given as callbacks=[...], the callback cannot reach the Trainer's label smoother: "
           "put it on with guard_trainer(trainer, ...), which smooths over the real columns "
           "under padding_mass: mask" if bare else
           "the guard smooths over the real columns only under padding_mass: mask, on a head "
           "that is not vocab-parallel")
    return (f"GuardCallback: label_smoothing_factor={smoothing:g} smooths over all {rows} "
            f"columns of the logits, the {rows - real} padding columns [{real}, {rows}) "
            "included: under the mask their -inf makes the loss +inf (the Trainer logs it as "
            "0.0), without it training teaches the model to give ghost ids probability; "
            f"{why}. Or set label_smoothing_factor=0 and smooth in the model's own loss over "
            f"the real columns logits[..., :{real}] (docs/integrations.md)")
