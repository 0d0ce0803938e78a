"""Name the first module whose output went non-finite, at no cost until `nonfinite` fires.

Per-module flags are armed only on demand, in one of two ways (guard/step/episodes.py picks):

- re-run: at a synchronous read in the optimizer's step pre-hook the weights and the last
  forward's inputs are still those that produced the NaN, so the guard runs that forward once
  more, without autograd, in eval mode (no dropout, no RNG consumed, no running-stat update),
  under the autocast it ran with, with a flag hook on every module. One extra forward at the
  failing step; works with `fail`, which stops the job at that read.
- next step: where the read is one step late (lagged warn on CUDA) or the weights may already
  have moved (no `optimizer=`), the flag hooks stay on for the next training forward(s) and
  are read at the next read; a NaN that does not recur is reported as not localised.

Keeping the hooks on for every step would find a transient NaN too, but costs a read of
every activation of every step (docs/nonfinite.md has the measurement). Hooks fire when a
module finishes, so the first flagged call is the innermost module that produced it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.device.dtensors import local
from guard.device.hooks import hook
from guard.tensors import dtensor_of
from guard.weights.sharded import register_sharded

__all__ = ["Finding", "Inputs", "Localiser", "RerunFailed", "any_nonfinite", "capture",
           "rerun"]

log = logging.getLogger("guard")

# Nesting of tuples / dicts searched for tensors in a module's inputs and outputs (HF outputs
# are dicts of tuples of tuples for past_key_values).
_MAX_DEPTH = 4


def any_nonfinite(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """0-dim bool: a floating tensor inside `obj` holds a NaN or +Inf; None if it has none.

    -Inf is how masks are written (the padding columns under `mask`, additive attention
    masks), so it does not count.
    """
    if isinstance(obj, torch.Tensor):
        obj = local(obj)  # a DTensor: this rank's part, as every rank localises its own
        # x < inf is False exactly for NaN and +Inf: one comparison and one reduction.
        return (obj < float("inf")).all().logical_not() if obj.is_floating_point() else None
    if depth >= _MAX_DEPTH:
        return None
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, tuple | list) \
        else ()
    found: torch.Tensor | None = None
    for item in items:
        bad = any_nonfinite(item, depth + 1)
        if bad is not None:
            found = bad if found is None else found | bad.to(found.device)
    return found


@dataclass(frozen=True)
class Finding:
    """The first module call with a non-finite output, in completion order."""

    module: str  # qualified name, "" for the model itself
    kind: str  # class name
    inputs_finite: bool
    parent: str  # qualified name of the module whose code called it

    def describe(self, root: str) -> str:
        name = self.module or root
        if self.inputs_finite:
            return (f"the first non-finite output is from module '{name}' ({self.kind}), whose "
                    "inputs were finite: look at its weights and what it computes")
        where = f"'{self.parent}'" if self.module else "the model's inputs"
        return (f"the first non-finite output is from module '{name}' ({self.kind}), whose "
                f"input was already non-finite: it arose in the code of {where} before this "
                "call, outside any submodule")


class Localiser:
    """Forward hooks on every module writing one pair of device flags per call, no host read."""

    def __init__(self, model: nn.Module, *, training_only: bool) -> None:
        self.model = model
        self.training_only = training_only
        self.handles: list[RemovableHandle] = []
        # Per call, in completion order: (name, kind, output non-finite, input non-finite).
        self.calls: list[tuple[str, str, torch.Tensor, torch.Tensor | None]] = []

    @property
    def armed(self) -> bool:
        return bool(self.handles)

    def arm(self) -> None:
        for name, module in self.model.named_modules():
            self.handles.append(hook(module, self._hook(name), kind="forward", with_kwargs=True))

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            if self.training_only and not module.training:
                return
            with torch.no_grad():
                out = any_nonfinite(output)
                if out is not None:
                    self.calls.append((name, type(module).__name__, out,
                                       any_nonfinite((args, kwargs))))
        return hook

    def first(self) -> Finding | None:
        """The first call with a non-finite output; one host read (a step boundary only)."""
        if not self.calls:
            return None
        dev = self.calls[0][2].device
        zero = torch.zeros((), dtype=torch.bool, device=dev)
        flags = torch.stack([torch.stack([o.to(dev), zero if i is None else i.to(dev)])
                             for _, _, o, i in self.calls])  # (calls, 2)
        rows = flags.tolist()
        for (name, kind, _, _), (out_bad, in_bad) in zip(self.calls, rows, strict=True):
            if out_bad:
                return Finding(name, kind, not in_bad, name.rpartition(".")[0])
        return None

    def clear(self) -> None:
        self.calls.clear()


@dataclass(frozen=True)
class Inputs:
    """A training forward's arguments (references, no copy) and the autocast it ran under."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    device_type: str
    autocast: bool
    autocast_dtype: torch.dtype


def capture(args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> Inputs:
    """What `rerun` needs to repeat this forward; host-side state only."""
    return Inputs(args, kwargs, device_type, torch.is_autocast_enabled(device_type),
                  torch.get_autocast_dtype(device_type))


class RerunFailed(Exception):
    """The re-run of the last forward raised (logged): nothing is localised."""


def _parallel_loss(model: nn.Module) -> Any:
    """torch's loss_parallel where the model holds DTensors: a forward that computed its loss
    under it (a vocab-parallel head's DTensor logits) fails outside it; on other DTensors
    (FSDP2's) it changes nothing."""
    if not any(dtensor_of(p) is not None for p in model.parameters()):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def rerun(model: nn.Module, inputs: Inputs) -> Finding | None:
    """Repeat a forward with flag hooks armed; never raises into training but RerunFailed
    (logged)."""
    modes = [(m, m.training) for m in model.modules()]
    loc = Localiser(model, training_only=False)
    loc.arm()
    try:
        model.eval()
        with torch.no_grad(), torch.autocast(inputs.device_type, dtype=inputs.autocast_dtype,
                                             enabled=inputs.autocast), _parallel_loss(model):
            model(*inputs.args, **inputs.kwargs)
        return loc.first()
    except Exception as e:
        log.warning("the re-run to localise the non-finite value failed; "
                    "set checks.nonfinite.localise: false to skip it", exc_info=True)
        raise RerunFailed(f"{type(e).__name__}") from None
    finally:
        loc.disarm()
        for m, mode in modes:
            m.training = mode
        # FSDP2 keeps the gathered parameters after a forward without grad, and the next
        # forward would reuse them: the copies from before this step's update.
        register_sharded(model)
