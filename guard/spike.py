"""The loss_spike check: a loss far above the mean of its recent history, decided on the device.

Rule (defaults from `checks.loss_spike`): at each step boundary where a loss is known, with
`ref` the mean of the accepted losses among the last `window` (100) boundaries,

    spike  <=>  at least `warmup` (10) accepted losses
                and loss > factor * ref          (factor 10)
                and loss - ref > min_delta       (1.0, in the loss's units: nats per token)
                and ref > 0 and loss finite.

A non-finite loss is neither a spike nor history: it is the `nonfinite` check's business. A
spike enters the history clipped to `factor * ref`, so one huge loss cannot hide the next
ones for a whole window, while a lasting change of level still moves the mean (no livelock
with `skip`). Everything stays on the device: the history is a (window,) ring buffer written
at a position the host counts, and the decision lands in the flags (Slot.SPIKE, SPIKE_RATIO)
that the host reads at its next read boundary. See docs/loss_spike.md for the comparison with
Megatron-LM, llm-foundry and Lightning.
"""

from __future__ import annotations

import torch

__all__ = ["SpikeTracker", "loss_spike"]


def loss_spike(
    loss: torch.Tensor,
    history: torch.Tensor,
    accepted: torch.Tensor,
    *,
    factor: float,
    min_delta: float,
    warmup: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(spike bool, loss / ref or 0, ref), all 0-dim, for a 0-dim `loss` against `history`.

    `history` (window,) holds past losses, `accepted` (window,) bool says which slots count.
    """
    count = accepted.sum()
    ref = torch.where(accepted, history, 0.0).sum() / count.clamp(min=1)
    usable = (count >= warmup) & torch.isfinite(loss) & (ref > 0)
    spike = usable & (loss > factor * ref) & (loss - ref > min_delta)
    # where() also evaluates the division where ref == 0; its inf/nan is discarded.
    ratio = torch.where(usable, loss / ref, 0.0)
    return spike, ratio, ref


class SpikeTracker:
    """The running history of one rank's losses, kept on the flags' device."""

    def __init__(self, *, window: int, factor: float, min_delta: float, warmup: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.factor, self.min_delta, self.warmup = factor, min_delta, warmup
        self.history = torch.zeros(window, dtype=dtype, device=device)  # (window,)
        self.accepted = torch.zeros(window, dtype=torch.bool, device=device)  # (window,)
        self.seen = 0  # losses folded so far: a host count, so the write position needs no read

    def follow(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move with the flags when the model moved after attach."""
        if device != self.history.device or dtype != self.history.dtype:
            self.history = self.history.to(device=device, dtype=dtype)
            self.accepted = self.accepted.to(device=device)

    def update(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Test `loss` against the history, then add it; returns (spike 0/1, ratio)."""
        x = loss.detach().to(device=self.history.device, dtype=self.history.dtype).reshape(())
        spike, ratio, ref = loss_spike(x, self.history, self.accepted, factor=self.factor,
                                       min_delta=self.min_delta, warmup=self.warmup)
        finite = torch.isfinite(x)
        kept = torch.where(spike, self.factor * ref, x)
        i = self.seen % self.history.shape[0]
        self.history[i] = torch.where(finite, kept, 0.0)
        self.accepted[i] = finite
        self.seen += 1
        return spike.to(self.history.dtype), ratio
