"""Every hook the guard puts on a model or an optimizer goes on through `hook()`: one place
that says how each kind behaves under torch.compile, and one record of every hook function,
which the hot-path test reads (tests/guard/device/test_hot_path.py) wherever it lives."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import CodeType
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.device.compile import eager_at_top_level
from guard.override import override

__all__ = [
    "Compiled", "Handle", "Kind", "hook", "register", "registered", "wrap_call", "wrap_loss",
    "wrap_step",
]

# grad_accumulated: on a parameter, after its .grad was accumulated in a backward.
# step_post: on an optimizer, after its step (not after one that raised).
Kind = Literal["forward_pre", "forward", "step_pre", "step_post", "grad_accumulated"]
# Under torch.compile: "traced" like the model's own code (the default); "eager": run eagerly
# where dynamo meets the hook as a frame of its own, traced where it is inlined (host
# bookkeeping and tiny ops, compile.eager_at_top_level); "never": never traced (host work that
# may read the flags: a graph break where it is inlined).
Compiled = Literal["traced", "eager", "never"]

# The code of every function registered, with its qualified name: code objects, not the
# functions, so a closure per module (the localiser's) is one entry and nothing is kept alive.
_REGISTERED: dict[CodeType, str] = {}


def hook(target: nn.Module | torch.optim.Optimizer | torch.Tensor, fn: Callable[..., Any], *,
         kind: Kind,
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
    if kind == "step_post":
        if not isinstance(target, torch.optim.Optimizer):
            raise TypeError(f"a step_post hook goes on an optimizer, got {type(target).__name__}")
        return target.register_step_post_hook(fn)
    if kind == "grad_accumulated":
        if not isinstance(target, torch.Tensor):
            raise TypeError(f"a grad_accumulated hook goes on a parameter, got "
                            f"{type(target).__name__}")
        handle: RemovableHandle = target.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            fn)
        return handle
    if not isinstance(target, nn.Module):
        raise TypeError(f"a {kind} hook goes on a module, got {type(target).__name__}")
    if kind == "forward_pre":
        return target.register_forward_pre_hook(fn, **kwargs)
    return target.register_forward_hook(fn, **kwargs)


class Handle(Protocol):
    """What the guard keeps of each thing it put on a model: torch's RemovableHandle, or an
    attribute's override (guard/override.py); `remove()` is idempotent."""

    def remove(self) -> None: ...


def wrap_loss(owner: nn.Module, fn: Callable[[Any], Any]) -> Handle:
    """Make `owner.loss_function(logits, ...)` (HF's settable property, which keeps its value
    in `_loss_function`) call `fn(logits)` first and compute the loss from what it returns:
    the logits exactly as the loss receives them, after anything the model did to the head's
    output."""
    inner = getattr(fn, "__func__", fn)
    _REGISTERED[inner.__code__] = inner.__qualname__
    loss_function: Callable[..., Any] = cast(Any, owner).loss_function  # what it uses now

    def guarded_loss(*args: Any, **kwargs: Any) -> Any:
        if "logits" in kwargs:
            kwargs["logits"] = fn(kwargs["logits"])
        elif args:
            args = (fn(args[0]), *args[1:])
        return loss_function(*args, **kwargs)

    return override(owner, "_loss_function", guarded_loss)


def wrap_step(owner: object, fn: Callable[..., Any]) -> Handle:
    """Make `owner.step(*args, **kwargs)` call `fn(step, *args, **kwargs)`, `step` being its
    own: a step pre-hook for an optimizer wrapper that is no torch optimizer (DeepSpeed's,
    whose one step is an update of every parameter group). Removed, the class's step shows
    again."""
    inner = getattr(fn, "__func__", fn)
    _REGISTERED[inner.__code__] = inner.__qualname__
    if "step" in vars(owner):
        raise TypeError(f"{type(owner).__name__}.step is already wrapped")
    step: Callable[..., Any] = cast(Any, owner).step

    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        return fn(step, *args, **kwargs)

    return override(owner, "step", guarded_step)


def wrap_call(owner: object, name: str, fn: Callable[..., Any]) -> Handle:
    """Make `owner.name(*args, **kwargs)` (a library's function, looked up at each call) call
    `fn(original, *args, **kwargs)`: the loop's gradient clip (guard/device/clip.py). Removed,
    the function is back, unless something wrapped it again since (then the guard's wrapper
    stays, passing through)."""
    inner = getattr(fn, "__func__", fn)
    _REGISTERED[inner.__code__] = inner.__qualname__
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        return fn(original, *args, **kwargs)

    return override(owner, name, guarded)


def register(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Record `fn`, which the guard hands the user to call in the training step (a pipeline
    schedule's loss_fn), as hot-path code the scan reads; returns it."""
    inner = getattr(fn, "__func__", fn)
    _REGISTERED[inner.__code__] = inner.__qualname__
    return fn


def registered() -> dict[CodeType, str]:
    """The code of every hook function registered in this process, and its qualified name."""
    return dict(_REGISTERED)
