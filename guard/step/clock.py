"""The step clock: where a training step ends, and which step's flags each read returns.

A step ends at one of three boundaries, fixed at attach (`steps=`, `optimizer=`):
- `optimizer`: the optimizer's step pre-hook, before the weights change, so `fail` leaves
  them untouched and `skip` can drop the update;
- `manual`: `g.step()`, and nothing else (callbacks that accumulate gradients over several
  forwards; a loop without `optimizer=` switches to it at its first `g.step()`);
- `forward`: each training forward that builds a graph; its boundary runs when the next such
  forward starts (or at detach), not when it ends, so a loop that calls g.step(loss) after
  its first forward is never counted twice.

Every `read_every` boundaries the clock reads the flags; where no check needs to act before
the update (`Policy.host_may_lag`) and the device is a GPU, one step late, so the device never
stalls; so too on every device where the optimizer drops a bad update itself (guard/step/
skip.py: `fail` then raises at the read after the violation). Each reading goes to the reader
(guard/step/reader.py), which returns whether to drop this optimizer step; so do the read at
attach (`start`) and what is left at detach (`finish`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Protocol

import torch
from torch import nn

from guard.device.compile import compiling
from guard.device.hooks import Handle, hook
from guard.device.reading import Reading
from guard.errors import GuardViolation
from guard.policy import Policy
from guard.step.reader import When
from guard.step.skip import Boundary, DeviceSkip, Steps, boundary_of, check_boundaries, drop_update
from guard.step.zero import OuterStep

__all__ = ["Boundary", "Device", "OnRead", "StepClock", "Steps", "boundary_of",
           "check_boundaries"]

log = logging.getLogger("guard")

class Device(Protocol):
    """What the clock needs of the device side (guard/device/probe.py's Probe)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def reads_at_attach(self) -> bool: ...

    def end_step(self, step: int) -> None: ...

    def fold(self) -> None: ...

    def read(self, *, lagged: bool, reduce: bool = True,
             weights: bool = True) -> Reading | None: ...

    def flush(self) -> Reading | None: ...

    def watch_skips(self) -> None: ...

    def skipped_update(self) -> None: ...


class OnRead(Protocol):
    """What the clock hands each reading to (guard/step/reader.py's Reader)."""

    def read(self, reading: Reading, step: int, *, when: When, now: int = 0,
             in_step: bool = False, closure: bool = False, dropped: bool = False) -> bool: ...


class StepClock:
    """Counts steps, reads the flags when due and hands each reading to the reader."""

    def __init__(self, device: Device, reader: OnRead, *, boundary: Boundary,
                 read_every: int = 1, may_lag: bool = False) -> None:
        self._device, self._reader = device, reader
        self.boundary = boundary
        self.read_every = read_every
        self.may_lag = may_lag
        self.step = 0
        self._read_step = 0  # the step whose values a lagged read returns next
        self._pending = False  # forward boundary: a forward ended, its boundary not yet run
        # Optimizer boundary: a parameter the optimizer updates, and whether a backward
        # reached it since the last update (a step the loop then skips still ends here).
        self._watched: torch.Tensor | None = None
        self._backward = False
        # A DeepSpeed optimizer's step is the boundary where one wraps the torch optimizer
        # (guard/step/zero.py): bound at attach, or at the first training forward after a
        # deepspeed.initialize that came after the attach.
        self.outer = OuterStep(self.tick)
        self.skip: DeviceSkip | None = None  # the optimizer drops a bad update on the device

    @classmethod
    def from_policy(cls, policy: Policy, device: Device, reader: OnRead, *,
                    optimizer: torch.optim.Optimizer | None, steps: Steps,
                    outer: object | None = None, skip: DeviceSkip | None = None) -> StepClock:
        clock = cls(device, reader, boundary=boundary_of(optimizer, steps),
                    read_every=policy.cadence.read_every, may_lag=policy.host_may_lag)
        clock.skip = skip
        if outer is not None and steps != "manual":
            clock.boundary = "optimizer"
            clock.outer.bound = outer  # wrapped at install
        return clock

    def install(self, model: nn.Module,
                optimizer: torch.optim.Optimizer | None) -> list[Handle]:
        """The hooks of this clock's boundary (none for `manual`)."""
        late: list[Handle] = []
        if self.outer.bound is None and self.boundary != "manual" and "deepspeed" in sys.modules:
            # deepspeed.initialize may come after the attach (guard/step/zero.py)
            self.outer.model = frozenset(id(p) for p in model.parameters())
            late = [hook(model, self._bind_late, kind="forward_pre", compiled="eager",
                         prepend=True)]
        if self.outer.bound is not None:
            self.outer.bind(self.outer.bound)
            # DeepSpeed's own overflow skip is counted from the gradients (guard/device/grads.py)
            return [] if optimizer is None else [hook(optimizer, self._optimizer_pre,
                                                      kind="step_pre")]
        if self.boundary == "optimizer" and optimizer is not None:
            given = [] if self.skip is None else [hook(optimizer, self._optimizer_post,
                                                       kind="step_post")]
            return [hook(optimizer, self._optimizer_pre, kind="step_pre"), *given,
                    *self._skips(model, optimizer), *late]
        if self.boundary != "forward":
            return late
        # The start may read the flags, so torch.compile must never trace it: it runs eagerly
        # before the compiled frame of a compiled model; inlined into a larger compiled
        # function it costs one graph break. Prepended: the boundary closes the previous step
        # before this forward's hooks add to the flags.
        return [hook(model, self._forward_start, kind="forward_pre", compiled="never",
                     prepend=True),
                hook(model, self._forward_end, kind="forward", compiled="eager"), *late]

    def remove(self) -> None:
        """What the clock put on a DeepSpeed optimizer (the model's hooks are the guard's)."""
        self.outer.unbind()

    def _skips(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Handle]:
        """A loop may skip the optimizer's step after its backward (GradScaler, when it found
        an inf/NaN gradient: the update is the scaler's to drop, no violation); the step still
        ends, when the next training forward starts with the gradients cleared. A backward is
        seen on one parameter the optimizer updates; zero_grad(set_to_none=False) leaves
        zeros, which this cannot tell from an accumulation: there the skipped step's figures
        go with the next one."""
        self._watched = next((p for g in optimizer.param_groups for p in g["params"]
                              if p.requires_grad), None)
        if self._watched is None:
            return []
        self._device.watch_skips()
        return [hook(self._watched, self._backward_ran, kind="grad_accumulated",
                     compiled="eager"),
                hook(model, self._forward_after_skip, kind="forward_pre", compiled="eager",
                     prepend=True)]

    def start(self) -> None:
        """At attach, before any hook: the weights as they are before step 1 (all ranks attach:
        the read's one collective, so every rank repairs or stops alike)."""
        if self._device.reads_at_attach:
            reading = self._device.read(lagged=False)
            if reading is not None:
                self._reader.read(reading, 0, when="attach")

    def mark(self) -> None:
        """`g.step()`: a boundary now; without an optimizer hook, only g.step() marks them
        from now on."""
        if self.boundary == "forward":
            self.boundary, self._pending = "manual", False
        self.tick()

    def resume(self, step: int) -> None:
        """Go on from step `step` of a resumed run (guard/step/resume.py)."""
        self.step = self._read_step = step

    def tick(self, *, in_step: bool = False, closure: bool = False) -> bool:
        """End the current step, read when due; True: drop this update.

        `in_step`: called from the optimizer's step pre-hook, before the weights change.
        """
        self.step += 1
        self._device.end_step(self.step)
        if self.step % self.read_every:
            if self.skip is not None:
                self.skip.hold()
            return False
        # On the CPU a copy to the host is the read itself: nothing to gain from lagging, but
        # where the optimizer drops the update, the read lags on every device alike.
        lagged = self.skip is not None or (self.may_lag and self._device.device.type == "cuda")
        reading = self._device.read(lagged=lagged)
        step = self._read_step if lagged else self.step
        self._read_step = self.step
        if reading is None:
            return False
        return self._read_at_step(reading, step, in_step=in_step and not lagged,
                                  closure=closure)

    def settle(self) -> None:
        """Before a checkpoint's state is taken: the lagged read still queued (the last step's
        window, its collective done when it was queued) read now, so the saved totals hold
        every step taken; the next read starts a new lag."""
        queued = self._device.flush()
        if queued is None:
            return
        self._read_at_step(queued, self._read_step)
        self._read_step = self.step

    def _read_at_step(self, reading: Reading, step: int, *, in_step: bool = False,
                      closure: bool = False) -> bool:
        """A step boundary's read of the window ending at `step`; True: drop this update. A
        fail stops the device-side skips it set (the run ends at the raise)."""
        try:
            return self._reader.read(reading, step, when="step", now=self.step,
                                     in_step=in_step, closure=closure,
                                     dropped=self.skip is not None)
        except GuardViolation:
            if self.skip is not None:
                self.skip.clear()
            raise

    def finish(self, *, raise_late: bool = False) -> None:
        """At detach: the readings still unread, read locally (one rank may detach alone,
        after an exception: a collective the others do not join would hang). `raise_late`: a
        fail in the lagged read still queued (its update dropped on the device, its figures
        all-reduced already) raises, as at the read that would have come next."""
        if self._pending:  # a forward-boundary step that no next forward closed
            self._pending = False
            self.step += 1
            self._device.end_step(self.step)
        else:
            self._device.fold()
        queued = self._device.flush()
        if queued is not None:
            late = raise_late and self.skip is not None
            self._reader.read(queued, self._read_step, when="last" if late else "detach",
                              now=self.step, dropped=self.skip is not None)
        current = self._device.read(lagged=False, reduce=False, weights=False)
        if current is not None and self.step > self._read_step:
            self._reader.read(current, self.step, when="detach", now=self.step)

    # -- boundary hooks ----------------------------------------------------------------------

    def _backward_ran(self, param: torch.Tensor) -> None:
        if not compiling():
            self._backward = True

    def _forward_after_skip(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # A training forward after a backward whose update never came, the gradients cleared
        # since: that step ended without an optimizer step. Traced inside a compiled training
        # step it does nothing (no guard on host state, no read in a graph): there a skipped
        # update's figures go with the next step's.
        if compiling():
            return
        if self._backward and module.training and torch.is_grad_enabled() and \
                self._watched is not None and self._watched.grad is None:
            self._backward = False
            self._device.skipped_update()
            self.tick()

    def _bind_late(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # Attached before deepspeed.initialize: once a DeepSpeed optimizer updates the model,
        # its step is the boundary (the torch optimizer's calls inside it are not steps).
        # Traced inside a compiled training step it does nothing (host state only).
        if compiling():
            return
        if module.training and torch.is_grad_enabled() and \
                self.outer.late(module, hooked=self.boundary == "optimizer"):
            self.boundary, self._pending, self._watched = "optimizer", False, None

    def _optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._backward = False  # this backward's update comes now
        if self.outer.within(opt):  # one group of a DeepSpeed update: its step is the boundary
            return
        # The hook sees step's own args: (optimizer, closure?) and kwargs.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if self.tick(in_step=True, closure=closure is not None):
            drop_update(opt)
        if self.skip is not None:
            self.skip.give(opt)

    def _optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.skip is not None:
            self.skip.take_back(opt)

    def _forward_start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # A step is a training forward that builds a graph: a no_grad forward in train mode
        # (sampling, a probe) is not, or ranks would count steps, and collectives, apart.
        if self._pending and module.training and torch.is_grad_enabled():
            self._pending = False
            self.tick()

    def _forward_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.boundary == "forward" and module.training and torch.is_grad_enabled():
            self._pending = True
