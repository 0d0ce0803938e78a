"""What the guard needs from torch.compile, in one place: the next torch upgrade touches this
file only (dynamo's frame strategy is a private API)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

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


def drop_compiled() -> bool:
    """Drop all of dynamo's compiled code when it holds any; True if it did.

    dynamo does not guard on the hooks of submodules (`skip_nnmodule_hook_guards`), so a graph
    traced before attach keeps running without the guard's hooks, and one traced while attached
    keeps running them after detach. Any compiled code may run the model's forwards: a compiled
    module's forward, a continuation frame after a graph break, a compiled step function that
    inlined the model (no code of the model has a cache entry then). No compiled code names
    the modules it inlined, so the whole cache goes: one recompile of each compiled function
    at attach and at detach, never one per step.
    """
    if "torch._dynamo.eval_frame" not in sys.modules:
        return False  # nothing was ever compiled in this process
    try:
        from torch._dynamo import convert_frame, reset_code_caches
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # another torch: nothing known to drop
        return False
    # Every code object dynamo has compiled a frame of, weakly held: a dead one was dropped.
    codes = (ref() for ref in list(convert_frame.input_codes.seen))
    if not any(code is not None and _debug_get_cache_entry_list(code) for code in codes):
        return False
    reset_code_caches()
    return True
