"""nanoGPT's own model.py (tests/data/nanogpt, MIT), built small, with garbage padding rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

MODEL_PY = Path(__file__).resolve().parents[1] / "data" / "nanogpt" / "model.py"
REAL, ROWS = 100, 128


def nanogpt_module() -> ModuleType:
    """The real file, imported once as `nanogpt_model`."""
    if "nanogpt_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("nanogpt_model", MODEL_PY)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["nanogpt_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["nanogpt_model"]


def nanogpt(garbage: float | None = 3.0, seed: int = 0, *, rows: int = ROWS,
            real: int = REAL) -> torch.nn.Module:
    """A 2-layer nanoGPT with `rows` vocab rows; `garbage` fills the padding rows [real, rows)
    of its tied wte / lm_head with normal noise of that std, as an uninitialised resize leaves
    them (a constant row is no garbage for the softmax: the final LayerNorm's output sums
    to 0)."""
    nano = nanogpt_module()
    torch.manual_seed(seed)
    cfg = nano.GPTConfig(block_size=32, vocab_size=rows, n_layer=2, n_head=2, n_embd=32,
                         dropout=0.0, bias=False)
    model: torch.nn.Module = nano.GPT(cfg)
    if garbage is not None:
        noise = torch.Generator().manual_seed(seed + 1)
        w = model.lm_head.weight
        with torch.no_grad():
            w[real:] = torch.randn(w.shape[0] - real, w.shape[1], generator=noise) * garbage
    return model
