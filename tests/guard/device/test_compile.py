"""The torch.compile seam: whether dynamo traces the caller, and hooks kept out of its frames."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from guard.device.compile import compiling, drop_compiled, eager_at_top_level


def test_compiling_is_true_only_while_dynamo_traces() -> None:
    seen: list[bool] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if compiling() else x - 1

    assert not compiling()
    torch._dynamo.reset()
    out = torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(1))
    seen.append(bool(out == 1))
    torch._dynamo.reset()
    assert seen == [True]


def test_a_function_marked_eager_runs_outside_dynamo_as_a_frame_of_its_own() -> None:
    seen: dict[str, list[bool]] = {"eager": [], "traced": []}

    def eager(x: torch.Tensor) -> torch.Tensor:
        seen["eager"].append(compiling())
        return x + 1

    def traced(x: torch.Tensor) -> torch.Tensor:
        seen["traced"].append(compiling())
        return x + 1

    eager_at_top_level(eager, eager)  # idempotent
    torch._dynamo.reset()
    for fn in (eager, traced):
        assert torch.equal(torch.compile(fn, backend="eager")(torch.ones(1)), torch.full((1,), 2.0))
    torch._dynamo.reset()
    assert seen == {"eager": [False], "traced": [True]}


def test_drop_compiled_drops_every_compiled_function_once() -> None:
    """Any compiled code may have inlined a model's forwards, so all of it goes, once."""
    torch._dynamo.reset()
    counters.clear()
    assert not drop_compiled()  # nothing compiled: nothing to drop
    g = torch.compile(lambda x: x + 1, backend="eager")
    g(torch.ones(1))
    g(torch.ones(1))
    assert counters["frames"]["ok"] == 1
    assert drop_compiled() and not drop_compiled()
    g(torch.ones(1))
    g(torch.ones(1))
    assert counters["frames"]["ok"] == 2  # traced again once after the drop
    torch._dynamo.reset()
