"""An embedding and a head tied at attach stay tied: a tie broken during training (a resize,
to_empty, a load that re-creates a weight) is a vocab violation at the next read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import guard
from guard import GuardViolation
from tests.conftest import batch, policy, tiny_gpt


def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    _, loss = m(*batch())
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_a_tie_broken_mid_run_stops_before_the_update_naming_both_weights() -> None:
    m = tiny_gpt(tie=True)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        step(m, opt)
        m.lm_head.weight = nn.Parameter(m.lm_head.weight.detach().clone())  # a copy: untied
        before = m.wte.weight.detach().clone()
        _, loss = m(*batch())
        loss.backward()
        with pytest.raises(GuardViolation) as info:
            opt.step()
    e = info.value
    assert (e.check, e.step) == ("vocab", 2)
    assert str(e).startswith("vocab on rank 0 at step 2: wte.weight and lm_head.weight were "
                             "one tied weight at attach and are two now")
    assert torch.equal(m.wte.weight.detach(), before)
    assert g.stats["violations"] == {"vocab": {"fail": 1}}


def test_under_warn_it_is_said_once_counted_each_read_and_training_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt(tie=True)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with caplog.at_level("WARNING", logger="guard"), \
            guard.attach(m, policy=policy(vocab={"action": "warn"}), vocab_size=100,
                         optimizer=opt) as g:
        m.wte.weight = nn.Parameter(m.wte.weight.detach().clone())  # the embedding re-created
        for _ in range(3):
            step(m, opt)
    assert g.stats["violations"] == {"vocab": {"warn": 3}}
    assert caplog.text.count("were one tied weight at attach") == 1


def test_a_model_that_stays_tied_or_was_never_tied_is_quiet() -> None:
    for tie in (True, False):
        m = tiny_gpt(tie=tie)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
            for _ in range(2):
                step(m, opt)
        assert g.stats["violations"] == {}, tie
