"""guard.mask_frozen on a model no guard trains: its padding columns are -inf in every forward
until `remove()`, and the real columns are its own (the fused forward is tested with TRL's
DPOTrainer, tests/integrations/test_trl.py)."""

from __future__ import annotations

import torch

import guard
from tests.conftest import batch, tiny_gpt


def test_the_padding_columns_are_minus_inf_until_removed() -> None:
    model = tiny_gpt(128, garbage=3.0).eval()
    x, _ = batch()
    with torch.no_grad():
        plain, _ = model(x)
        m = guard.mask_frozen(model, 100)
        masked, _ = model(x)
        assert torch.equal(masked[..., :100], plain[..., :100])
        assert bool((masked[..., 100:] == float("-inf")).all())
        m.remove()
        m.remove()  # idempotent
        after, _ = model(x)
    assert torch.equal(after, plain)


def test_a_model_without_padding_rows_gets_no_hook() -> None:
    model = tiny_gpt(100)
    before = len(model.lm_head._forward_hooks)
    m = guard.mask_frozen(model, 100)
    assert len(model.lm_head._forward_hooks) == before and len(model._forward_pre_hooks) == 0
    m.remove()
