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


def assert_mean_rows(weight: torch.Tensor, real: int = 100) -> None:
    """Every padding row holds the mean of the real rows: what `repair` writes."""
    w = weight.detach()
    assert torch.allclose(w[real:], w[:real].mean(dim=0).expand(w.shape[0] - real, -1),
                          atol=1e-6)


def test_the_default_repairs_garbage_rows_at_attach(caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt(garbage=1e6)  # an uninitialised resize: rows [100, 128) of the tied weight
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=rows_policy(), vocab_size=100) as g:
        assert_mean_rows(m.lm_head.weight)  # before step 1
        assert torch.count_nonzero(m.lm_head.weight[:100]) == 100 * 32  # real rows untouched
        m(*batch())[1].backward()
        g.step()
    assert g.stats["violations"]["padding_rows"] == {"repair": 1}  # repaired rows stay clean
    assert "padding_rows on rank 0 at step 0: rows [100, 128) of wte.weight (tied: " \
           "lm_head.weight): the largest norm" in caplog.text
    assert "setting them to the mean of the real rows in place (action: repair)" in caplog.text


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
    before = m.lm_head.weight[100:].clone()
    with pytest.raises(GuardViolation, match=r"padding_rows on rank 0 at step 0: rows \[100, "
                       r"128\) of wte\.weight \(tied: lm_head\.weight\): the largest norm .*x the "
                       r"largest real row's, expected finite and <= 10x.*stopping \(action: "
                       r"fail\)\. Set checks\.padding_rows\.action: repair") as e:
        guard.attach(m, policy=rows_policy("fail"), vocab_size=100)
    assert (e.value.check, e.value.step) == ("padding_rows", 0)
    assert torch.equal(m.lm_head.weight[100:], before) and hook_count(m) == 0


def test_warn_counts_and_leaves_the_rows() -> None:
    m = tiny_gpt(garbage=1e6)
    before = m.lm_head.weight[100:].clone()
    with guard.attach(m, policy=rows_policy("warn"), vocab_size=100) as g:
        m(*batch())
        g.step()
    assert torch.equal(m.lm_head.weight[100:], before)
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
        assert_mean_rows(m.lm_head.weight)
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


def test_repaired_rows_take_at_most_one_nth_whatever_the_logit_scale() -> None:
    # A model whose real logits are all far below 0 (pretrained GPT-2's are, by tens): a zero
    # row's logit 0 would take nearly all the probability once the guard is gone; the mean
    # row's logit is the mean real logit, so P padding ids take at most P/(N+P) (Jensen).
    m = tiny_gpt(tie=False, garbage=1e3)
    with torch.no_grad():
        h = 0.5 * torch.randn(256, 32)
        h += 4 * torch.nn.functional.normalize(torch.ones(32), dim=0)  # a common direction
        w = m.lm_head.weight
        w[:100] -= 3 * torch.nn.functional.normalize(torch.ones(32), dim=0)  # logits < 0
        real_logits = h @ w[:100].T
        assert (real_logits.logsumexp(-1) < -3).all()
        zero_rows = torch.cat([real_logits, torch.zeros(256, 28)], dim=-1)
        assert float(zero_rows.softmax(-1)[:, 100:].sum(-1).min()) > 0.95  # the failure
    with guard.attach(m, policy=rows_policy(), vocab_size=100):
        pass
    with torch.no_grad():
        mass = (h @ m.lm_head.weight.T).softmax(-1)[:, 100:].sum(-1)
    # exp(mean logit) <= the real ids' mean probability: the padding mass is at most
    # P / (N + P), reached when every real logit is equal (an untrained head, as here).
    assert float(mass.max()) <= 28 / 128 + 1e-6


def test_tensor_parallel_repair_touches_the_padding_rows_only() -> None:
    # The head holds ids [64, 128) of a vocab-parallel split, real 100: its local rows
    # [36, 64) are padding; an embedding that is not sharded has padding from row 100 only.
    from tests.integrations.test_tensor_parallel import ShardLM

    m = ShardLM(1)
    with torch.no_grad():
        m.lm_head.weight[36:] = 1e3
        m.wte.weight[100:] = 1e3
    emb_real = m.wte.weight[:100].detach().clone()
    head_real = m.lm_head.weight[:36].detach().clone()
    pol = {**rows_policy(padding_mass={"action": "mask"}), "vocab": {"tensor_parallel": 2}}
    with guard.attach(m, policy=pol, vocab_size=100, vocab_shard=(64, 128)) as g:
        assert torch.equal(m.wte.weight[:100], emb_real)  # ids 36..99 are real tokens
        assert torch.equal(m.lm_head.weight[:36], head_real)
        assert_mean_rows(m.wte.weight, real=100)
        assert_mean_rows(m.lm_head.weight, real=36)
    assert g.stats["violations"]["padding_rows"] == {"repair": 1}


def copies_of_the_last_real_row(tie: bool) -> torch.nn.Module:
    """What a checkpoint converter leaves when it pads the vocab for a new tensor-parallel size:
    each padding row [100, 128) a copy of real row 99, its norm a real row's."""
    m = tiny_gpt(tie=tie)
    with torch.no_grad():
        for w in {id(p): p for p in (m.wte.weight, m.lm_head.weight)}.values():
            w[100:] = w[99]
    return m


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_padding_rows_that_copy_a_real_row_are_a_finding_at_attach(tie: bool) -> None:
    """Issue 39 item 1: each such ghost id takes exactly id 99's probability; the norm rule
    passes them, the copy rule does not."""
    m = copies_of_the_last_real_row(tie)
    weights = r"wte\.weight \(tied: lm_head\.weight\)" if tie else \
        r"wte\.weight and lm_head\.weight"
    with pytest.raises(GuardViolation, match=(
            r"padding_rows on rank 0 at step 0: rows \[100, 128\) of " + weights + r": "
            rf"{28 if tie else 56} rows that copy real row 99 \(what a checkpoint converter "
            r"padding for a new tensor-parallel size leaves: each such ghost id takes exactly "
            r"id 99's probability\), expected no copy of a real row")):
        guard.attach(m, policy=rows_policy("fail"), vocab_size=100)
    assert hook_count(m) == 0
    m = copies_of_the_last_real_row(tie)
    with guard.attach(m, policy=rows_policy(), vocab_size=100) as g:  # the default: repair
        assert_mean_rows(m.lm_head.weight)
        m(*batch())
        g.step()
    assert g.stats["violations"]["padding_rows"] == {"repair": 1}


def test_zero_padding_rows_are_no_copies() -> None:
    m = tiny_gpt()
    with torch.no_grad():
        m.lm_head.weight[99:] = 0.0  # a zero real row and zero padding rows: no token's copy
    with guard.attach(m, policy=rows_policy("warn"), vocab_size=100) as g:
        m(*batch())
        g.step()
    assert "padding_rows" not in g.stats["violations"]
