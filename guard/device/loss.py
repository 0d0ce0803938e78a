"""The loss of the current step, held on the device until the step's boundary folds it into
the flags: its value, its non-finite count and the loss-spike test.

The loss_spike rule (defaults from `checks.loss_spike`): at each step boundary where a loss is
known, with `ref` the median of the finite losses among the last `window` (100) boundaries,

    spike  <=>  at least `warmup` (10) finite losses in the window
                and loss > factor * ref          (factor 10)
                and loss - ref > min_delta       (1.0, in the loss's units: nats per token)
                and ref > 0 and loss finite.

The median, unlike the mean, is not pulled up by the tail of the early fast descent (the
seed's spike is caught one step earlier) nor by an earlier spike, so spikes enter the history
as they are; a lasting change of level becomes the median after window / 2 boundaries, so
`skip` cannot drop steps forever. A non-finite loss is neither a spike nor history: it is the
`nonfinite` check's business. Everything stays on the device: the history is a (window,) ring
buffer written at a position the host counts, and the decision lands in the flags, read at
the next read boundary. docs/loss_spike.md compares the rule with Megatron-LM's,
llm-foundry's and Lightning's on synthetic loss curves.
"""

from __future__ import annotations

import math
import weakref
from typing import Literal, get_args

import torch

from guard.checks import coverage, nonfinite
from guard.checks import loss as step_loss
from guard.checks import loss_spike as spike_check
from guard.device.compile import compiling
from guard.device.dtensors import local
from guard.device.flags import Flags
from guard.device.ops import nonfinite_count, not_finite
from guard.errors import AttachError
from guard.policy import Policy

__all__ = ["LossShares", "SpikeTracker", "StepLoss", "check_loss_options", "loss_spike"]

# How a step's loss is made of the losses its micro-batch forwards return: the last one, their
# sum (HF Trainer's num_items_in_batch: each is its share of the whole window's mean), or their
# mean (accelerate's accumulate(): each is its micro-batch's mean, and the step's loss is the
# window's mean, what accelerate and its users log).
LossShares = Literal["last", "sum", "mean"]


def check_loss_options(shares: str, scale: object) -> None:
    """attach's `loss_shares=` and `loss_scale=`, before anything is built."""
    if shares not in get_args(LossShares):
        raise AttachError(f"loss_shares={shares!r}: expected one of "
                          f"{', '.join(get_args(LossShares))}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) \
            or not math.isfinite(scale) or scale <= 0:
        raise AttachError(f"loss_scale={scale!r}: expected a finite number > 0")


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
    usable = (count >= warmup) & ~not_finite(loss) & (ref > 0)
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
        finite = ~not_finite(x)
        i = self.seen % self.history.shape[0]
        self.history[i] = torch.where(finite, x, 0.0)
        self.accepted[i] = finite
        self.seen += 1
        return spike.to(self.history.dtype), ratio


class StepLoss:
    """Which loss a step reports: the model's output, or what g.step(loss) gives instead."""

    def __init__(self, flags: Flags, *, count_nonfinite: bool, spike: SpikeTracker | None,
                 shares: LossShares = "last", scale: float = 1.0) -> None:
        self.flags = flags
        self.count_nonfinite = count_nonfinite
        self.spike = spike
        self.shares = shares
        self.scale = scale  # the world size when tokens are averaged across devices (HF)
        self._value: torch.Tensor | None = None  # detached
        self._n = 0  # micro-batch losses added into _value (their count, for "mean")
        self._src: torch.Tensor | None = None  # the tensor it came from
        self._given = False  # it came from g.step(loss)
        self._folded: weakref.ref[torch.Tensor] | None = None  # the last step's loss

    @classmethod
    def from_policy(cls, policy: Policy, flags: Flags, *, shares: LossShares = "last",
                    scale: float = 1.0) -> StepLoss:
        ls = policy.checks.loss_spike
        spike = SpikeTracker(window=ls.window, factor=ls.factor, min_delta=ls.min_delta,
                             warmup=ls.warmup, device=flags.device, dtype=flags.t.dtype,
                             ) if policy.enabled("loss_spike") else None
        return cls(flags, count_nonfinite=policy.enabled("nonfinite"), spike=spike,
                   shares=shares, scale=scale)

    @property
    def pending(self) -> bool:
        """A loss was seen in this step and not folded yet."""
        return self._value is not None

    def record(self, loss: torch.Tensor, *, given: bool = False, fallback: bool = False) -> None:
        """A loss seen in this step. A second output loss is a gradient-accumulation
        micro-batch: the earlier one is counted for nonfinite. The same tensor seen twice
        (the model's loss fed to g.step, before or after optimizer.step()) counts once.
        `fallback`: a given loss that counts only when the model's forward gave none."""
        if fallback and self._value is not None and not self._given:
            return
        # Traced (a compiled function that calls the model), the loss is a new tensor of the
        # graph, never one recorded or folded before: reading those there would make dynamo
        # guard on them (a recompile at the next step or micro-batch) and wrap the earlier
        # loss, still alive, as a graph input (a torch warning on its .grad).
        if not compiling() and (loss is self._src or (
                self._folded is not None and self._folded() is loss)):
            return
        value = local(loss).detach()  # loss_parallel's is a replicated DTensor
        if self._value is not None and self.shares != "last" and given == self._given:
            # Shares of one step's loss, all from the forward or all given (a loss function
            # outside the model): a non-finite share makes the sum non-finite.
            self._src, self._value, self._n = loss, self._value + value, self._n + 1
            return
        # Only g.step(loss) right after the forward replaces (e.g. rescales) its output loss.
        if self._value is not None and (self._given or not given):
            self._count(self._value)
        self._src, self._value, self._given, self._n = loss, value, given, 1

    def fold(self) -> None:
        """At the boundary: the step's loss into the flags, on the device."""
        if self._value is None:
            return
        if self._src is not None:
            self._folded = weakref.ref(self._src)
        loss, self._value, self._src, self._given = self._value, None, None, False
        if self.shares == "mean" and self._n > 1:
            loss = loss / self._n
        if self.scale != 1.0:
            loss = loss * self.scale
        f = self.flags
        f.follow(loss.device)
        f.put(step_loss.VALUE, loss.to(f.t.dtype))
        f.put(step_loss.SEEN, 1.0)
        f.mark(coverage.SEEN["loss"])
        self._count(loss)
        if self.spike is not None:
            self.spike.follow(f.device, f.t.dtype)
            spike, ratio = self.spike.update(loss)
            f.put(spike_check.SPIKE, spike)
            f.put(spike_check.RATIO, ratio)

    def _count(self, loss: torch.Tensor) -> None:
        if self.count_nonfinite:
            self.flags.put(nonfinite.LOSS, nonfinite_count(loss))
            if loss.is_floating_point():
                self.flags.put(nonfinite.LOSS_INF, torch.isposinf(loss).sum())
