"""torch's `PipelineStage` infers the shapes its stages exchange by running the stage's module
forward and backward once, at the first step of a schedule, on tensors that stand for the ones
it will receive: on every stage but the first they are `torch.empty`, uninitialised memory
(torch 2.13's DYNAMIC metadata inference; older releases ran it on meta tensors). That pass is
no training forward: the guard must not count its ids, measure its logits or record its loss,
or uninitialised memory reads as a NaN in the lm_head input of a healthy model.

`quiet_inference` wraps the stage's inference methods (at attach, on the stage object): while
one runs, the stage's module is in eval mode, so every hook treats the pass as an evaluation
forward, and `Probe.inferring` is set for the schedule's loss_fn. Runs at attach (the wrap) and
at the first step of a schedule (host flags only: no tensor is read)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from guard.device.hooks import Handle, register
from guard.override import override

__all__ = ["INFERENCE", "quiet_inference"]

# The methods of torch's PipelineStage that run the module for shapes only, by release.
INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def quiet_inference(stage: object, module: nn.Module, flag: Any) -> list[Handle]:
    """Wrap each of `stage`'s shape-inference methods so that `module` runs in eval mode and
    `flag.inferring` is True while it runs; the handles whose remove() unwraps them."""
    return [override(stage, n, register(_quiet(getattr(stage, n), module, flag)))
            for n in INFERENCE if callable(getattr(stage, n, None))]


def _quiet(fn: Callable[..., Any], module: nn.Module, flag: Any) -> Callable[..., Any]:
    def shapes_only(*args: Any, **kwargs: Any) -> Any:
        modes = [(m, m.training) for m in module.modules()]
        flag.inferring = True
        module.train(False)
        try:
            return fn(*args, **kwargs)
        finally:
            for m, was in modes:
                m.training = was
            flag.inferring = False

    return shapes_only
