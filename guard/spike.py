"""The loss_spike check: a loss far above the median of its recent history, on the device.

Rule (defaults from `checks.loss_spike`): at each step boundary where a loss is known, with
`ref` the median of the finite losses among the last `window` (100) boundaries,

    spike  <=>  at least `warmup` (10) finite losses in the window
                and loss > factor * ref          (factor 10)
                and loss - ref > min_delta       (1.0, in the loss's units: nats per token)
                and ref > 0 and loss finite.

The median, unlike the mean, is not pulled up by the tail of the early fast descent (the
seed's spike is caught one step earlier) nor by an earlier spike, so spikes enter the history
as they are; a lasting change of level becomes the median after window / 2 boundaries, so
`skip` cannot drop steps forever. A non-finite loss is neither a spike nor history: it is the
`nonfinite` check's business. Everything stays on the device: the history is a (window,) ring
buffer written at a position the host counts, and the decision lands in the flags
(Slot.SPIKE, SPIKE_RATIO) read at the next read boundary. docs/loss_spike.md compares the rule
with Megatron-LM's, llm-foundry's and Lightning's on synthetic loss curves.
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(spike bool, loss / ref or 0), both 0-dim, for a 0-dim `loss` against `history`.

    `history` (window,) holds past losses, `accepted` (window,) bool says which slots count.
    """
    count = accepted.sum()
    # The dim= form: without it, older torch reads the NaN count to the host on CUDA.
    ref = torch.nanmedian(torch.where(accepted, history, float("nan")), dim=0).values  # nan if none
    usable = (count >= warmup) & torch.isfinite(loss) & (ref > 0)
    spike = usable & (loss > factor * ref) & (loss - ref > min_delta)
    # where() also evaluates the division where ref == 0; its inf/nan is discarded.
    ratio = torch.where(usable, loss / ref, 0.0)
    return spike, ratio


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
        spike, ratio = loss_spike(x, self.history, self.accepted, factor=self.factor,
                                  min_delta=self.min_delta, warmup=self.warmup)
        finite = torch.isfinite(x)
        i = self.seen % self.history.shape[0]
        self.history[i] = torch.where(finite, x, 0.0)
        self.accepted[i] = finite
        self.seen += 1
        return spike.to(self.history.dtype), ratio
