"""DeepSpeed's optimizers as the step boundary. A ZeRO optimizer's `step()` is one update, and
it calls the torch optimizer's `step()` once per parameter group (stage 1/2, with
`param_groups` swapped to that group) or per sub-group (stage 3, with the group's params put
in and taken out around each call), so the torch optimizer's step pre-hook would count one
update as several steps, read the gradients of one group only, and skip part of an update.
The guard wraps the DeepSpeed optimizer's own `step` instead (guard/device/hooks.py
`wrap_step`): its boundary runs once, before any group is updated, and the torch optimizer's
calls inside it are part of that step: under `skip` each drops its group's update, so the
whole update is dropped on every rank.

Found among the wrappers of attach's `optimizer=` (accelerate's DeepSpeedOptimizerWrapper, the
engine's `.optimizer`) or, where the guard attached before `deepspeed.initialize`, at the
first training forward after it, from DeepSpeed's back-reference on the model's parameters
(ZeRO-3's `_z3_optimizer`). ZeRO-1/2 leave none (but under CPU offload): there the torch
optimizer's own step calls tell the update, as of any wrapper that steps copies of its own
(its param_groups hold none of the model's parameters): the first call of an update is its
boundary, and the calls after it, until the next training forward, belong to it. DeepSpeed is
never imported here: the class is looked up in `sys.modules`."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from guard.device.hooks import Handle, wrap_step
from guard.device.zero_grads import is_zero, owner
from guard.step.skip import drop_update

__all__ = ["OuterStep", "deepspeed_of", "is_deepspeed"]

log = logging.getLogger("guard")


def is_deepspeed(obj: object) -> bool:
    """One of DeepSpeed's optimizer wrappers (ZeRO 1-3, its fp16 and bf16 optimizers)."""
    base = getattr(sys.modules.get("deepspeed.runtime.base_optimizer"), "DeepSpeedOptimizer",
                   None)
    return isinstance(base, type) and isinstance(obj, base)


def deepspeed_of(model: nn.Module) -> object | None:
    """The DeepSpeed optimizer that updates `model`'s parameters on this rank (None: none
    that left a back-reference on them)."""
    for p in model.parameters():
        found: object = owner(p)
        if found is not None and is_deepspeed(found):
            return found
    return None


def _steps_copies(opt: torch.optim.Optimizer, model: frozenset[int]) -> bool:
    """`opt` steps tensors that are not the model's parameters (a wrapper swapped its own
    copies in: ZeRO's flat fp32 partitions, or no parameter at all between its calls)."""
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    return first is None or id(first) not in model


class OuterStep:
    """One update of a DeepSpeed optimizer, however often it calls the torch optimizer's step:
    `tick` (the clock's) runs once, before it; True from it drops the update."""

    def __init__(self, tick: Callable[..., bool]) -> None:
        self._tick = tick
        self.bound: object | None = None
        # The ids of the model's parameters, where a wrapper may step copies of its own (set
        # where DeepSpeed is loaded and no DeepSpeed optimizer was found at attach).
        self.model: frozenset[int] | None = None
        self._looked = False  # for a back-reference, once the model's parameters were ZeRO's
        self.handles: list[Handle] = []
        self._inside = False
        self._drop = False

    def bind(self, optimizer: object) -> None:
        self.bound = optimizer
        self.handles.append(wrap_step(optimizer, self._step))

    def unbind(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def within(self, opt: torch.optim.Optimizer) -> bool:
        """The torch optimizer's step pre-hook: True when this call is part of the update
        under way (not a step of its own); dropped with it under `skip` (skip.drop_update), so
        neither this group's fp32 partition nor its moments move (DeepSpeed then copies the
        unchanged partition back)."""
        if not self._inside:
            if self.bound is not None or self.model is None or \
                    not _steps_copies(opt, self.model):
                return False
            # No wrapper known, but one steps its own copies: this first call of the update
            # is its boundary (the gradients read before any group moves), and the calls
            # until the next training forward are part of it.
            self._drop = self._tick(in_step=True)
            self._inside = True
        if self._drop:
            drop_update(opt)
        return True

    def late(self, model: nn.Module, *, hooked: bool) -> bool:
        """At a training forward: True when a DeepSpeed optimizer, made after the attach, was
        found updating `model` now and its step is the boundary from here on. Until then the
        update of an unknown wrapper's calls is over at each forward. `hooked`: the torch
        optimizer's step is hooked (it tells ZeRO-1/2's updates without a back-reference)."""
        if self.bound is not None:
            return False
        self._inside = self._drop = False
        first = next(model.parameters(), None)
        if first is None or not is_zero(first) or self._looked:
            return False
        self._looked = True  # once: ZeRO-1/2 leave no back-reference, and never will
        if (found := deepspeed_of(model)) is None:
            if not hooked:
                log.warning(
                    "DeepSpeed's ZeRO took over this model after the attach, and the "
                    "guard has no optimizer to find its updates by: each training forward is "
                    "a step and the gradients go unread. Attach after deepspeed.initialize, "
                    "to the engine (guard.attach(engine, ...)), or pass optimizer= the torch "
                    "optimizer given to initialize")
            return False
        log.info("%s updates this model now (deepspeed.initialize after attach): its "
                 "step is the step boundary", type(found).__name__)
        self.bind(found)
        return True

    def _step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._inside:  # a step that calls itself: one update still
            return step(*args, **kwargs)
        # The boundary, before any group is updated: the gradients of every group are read
        # in one pass, `fail` raises here with the weights and the moments untouched.
        closure = len(args) > 0 or kwargs.get("closure") is not None
        self._drop = self._tick(in_step=True, closure=closure)
        self._inside = True
        try:
            return step(*args, **kwargs)
        finally:
            self._inside = self._drop = False
