"""Dropping an update: on the host before the step (the gradients cleared), or on the device
(the optimizer's `found_inf`), and which of the two a guard uses (`cadence.fail_read`).

On the device: an optimizer that takes `found_inf` (torch's fused Adam, AdamW, SGD and Adagrad:
`_step_supports_amp_scaling`, the attribute torch.amp.GradScaler drives them by) leaves the
weights and its state as they were when `found_inf` is 1: the fused kernel returns before it
writes, and the step count it added is taken back. At each read the flags' all-reduced
"which slots crossed" (guard/device/flags.py) gives `found_inf` on the device: 1 when a check
whose action is `fail` or `skip` fired on any rank, so every rank drops the same update, and
the host reads the flags one read late, with no sync before the update. A `fail` is sticky:
every update after it is dropped too, until the host raises at the next read. A GradScaler's
own `found_inf` is composed with it (the max of both). Runs in the optimizer's step hooks and
at the read, as device ops only.

Elsewhere (a for-loop or foreach optimizer, a DeepSpeed optimizer, `fail_read: before_update`)
the flags are read before each update, and `drop_update` clears the gradients. Where a step
ends, and what attach's `optimizer=` and `steps=` allow, is said here too (`check_boundaries`).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, get_args

import torch

from guard.device.flags import Flags
from guard.errors import AttachError
from guard.policy import Action, Policy

__all__ = ["Boundary", "DeviceSkip", "Steps", "boundary_of", "check_boundaries", "device_skip",
           "drop_update", "takes_found_inf"]

log = logging.getLogger("guard")


Steps = Literal["auto", "manual"]
Boundary = Literal["optimizer", "manual", "forward"]


def boundary_of(optimizer: object, steps: Steps) -> Boundary:
    """Where a step ends, from attach's `optimizer=` and `steps=`."""
    return "manual" if steps == "manual" else "optimizer" if optimizer is not None else "forward"


def check_boundaries(policy: Policy, optimizer: object, steps: str) -> None:
    """attach's `optimizer=` and `steps=` against each other and the policy, before anything is
    built: `skip` needs the optimizer's step pre-hook; with reads every N steps, `fail` and
    `skip` act at the reads only (a warning)."""
    if steps not in get_args(Steps):
        raise AttachError(f"steps={steps!r}: expected one of {', '.join(get_args(Steps))}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise AttachError(
            f"optimizer= must be a torch.optim.Optimizer (its step pre-hook is the step "
            f"boundary), got {type(optimizer).__name__}; pass the torch optimizer a wrapper "
            "holds (accelerate: wrapper.optimizer), or use guard.integrations")
    if optimizer is not None and steps == "manual":
        raise AttachError("steps='manual' marks steps with g.step() only, but optimizer= makes "
                          "each optimizer step one: give one of them")
    every = policy.cadence.read_every
    if (failing := policy.acting(Action.FAIL)) and every > 1:
        log.warning("with cadence.read_every %d, fail (%s) is decided at the reads only: "
                    "up to %d updates can be applied after a bad step. Use read_every: 1 "
                    "where fail must stop the first one.", every, ", ".join(failing), every - 1)
    if not (skipping := policy.acting(Action.SKIP)):
        return
    if optimizer is None:
        raise AttachError(
            f"checks.{skipping[0]}.action: skip drops the optimizer step, so the guard needs "
            "the optimizer: guard.attach(model, optimizer=opt, ...); or choose fail, warn or off")
    if every > 1:
        log.warning("with cadence.read_every %d, skip drops only the step at which the "
                    "flags are read; the other steps of the window are applied. Use "
                    "read_every: 1 with skip.", every)


def drop_update(opt: torch.optim.Optimizer) -> None:
    """Drop this update before the step: every torch optimizer passes over a parameter whose
    .grad is None, so neither the weight (decoupled weight decay included) nor its state (Adam
    moments and step, SGD momentum) moves, on the for-loop, foreach and fused paths alike."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


def takes_found_inf(opt: torch.optim.Optimizer) -> bool:
    """`opt` skips its update on the device when handed `found_inf` (GradScaler's contract),
    exactly. Not fused SGD with momentum and dampening: its first step makes the momentum
    buffers uninitialised (torch.empty_like) and fills them in the kernel, which a dropped
    step never runs; without dampening the guard makes them zeros first (`_first_momentum`)."""
    if isinstance(opt, torch.optim.SGD) and any(
            g["momentum"] != 0 and g["dampening"] != 0 for g in opt.param_groups):
        return False
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def _first_momentum(opt: torch.optim.Optimizer) -> None:
    """Fused SGD's momentum buffers made zeros before its first step: momentum * 0 + grad is the
    first step's buffer (grad) bitwise, and a dropped step leaves zeros, not what empty_like
    held (host bookkeeping: which parameters have state)."""
    if not isinstance(opt, torch.optim.SGD):
        return
    for group in opt.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            if p.grad is not None and opt.state[p].get("momentum_buffer") is None:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)


def device_skip(policy: Policy, optimizer: torch.optim.Optimizer | None, flags: Flags, *,
                hooked: bool) -> DeviceSkip | None:
    """The device-side skip where `cadence.fail_read` and the optimizer allow it, else None
    (the flags are read before each update). `hooked`: the torch optimizer's step pre-hook is
    the step boundary (not a DeepSpeed optimizer's step, not g.step())."""
    acting = policy.acting(Action.FAIL) + policy.acting(Action.SKIP)
    mode = policy.cadence.fail_read
    if not acting or mode == "before_update" or optimizer is None:
        return None
    name = type(optimizer).__name__
    if hooked and takes_found_inf(optimizer):
        return DeviceSkip(flags, policy)
    if mode == "lagged":
        where = f"{name} takes no found_inf" if hooked else \
            "the step boundary is not the torch optimizer's step"
        raise AttachError(f"cadence.fail_read: lagged drops a bad update on the device, but "
                          f"{where}: use an optimizer with fused=True (torch.optim.AdamW, Adam, "
                          "SGD), or fail_read: before_update")
    # On the CPU the copy to the host is the read itself: no sync to avoid, nothing to say.
    if hooked and flags.t.device.type != "cpu":
        log.info("%s (%s) read before each update: this optimizer needs a sync per step "
                 "for fail/skip: use fused=True (torch.optim.AdamW, Adam, SGD) to drop a bad "
                 "update on the device instead", ", ".join(acting), name)
    return None


class DeviceSkip:
    """`found_inf` for the optimizer, decided on the device at each read."""

    def __init__(self, flags: Flags, policy: Policy) -> None:
        device = flags.device
        self._fail = torch.tensor(flags.layout.positions(policy.acting(Action.FAIL)),
                                  dtype=torch.int64, device=device)
        self._skip = torch.tensor(flags.layout.positions(policy.acting(Action.SKIP)),
                                  dtype=torch.int64, device=device)
        # float32 0 / 1: what the fused kernels compare with 1.
        self.found = torch.zeros((), dtype=torch.float32, device=device)
        self.sticky = torch.zeros((), dtype=torch.float32, device=device)  # a fail not yet raised
        self._given: torch.Tensor | None = None
        flags.on_snapshot = self.decide

    def decide(self, who: torch.Tensor) -> None:
        """At a read, after the all-reduce: `who` (slots,) > 0 where a slot crossed on a rank."""
        if self.found.device != who.device:  # the model moved after attach
            self._fail, self._skip = self._fail.to(who.device), self._skip.to(who.device)
            self.found, self.sticky = self.found.to(who.device), self.sticky.to(who.device)
        fail = who.index_select(0, self._fail).gt(0).any().to(torch.float32)
        torch.maximum(self.sticky, fail, out=self.sticky)
        skip = who.index_select(0, self._skip).gt(0).any().to(torch.float32)
        torch.maximum(self.sticky, skip, out=self.found)

    def hold(self) -> None:
        """A boundary without a read: only a fail not yet raised drops the update."""
        self.found.copy_(self.sticky)

    def clear(self) -> None:
        """The host raised the fail: the updates after it are the loop's again."""
        self.sticky.zero_()
        self.found.zero_()

    def give(self, opt: torch.optim.Optimizer) -> None:
        """In the step pre-hook: hand `opt` this update's `found_inf`, the max with a
        GradScaler's own (it set `opt.found_inf` before calling step, and deletes it after)."""
        _first_momentum(opt)
        theirs: Any = getattr(opt, "found_inf", None)
        if isinstance(theirs, torch.Tensor) and theirs is not self._given:
            self._given = None
            opt.found_inf = torch.maximum(theirs, self.found.to(theirs.device))  # type: ignore[attr-defined]
        else:
            self._given = self.found
            opt.found_inf = self.found  # type: ignore[attr-defined]

    def take_back(self, opt: torch.optim.Optimizer) -> None:
        """In the step post-hook: remove the `found_inf` this guard set (a GradScaler removes
        its own)."""
        if self._given is not None and getattr(opt, "found_inf", None) is self._given:
            del opt.found_inf  # type: ignore[attr-defined]
        self._given = None
