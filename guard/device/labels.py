"""Where the labels reach the guarded model: a `labels=` / `targets=` keyword, or the parameter
of that name at its position in the model's forward (nanoGPT's `model(x, y)`); and, for a
step that brought none, what the guard looked for."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from guard.wrappers import says_nothing

__all__ = ["NAMES", "LabelsArg", "labels_position"]

NAMES = ("labels", "targets")  # HF and torchtune; nanoGPT and litgpt
_SHOWN = 6  # parameters of a forward named in a message; HF's have twenty


def _parameters(model: nn.Module) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def labels_position(model: nn.Module) -> int | None:
    """Index in *args of a `labels` / `targets` parameter of model.forward, if any."""
    params = _parameters(model)
    return next((i for i, p in enumerate(params or ()) if p.name in NAMES
                 and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)


def _shown(params: list[inspect.Parameter]) -> str:
    names = [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "")
             + p.name for p in params]
    return ", ".join(names[:_SHOWN] + (["..."] if len(names) > _SHOWN else []))


@dataclass(frozen=True)
class LabelsArg:
    """How the labels of one model's forward are found in a call's arguments."""

    position: int | None  # of the labels / targets parameter in *args
    forward: str  # the forward, for messages: "GPT.forward(idx, targets)"

    @classmethod
    def of(cls, caller: nn.Module, model: nn.Module | None = None) -> LabelsArg:
        """The labels of the calls of `caller`, whose forward hands its arguments on to
        `model`'s as they are when it names none of its own (a wrapper's *args, **kwargs)."""
        if model is not None and says_nothing(caller):
            caller = model
        params = _parameters(caller)
        shown = "(...)" if params is None else f"({_shown(params)})"
        return cls(labels_position(caller), f"{type(caller).__name__}.forward{shown}")

    def find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | int | None,
                                                                          Any]:
        """(the keyword or the position the labels came at, the labels), or (None, None)."""
        key = next((k for k in NAMES if k in kwargs), None)
        if key is not None:
            return key, kwargs[key]
        pos = self.position
        if pos is not None and len(args) > pos:
            return pos, args[pos]
        return None, None

    def looked_for(self) -> str:
        """What the guard looked for in each training forward, and the ways to give labels."""
        where = " or ".join(f"{n}=" for n in NAMES)
        if self.position is not None:
            where += f" as a keyword, or the argument at position {self.position}"
        else:
            where += (" as a keyword (this forward has no positional labels / targets "
                      "parameter)")
        return (f"the guard looked for {where} in the calls of {self.forward}, the module it "
                f"hooks, and none came. Give them: pass the labels to that forward as "
                f"{' or '.join(f'{n}=' for n in NAMES)}"
                + ("" if self.position is None else f" or at position {self.position}")
                + "; attach to the model whose forward takes them, or to a wrapper the guard "
                  "unwraps (DDP, FSDP, torch.compile, Lightning Fabric, PEFT, a module whose "
                  "only child is the model); where the loss is computed outside the model (HF "
                  "Trainer with label_smoothing_factor or compute_loss_func) the labels cannot "
                  "be seen: check them in the data pipeline")
