"""Shared fixtures: fresh tiny models and a quiet default policy per test."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from guard.demo.model import GPT, GPTConfig

# Tests run without the embedded endpoint unless they start one, and without loss_spike until
# a test asks for it; padding_rows is off too, so the garbage rows a test puts in stay there
# for the check under test (tests/guard/device/test_rows.py tests the repair).
QUIET: dict[str, Any] = {"export": {"serve": None},
                         "checks": {"loss_spike": {"action": "off"},
                                    "padding_rows": {"action": "off"}}}


def policy(**checks: dict[str, Any]) -> dict[str, Any]:
    """QUIET with the given per-check settings merged in."""
    p = copy.deepcopy(QUIET)
    for name, settings in checks.items():
        p["checks"].setdefault(name, {}).update(settings)
    return p


def findings(caplog: pytest.LogCaptureFixture, check: str) -> list[str]:
    """What `check` said of a step or the attach ("<check> on rank R at ..."), not its summary
    at detach ("<check> at detach: ..."): the lines share the logger's name, no other prefix."""
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"{check} on rank ")]


def tiny_gpt(rows: int = 128, *, seed: int = 0, tie: bool = True, garbage: float | None = None,
             real: int = 100) -> GPT:
    """A 2-layer GPT with `rows` vocab rows; `garbage` fills rows [real, rows) of the head
    with normal noise of that std, like an uninitialised resize (the rows' init std is 0.02;
    a constant row is no garbage for the softmax: the final LayerNorm's output sums to 0)."""
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=rows, block_size=32, n_layer=2, n_head=2, n_embd=32,
                      tie_weights=tie))
    if garbage is not None:
        noise = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            w = m.lm_head.weight
            w[real:] = torch.randn(w.shape[0] - real, w.shape[1], generator=noise) * garbage
    return m


def batch(
    real: int = 100, *, seed: int = 0, b: int = 4, t: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, real, (b, t), generator=g)
    y = torch.randint(0, real, (b, t), generator=g)
    return x, y


def hook_count(model: torch.nn.Module) -> int:
    """Forward hooks and pre-hooks on every module of `model`: 0 again after detach."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Every way a tensor reaches the host raises while this is active."""
    names = ["item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("host read inside the hot path")

    for n in names:
        setattr(torch.Tensor, n, boom)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.fixture
def gpt() -> GPT:
    return tiny_gpt()
