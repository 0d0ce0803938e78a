"""The loss of the current step, held on the device until the step's boundary folds it into
the flags: its value, its non-finite count and the loss-spike test."""

from __future__ import annotations

import weakref

import torch

from guard.checks import nonfinite_count
from guard.flags import Flags, Slot
from guard.spike import SpikeTracker

__all__ = ["StepLoss"]


class StepLoss:
    """Which loss a step reports: the model's output, or what g.step(loss) gives instead."""

    def __init__(self, flags: Flags, *, count_nonfinite: bool,
                 spike: SpikeTracker | None) -> None:
        self.flags = flags
        self.count_nonfinite = count_nonfinite
        self.spike = spike
        # Set by integrations whose model loss is one micro-batch's share of the step's loss
        # (HF Trainer normalising by the tokens of the whole accumulation window): the step's
        # loss is then the sum of its shares, times `scale` (the world size when tokens are
        # averaged across devices). Default: the last micro-batch's loss.
        self.sum_shares = False
        self.scale = 1.0
        self._value: torch.Tensor | None = None  # detached
        self._src: torch.Tensor | None = None  # the tensor it came from
        self._given = False  # it came from g.step(loss)
        self._folded: weakref.ref[torch.Tensor] | None = None  # the last step's loss

    def record(self, loss: torch.Tensor, *, given: bool = False) -> None:
        """A loss seen in this step. A second output loss is a gradient-accumulation
        micro-batch: the earlier one is counted for nonfinite. The same tensor seen twice
        (the model's loss fed to g.step, before or after optimizer.step()) counts once."""
        if loss is self._src or (self._folded is not None and self._folded() is loss):
            return
        value = loss.detach()
        if self._value is not None and self.sum_shares and not (given or self._given):
            # Shares of one step's loss: a non-finite share makes the sum non-finite.
            self._src, self._value = loss, self._value + value
            return
        # Only g.step(loss) right after the forward replaces (e.g. rescales) its output loss.
        if self._value is not None and (self._given or not given):
            self._count(self._value)
        self._src, self._value, self._given = loss, value, given

    def fold(self) -> None:
        """At the boundary: the step's loss into the flags, on the device."""
        if self._value is None:
            return
        if self._src is not None:
            self._folded = weakref.ref(self._src)
        loss, self._value, self._src, self._given = self._value, None, None, False
        if self.scale != 1.0:
            loss = loss * self.scale
        f = self.flags
        f.follow(loss.device)
        f.set(Slot.LOSS, loss.to(f.t.dtype))
        f.t[Slot.LOSS_SEEN].fill_(1.0)
        self._count(loss)
        if self.spike is not None:
            self.spike.follow(f.device, f.t.dtype)
            spike, ratio = self.spike.update(loss)
            f.max(Slot.SPIKE, spike)
            f.max(Slot.SPIKE_RATIO, ratio)

    def _count(self, loss: torch.Tensor) -> None:
        if self.count_nonfinite:
            self.flags.add(Slot.NF_LOSS, nonfinite_count(loss))
