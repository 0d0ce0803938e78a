"""Every hook the guard puts on a model or an optimizer goes on through `hook()`: one place
that says how each kind behaves under torch.compile, and one record of every hook function,
which the hot-path test reads (tests/guard/device/test_hot_path.py) wherever it lives."""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.device.compile import eager_at_top_level

__all__ = ["Compiled", "Kind", "hook", "registered"]

Kind = Literal["forward_pre", "forward", "step_pre"]
# Under torch.compile: "traced" like the model's own code (the default); "eager": run eagerly
# where dynamo meets the hook as a frame of its own, traced where it is inlined (host
# bookkeeping and tiny ops, compile.eager_at_top_level); "never": never traced (host work that
# may read the flags: a graph break where it is inlined).
Compiled = Literal["traced", "eager", "never"]

# The code of every function registered, with its qualified name: code objects, not the
# functions, so a closure per module (the localiser's) is one entry and nothing is kept alive.
_REGISTERED: dict[CodeType, str] = {}


def hook(target: nn.Module | torch.optim.Optimizer, fn: Callable[..., Any], *, kind: Kind,
         compiled: Compiled = "traced", **kwargs: Any) -> RemovableHandle:
    """Register `fn` on `target` as a `kind` hook (torch's own keywords, `with_kwargs=True`,
    `prepend=True`, pass through) and return torch's handle."""
    inner = getattr(fn, "__func__", fn)
    _REGISTERED[inner.__code__] = inner.__qualname__
    if compiled == "eager":
        eager_at_top_level(fn)
    elif compiled == "never":
        fn = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
    if kind == "step_pre":
        if not isinstance(target, torch.optim.Optimizer):
            raise TypeError(f"a step_pre hook goes on an optimizer, got {type(target).__name__}")
        return target.register_step_pre_hook(fn)
    if not isinstance(target, nn.Module):
        raise TypeError(f"a {kind} hook goes on a module, got {type(target).__name__}")
    if kind == "forward_pre":
        return target.register_forward_pre_hook(fn, **kwargs)
    return target.register_forward_hook(fn, **kwargs)


def registered() -> dict[CodeType, str]:
    """The code of every hook function registered in this process, and its qualified name."""
    return dict(_REGISTERED)
