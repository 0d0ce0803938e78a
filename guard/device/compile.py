"""What the guard needs from torch.compile, in one place: the next torch upgrade touches this
file only (dynamo's frame strategy is a private API)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
from torch import nn

__all__ = ["compiling", "drop_compiled", "eager_at_top_level"]


def compiling() -> bool:
    """True while dynamo traces the caller: Python values become graph constants there."""
    return torch.compiler.is_compiling()


def eager_at_top_level(*hooks: Callable[..., Any]) -> None:
    """Run these hooks eagerly when torch.compile meets them as frames of their own.

    Where dynamo does not inline a module's hooks into the compiled forward (torch versions
    that skip nn.Module._call_impl, or a hook reached after a graph break), each hook is a frame
    of its own. Hooks that only do tiny ops and host bookkeeping are not worth a frame, and
    dynamo warns building one whose inputs are the model's non-leaf outputs, so they run as in
    an uncompiled model. Inlined (torch 2.13 inlines the hooks of the compiled module), they
    are traced as usual and the forward stays a single graph (fullgraph=True works). Called at
    attach, not at import: `import guard` does not load dynamo.
    """
    for hook in hooks:
        _skip_frame(hook.__code__)


@functools.cache
def _skip_frame(code: CodeType) -> None:
    try:
        from torch._dynamo.eval_frame import (  # type: ignore[attr-defined]
            set_code_exec_strategy,
        )
        from torch._dynamo.types import (  # type: ignore[attr-defined]
            FrameAction,
            FrameExecStrategy,
        )
    except ImportError:  # another torch: the hook stays a frame of its own
        return
    skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # this frame and its callees
    set_code_exec_strategy(code, skip)


def drop_compiled(model: nn.Module) -> bool:
    """Drop dynamo's compiled code when some of it came from `model`'s forwards; True if so.

    dynamo does not guard on the hooks of submodules (`skip_nnmodule_hook_guards`), so a graph
    traced before attach keeps running without the guard's hooks, and one traced while attached
    keeps running them after detach. Dropping the caches costs one recompile at attach and one
    at detach, never one per step. The whole cache goes: a graph break leaves continuation
    frames with code objects of their own, which no module names.
    """
    if "torch._dynamo.eval_frame" not in sys.modules:
        return False  # nothing was ever compiled in this process
    try:
        from torch._dynamo import reset_code_caches
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # another torch: nothing known to drop
        return False
    codes = {type(m).forward.__code__ for m in model.modules()
             if hasattr(type(m).forward, "__code__")}
    if not any(_debug_get_cache_entry_list(code) for code in codes):
        return False
    reset_code_caches()
    return True
