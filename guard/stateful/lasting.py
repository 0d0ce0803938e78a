"""A repair that cannot last becomes a warning: the policy as attach applies it, where the
optimizer keeps a copy of a weight the guard cannot reach (guard/weights/masters.py says which).
At attach, before the states are made (guard/parts.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from guard.policy import Action, Policy
from guard.weights.masters import Masters

__all__ = ["lasting"]

log = logging.getLogger("guard")


def lasting(policy: Policy, weights: Sequence[tuple[str, torch.Tensor]],
            masters: Masters) -> Policy:
    """`policy` with every `repair` that would not last turned into `warn`, said once at
    attach: where the optimizer keeps a copy of a weight the guard cannot reach, a repair
    written to the weight would be undone at the next update, silently. The checks still
    measure and report; the padding columns stay masked where `padding_mass` masks them."""
    why = [(name, reason) for name, w in weights if (reason := masters.unreachable(w))]
    repairing = policy.acting(Action.REPAIR)
    if not why or not repairing:
        return policy
    what = "; ".join(f"{name}: {reason}" for name, reason in why)
    mask = ("the padding columns stay masked (padding_mass: mask)" if policy.masks else
            "nothing keeps the padding columns out of the loss (padding_mass is not mask)")
    log.warning("%s cannot repair in place: %s. A repair written to the weights would "
                "be undone at the next update, so %s warn instead (action: warn), and %s. "
                "Pass the optimizer that updates the weights themselves, or DeepSpeed's own "
                "(optimizer=engine.optimizer)", " and ".join(repairing), what,
                "they" if len(repairing) > 1 else "it", mask)
    checks = policy.checks.model_copy(update={
        c: getattr(policy.checks, c).model_copy(update={"action": Action.WARN})
        for c in repairing})
    return policy.model_copy(update={"checks": checks})
