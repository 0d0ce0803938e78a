"""padding_rows: the padding rows of the weights checked at attach and at each read, repaired
in place by default."""

from __future__ import annotations

import logging

import pytest
import torch

import guard
from guard import GuardViolation
from tests.conftest import batch, hook_count, policy, tiny_gpt


def rows_policy(action: str | None = None, **checks: dict[str, object]) -> dict[str, object]:
    p = policy(**checks)
    if action is None:
        del p["checks"]["padding_rows"]  # the default: repair
    else:
        p["checks"]["padding_rows"] = {"action": action}
    return p


def test_the_default_repairs_garbage_rows_at_attach(caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt(garbage=1e6)  # an uninitialised resize: rows [100, 128) of the tied weight
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=rows_policy(), vocab_size=100) as g:
        assert torch.count_nonzero(m.lm_head.weight[100:]) == 0  # before step 1
        assert torch.count_nonzero(m.lm_head.weight[:100]) == 100 * 32  # real rows untouched
        m(*batch())[1].backward()
        g.step()
    assert g.stats["violations"]["padding_rows"] == {"repair": 1}  # repaired rows stay clean
    assert "padding_rows on rank 0 at step 0: rows [100, 128) of wte.weight (tied: " \
           "lm_head.weight): the largest norm" in caplog.text
    assert "setting them to 0 in place (action: repair)" in caplog.text


def test_non_finite_rows_are_repaired_so_the_mask_can_train() -> None:
    m = tiny_gpt()
    with torch.no_grad():
        m.lm_head.weight[120, 3] = float("nan")  # 0 x NaN would poison the hidden's gradient
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with guard.attach(m, policy=rows_policy(), vocab_size=100, optimizer=opt) as g:
        for i in range(3):
            _, loss = m(*batch(seed=i))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert torch.isfinite(m.lm_head.weight).all() and g.stats["nonfinite"]["loss"] == 0


def test_fail_at_attach_stops_before_step_one_and_changes_nothing() -> None:
    m = tiny_gpt(garbage=1e6)
    with pytest.raises(GuardViolation, match=r"padding_rows on rank 0 at step 0: rows \[100, "
                       r"128\) of wte\.weight \(tied: lm_head\.weight\): the largest norm .*x the "
                       r"largest real row's, expected finite and <= 10x.*stopping \(action: "
                       r"fail\)\. Set checks\.padding_rows\.action: repair") as e:
        guard.attach(m, policy=rows_policy("fail"), vocab_size=100)
    assert (e.value.check, e.value.step) == ("padding_rows", 0)
    assert (m.lm_head.weight[100:] == 1e6).all() and hook_count(m) == 0


def test_warn_counts_and_leaves_the_rows() -> None:
    m = tiny_gpt(garbage=1e6)
    with guard.attach(m, policy=rows_policy("warn"), vocab_size=100) as g:
        m(*batch())
        g.step()
    assert (m.lm_head.weight[100:] == 1e6).all()
    assert g.stats["violations"]["padding_rows"] == {"warn": 2}  # at attach and at the read


def test_clean_rows_are_no_violation() -> None:
    m = tiny_gpt()  # rows initialised like the real ones: norms alike
    with guard.attach(m, policy=rows_policy(), vocab_size=100) as g:
        m(*batch())
        g.step()
    assert "padding_rows" not in g.stats["violations"]


def test_rows_that_go_bad_during_training_are_repaired_at_the_next_read() -> None:
    m = tiny_gpt()
    with guard.attach(m, policy=rows_policy(), vocab_size=100) as g:
        m(*batch())
        g.step()
        with torch.no_grad():
            m.lm_head.weight[110] = float("inf")
        m(*batch())
        g.step()
        assert torch.count_nonzero(m.lm_head.weight[100:]) == 0
    assert g.stats["violations"]["padding_rows"] == {"repair": 1}


def test_under_mask_repairing_changes_no_training_numerics() -> None:
    losses = {}
    for action in ("repair", "off"):
        m = tiny_gpt(garbage=50.0)  # finite garbage: with the mask it reaches no real logit
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        with guard.attach(m, policy=rows_policy(action), vocab_size=100, optimizer=opt):
            out = []
            for i in range(5):
                _, loss = m(*batch(seed=i))
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.detach())
        losses[action] = torch.stack(out)
    assert torch.equal(losses["repair"], losses["off"])  # bitwise


def test_hf_generation_config_suppresses_the_padding_ids() -> None:
    from tests.guard.vocab.test_discover import hf_gpt2

    m = hf_gpt2()
    rows = m.get_output_embeddings().weight.shape[0]
    m.generation_config.suppress_tokens = [3]
    with guard.attach(m, policy=rows_policy(), vocab_size=90):
        pass
    assert m.generation_config.suppress_tokens == [3, *range(90, rows)]
