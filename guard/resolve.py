"""What `attach` works out from its arguments and the environment, before any hook."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from guard.errors import AttachError
from guard.policy import STEP_CHECKS, Policy

__all__ = ["check_skip", "rank_of_process", "real_vocab"]

log = logging.getLogger("guard")


def rank_of_process() -> tuple[int, int]:
    """(global rank, local rank) from torch.distributed, else torchrun's environment."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    return rank, int(os.environ.get("LOCAL_RANK", "0"))


def real_vocab(vocab_size: int | None, tokenizer: Any, policy: Policy, rows: int) -> int:
    """The real vocab from `vocab_size=`, the policy or `len(tokenizer)`; they must agree."""
    sources: dict[str, int] = {}
    if vocab_size is not None:
        sources["vocab_size="] = vocab_size
    if policy.vocab.real_size is not None:
        sources["policy vocab.real_size"] = policy.vocab.real_size
    if tokenizer is not None:
        try:
            sources["len(tokenizer)"] = len(tokenizer)
        except TypeError:
            raise AttachError(
                f"tokenizer= must support len() (got {type(tokenizer).__name__}); "
                "pass vocab_size=<ids the tokenizer can produce> instead"
            ) from None
    for name, n in sources.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise AttachError(f"{name} must be a positive int, got {n!r}")
    if len(set(sources.values())) > 1:
        seen = ", ".join(f"{k} {v}" for k, v in sources.items())
        raise AttachError(f"the real vocab size is ambiguous: {seen}; give one of them")
    return next(iter(sources.values()), rows)


def check_skip(policy: Policy, optimizer: torch.optim.Optimizer | None) -> None:
    """`skip` drops an optimizer step from the optimizer's step pre-hook, so it needs one;
    with reads every N steps, `fail` and `skip` act at the reads only (a warning)."""
    every = policy.cadence.read_every
    failing = [c for c in STEP_CHECKS if policy.action(c) == "fail"]
    if failing and every > 1:
        log.warning("guard: with cadence.read_every %d, fail (%s) is decided at the reads only: "
                    "up to %d updates can be applied after a bad step. Use read_every: 1 "
                    "where fail must stop the first one.", every, ", ".join(failing), every - 1)
    skipping = [c for c in ("nonfinite", "loss_spike") if policy.action(c) == "skip"]
    if not skipping:
        return
    if optimizer is None:
        raise AttachError(
            f"checks.{skipping[0]}.action: skip drops the optimizer step, so the guard needs "
            "the optimizer: guard.attach(model, optimizer=opt, ...); or choose fail, warn or off"
        )
    if policy.cadence.read_every > 1:
        log.warning("guard: with cadence.read_every %d, skip drops only the step at which the "
                    "flags are read; the other steps of the window are applied. Use "
                    "read_every: 1 with skip.", policy.cadence.read_every)
