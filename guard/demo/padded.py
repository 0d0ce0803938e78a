"""The demo's two models, sharing every real weight: the padded one, whose padding rows hold a
scenario's garbage, and the reference, whose head covers the real vocabulary only."""

from __future__ import annotations

import torch

from guard.demo.model import GPT, GPTConfig
from guard.demo.scenarios import REAL, ROWS, Scenario

__all__ = ["build", "uninitialised"]


def uninitialised(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Garbage like torch.empty can hand back after a resize: arbitrary float32 bit patterns
    (NaN / Inf patterns replaced by 0, so the garbage itself is finite)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _large(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 5.0


def build(scenario: Scenario, seed: int, d: int, layers: int) -> tuple[GPT, GPT]:
    """(padded model with garbage padding rows, reference over the real vocab only), sharing
    every real weight."""
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=ROWS, block_size=32, n_layer=layers, n_head=2, n_embd=d,
                       tie_weights=scenario.tied)
    padded = GPT(config)
    fill = uninitialised if scenario.name == "nan" else _large
    with torch.no_grad():
        padded.lm_head.weight[REAL:] = fill((ROWS - REAL, d), seed + 1)  # tied: wte too
    ref = GPT(GPTConfig(vocab_size=REAL, block_size=32, n_layer=layers, n_head=2, n_embd=d,
                        tie_weights=scenario.tied))
    state = {k: (v[:REAL] if k in ("wte.weight", "lm_head.weight") else v)
             for k, v in padded.state_dict().items()}
    ref.load_state_dict(state)
    return padded, ref
