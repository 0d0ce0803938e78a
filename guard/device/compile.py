"""What the guard needs from torch.compile, in one place: the next torch upgrade touches this
file only (dynamo's frame strategy is a private API)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

__all__ = ["compiling", "eager_at_top_level"]


def compiling() -> bool:
    """True while dynamo traces the caller: Python values become graph constants there."""
    return torch.compiler.is_compiling()


def eager_at_top_level(*hooks: Callable[..., Any]) -> None:
    """Run these hooks eagerly when torch.compile meets them as frames of their own.

    torch.compile(model) runs the model's hooks as frames of their own (dynamo skips
    nn.Module._call_impl). Hooks that only do tiny ops and host bookkeeping are not worth a
    frame, and dynamo warns building one whose inputs are the model's non-leaf outputs, so
    they run as in an uncompiled model. Inlined into a larger compiled function they are traced
    as usual, so that one stays a single graph (fullgraph=True works). Called at attach, not at
    import: `import guard` does not load dynamo.
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
