"""The torch optimizer the guard hooks, inside whatever wrapper a framework hands the user:
accelerate's `AcceleratedOptimizer` (`.optimizer`; a subclass of torch.optim.Optimizer that
never runs its `__init__`, so it has no hooks of its own), Lightning's `LightningOptimizer`
(`._optimizer`), DeepSpeed's ZeRO optimizers (`.optimizer`), and DeepSpeed's engine itself
(`.optimizer`). The wrapper's `step()` calls the inner optimizer's, whose step pre-hook is the
guard's boundary: before the update; except where a DeepSpeed optimizer calls it once per
parameter group: its own step is the boundary then (`outer`, guard/step/zero.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from guard.errors import AttachError
from guard.step.zero import is_deepspeed

__all__ = ["Unwrapped", "torch_optimizer", "unwrap_optimizer"]

_INNER = ("optimizer", "_optimizer")  # accelerate and DeepSpeed; Lightning


@dataclass(frozen=True)
class Unwrapped:
    optimizer: torch.optim.Optimizer | None
    # Micro-batches per optimizer step the wrapper itself accumulates (accelerate's
    # `gradient_accumulation_steps`: its step() updates only at the last one); 1 otherwise.
    accumulation: int = 1
    wrapper: str = ""  # the outermost wrapper's class name, "" when given the optimizer itself
    outer: object | None = None  # the DeepSpeed optimizer among the wrappers (its step: one update)


def _inner(obj: object) -> object | None:
    for name in _INNER:
        inner: object = getattr(obj, name, None)
        if inner is not None and inner is not obj and hasattr(inner, "step"):
            return inner
    return None


def unwrap_optimizer(given: object) -> Unwrapped:
    """The torch optimizer in `given` (itself, or under up to 8 wrappers); an AttachError
    names a wrapper the guard cannot reach through, and the fix."""
    if given is None:
        return Unwrapped(None)
    obj, wrappers = given, list[object]()
    while (inner := _inner(obj)) is not None and len(wrappers) < 8:
        wrappers.append(obj)
        obj = inner
    names = " > ".join(type(w).__name__ for w in [*wrappers, obj])
    # A torch optimizer whose __init__ ran has the hook registries; accelerate's wrapper
    # subclasses Optimizer without them.
    if not (isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "_optimizer_step_pre_hooks")):
        raise AttachError(
            f"optimizer=: cannot reach a torch.optim.Optimizer through {names} (its step "
            "pre-hook is the step boundary, before the update); pass the torch optimizer it "
            "wraps (optimizer=<wrapper>.optimizer), or attach without optimizer= and call "
            "g.step(loss) once per optimizer step")
    state = getattr(given, "gradient_state", None)  # accelerate's shared GradientState
    steps = getattr(state, "num_steps", 1)
    accumulation = steps if isinstance(steps, int) and steps > 1 else 1
    outer = next((w for w in wrappers if is_deepspeed(w)), None)
    return Unwrapped(obj, accumulation, type(given).__name__ if wrappers else "", outer)


def torch_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer inside `optimizer`'s wrappers (itself when it has none)."""
    return unwrap_optimizer(optimizer).optimizer
