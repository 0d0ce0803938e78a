"""attach()'s arguments, checked and resolved before anything is built or changed: the policy,
the model under its wrappers, the torch optimizer under its wrappers, how a step's loss is
made of its micro-batches', and this process's rank."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from guard.device.loss import LossShares, check_loss_options
from guard.errors import AttachError
from guard.policy import Policy
from guard.policy_file import load_policy
from guard.quote import quote
from guard.step.clock import Steps, check_boundaries
from guard.step.optimizers import unwrap_optimizer
from guard.wrappers import unwrap_call
from guard_server.wire import MAX_RANK

__all__ = ["Arguments", "check_arguments"]

log = logging.getLogger("guard")


@dataclass(frozen=True)
class Arguments:
    policy: Policy
    model: nn.Module  # the module the guard hooks, inside every wrapper (guard/wrappers.py)
    caller: nn.Module  # the one whose forward hooks see each call: the model, mostly
    wrappers: tuple[str, ...]  # the wrappers' class names, outermost first
    optimizer: Any  # the torch optimizer, inside accelerate's / Lightning's / DeepSpeed's
    outer: object  # DeepSpeed's optimizer around it, whose step is one update (or None)
    loss_shares: LossShares
    rank: int
    local_rank: int
    scaled: bool  # a GradScaler that is enabled marks the loop's steps (g.step())


def _environment_rank(name: str) -> int:
    """The rank torchrun put in the environment variable `name` (0 without it); AttachError
    naming the variable when it holds no rank the wire can carry (0 to MAX_RANK)."""
    text = os.environ.get(name, "0").strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= MAX_RANK):
        raise AttachError(f"the environment variable {name}={quote(text)} is not a rank: "
                          f"expected a whole number from 0 to {MAX_RANK} (torchrun sets it); "
                          f"fix it or unset it")
    return int(text)


def _rank_of_process() -> tuple[int, int]:
    """(global rank, local rank) from torch.distributed, else torchrun's environment."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = _environment_rank("RANK")
    return rank, _environment_rank("LOCAL_RANK")


def check_arguments(model: object,
                    policy: Policy | dict[str, Any] | str | os.PathLike[str] | None,
                    optimizer: object, steps: Steps,
                    loss_shares: LossShares | None, loss_scale: float,
                    scaler: object = None) -> Arguments:
    """The arguments resolved, or an AttachError (PolicyError) naming the one that does not
    fit. `loss_shares=None`: "mean" where the optimizer's wrapper accumulates gradients over
    micro-batches (accelerate's `gradient_accumulation_steps`), "last" otherwise."""
    pol = load_policy(policy)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise AttachError(f"scaler= must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    inside = unwrap_call(model)
    # Attached to DeepSpeed's engine without optimizer=: the engine's optimizer.
    if optimizer is None and steps != "manual":
        optimizer = inside.optimizer
    unwrapped = unwrap_optimizer(optimizer)
    check_boundaries(pol, unwrapped.optimizer, steps)
    shares: LossShares = loss_shares or ("mean" if unwrapped.accumulation > 1 else "last")
    check_loss_options(shares, loss_scale)
    if loss_shares is None and shares == "mean":
        log.info("%s accumulates gradients over %d micro-batches: the step's loss is "
                 "their mean (loss_shares='mean')", unwrapped.wrapper, unwrapped.accumulation)
    rank, local_rank = _rank_of_process()
    return Arguments(pol, inside.model, inside.caller, inside.wrappers, unwrapped.optimizer,
                     unwrapped.outer, shares, rank, local_rank,
                     scaled=isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled())
