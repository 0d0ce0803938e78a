"""A repair that lasts (guard/weights/masters.py): the optimizer's moments of the repaired rows
are zeroed, and where the optimizer steps copies of the weights the guard cannot reach, attach
says so and the repair warns instead of being undone at the next update. The DeepSpeed copies
are tested on real ZeRO-1/2/3 (tests/integrations/test_deepspeed.py)."""

from __future__ import annotations

import logging

import pytest
import torch

import guard
from guard.policy import Action
from tests.conftest import batch, policy, tiny_gpt


def repairing() -> dict[str, object]:
    p = policy()
    del p["checks"]["padding_rows"]  # the default: repair
    return p


def test_a_repair_zeroes_the_adam_moments_of_the_rows_it_writes() -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(*batch())[1].backward()
    opt.step()  # moments everywhere, the padding rows' too (a gradient of the unmasked head)
    opt.zero_grad()
    w = m.lm_head.weight
    with torch.no_grad():
        w[100:] = torch.randn(28, 32) * 1e3  # garbage written after the step
    state = opt.state[w]
    assert state["exp_avg"][100:].abs().sum() > 0 and state["exp_avg_sq"][100:].sum() > 0
    real_moment = state["exp_avg"][:100].clone()
    with guard.attach(m, policy=repairing(), vocab_size=100, optimizer=opt) as g:
        assert g.stats["violations"]["padding_rows"] == {"repair": 1}
    assert not state["exp_avg"][100:].any() and not state["exp_avg_sq"][100:].any()
    assert torch.equal(state["exp_avg"][:100], real_moment)  # the real rows' history stays


def test_copies_the_guard_cannot_reach_turn_the_repair_into_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    # An optimizer that steps its own copies of the weights (as master-weight optimizers do)
    # and writes them back: a repair of the model's rows would be undone at its next update.
    m = tiny_gpt(garbage=1e3)
    copies = [p.detach().clone().requires_grad_() for p in m.parameters()]
    opt = torch.optim.SGD(copies, lr=0.0)
    before = m.lm_head.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=repairing(), vocab_size=100, optimizer=opt) as g:
        assert g.policy.action("padding_rows") is Action.WARN
        assert g.stats["violations"]["padding_rows"] == {"warn": 1}
    assert torch.equal(m.lm_head.weight.detach(), before)  # no repair that would not last
    said = [r.getMessage() for r in caplog.records if "cannot repair in place" in
            r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("padding_rows and untrained_rows cannot repair in place: "
                              "wte.weight (tied: lm_head.weight): SGD does not "
                              "update the weight itself")
    assert "the padding columns stay masked (padding_mass: mask)" in said[0]


def test_the_weights_the_optimizer_updates_are_repaired_as_before() -> None:
    m = tiny_gpt(garbage=1e3)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with guard.attach(m, policy=repairing(), vocab_size=100, optimizer=opt) as g:
        assert g.policy.action("padding_rows") is Action.REPAIR
    w = m.lm_head.weight.detach()
    assert torch.allclose(w[100:], w[:100].mean(dim=0).expand(28, -1), atol=1e-6)
