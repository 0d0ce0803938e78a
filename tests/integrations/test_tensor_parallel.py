"""A vocab-parallel head on one process: the last shard of a tensor-parallel-2 LM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import guard
from guard import AttachError
from guard.checks.padding_mass import bound
from tests.conftest import policy

REAL, ROWS, TP = 100, 128, 2
WIDTH = ROWS // TP  # 64 columns per shard; the last one holds ids [64, 128), padding from 100
TP_POLICY = {**policy(padding_mass={"action": "warn", "exact": True},
                      token_range={"action": "warn"}),
             "vocab": {"tensor_parallel": TP}}


class ShardLM(nn.Module):
    """A replicated embedding and the `index`-th shard of an lm_head over ROWS ids, cut from a
    full head whose padding rows hold garbage; `full` computes the unsharded logits."""

    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(ROWS, 16)
        full = torch.randn(ROWS, 16) * 0.5
        full[REAL:] = torch.randn(ROWS - REAL, 16) * 2.0  # garbage padding rows
        self.full_weight = full
        self.lm_head = nn.Linear(16, WIDTH, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(full[index * WIDTH:(index + 1) * WIDTH])

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.wte(idx))  # (B, T, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(idx))  # (B, T, WIDTH): this shard's logits

    def full_logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hidden(idx) @ self.full_weight.T  # (B, T, ROWS)


def ids() -> torch.Tensor:
    x = torch.randint(0, REAL, (2, 8), generator=torch.Generator().manual_seed(0))
    x[0, 0] = 110  # a ghost id, global: in [REAL, ROWS)
    return x


def test_last_shard_measures_its_padding_columns_by_global_id() -> None:
    m = ShardLM(1)
    x = ids()
    with torch.no_grad():
        local = m(x)  # (2, 8, 64): global ids [64, 128), padding from local column 36
        exact_local = guard.padding_mass(local, REAL - WIDTH)
        exact_global = guard.padding_mass(m.full_logits(x), REAL)
    with guard.attach(m, policy=TP_POLICY, vocab_size=REAL, vocab_shard=(WIDTH, ROWS)) as g:
        assert (g.rows, g.audit.aligned) == (128, 128)  # the whole vocab's rows
        m(x)
    s = g.stats
    assert s["out_of_range"]["input"] == 1  # token_range uses global ids
    # The shard's mass is over its own columns: an upper bound of the whole-vocab mass.
    assert s["padding_mass"] == pytest.approx(float(exact_local.mean()), rel=1e-5)
    assert s["padding_mass_max"] == pytest.approx(float(exact_local.max()), rel=1e-5)
    assert (exact_local >= exact_global - 1e-7).all() and float(exact_global.max()) > 0.01


@pytest.mark.parametrize(("index", "real_columns"), [(1, REAL - WIDTH), (0, WIDTH)])
def test_each_shard_masks_only_its_padding_columns(index: int, real_columns: int) -> None:
    m = ShardLM(index)
    x = ids()
    with torch.no_grad():
        expected = m(x)
    pol = {**TP_POLICY, "checks": {**TP_POLICY["checks"], "padding_mass": {"action": "mask"}}}
    shard = (index * WIDTH, (index + 1) * WIDTH)
    with guard.attach(m, policy=pol, vocab_size=REAL, vocab_shard=shard) as g:
        out = m(x)
    assert torch.isneginf(out[..., real_columns:]).all()
    assert torch.equal(out[..., :real_columns], expected[..., :real_columns])
    assert g.stats["out_of_range"]["input"] == 1


@pytest.mark.parametrize(("shard", "tp", "match"), [
    ((64, 100), TP, r"spans 36 ids but the head has 64 output columns"),
    ((32, 96), TP, r"not one of vocab.tensor_parallel=2 equal shards"),
    ((64, 128), 1, r"not one of vocab.tensor_parallel=1 equal shards"),
    ((64, 32), TP, r"0 <= start < end"),
])
def test_bad_vocab_shard_is_an_attach_error(shard: tuple[int, int], tp: int, match: str) -> None:
    pol = {**TP_POLICY, "vocab": {"tensor_parallel": tp}}
    with pytest.raises(AttachError, match=match):
        guard.attach(ShardLM(1), policy=pol, vocab_size=REAL, vocab_shard=shard)


def test_shard_of_padding_only_is_an_attach_error() -> None:
    with pytest.raises(AttachError, match=r"holds padding ids only \(real vocab 60\)"):
        guard.attach(ShardLM(1), policy=TP_POLICY, vocab_size=60, vocab_shard=(WIDTH, ROWS))


def test_tensor_parallel_alignment_uses_the_whole_vocab() -> None:
    pol = {**TP_POLICY, "vocab": {"tensor_parallel": 4},
           "checks": {**TP_POLICY["checks"], "alignment": {"action": "fail"}}}
    m = nn.Module()
    m.wte, m.lm_head = nn.Embedding(ROWS, 16), nn.Linear(16, 40, bias=False)  # 4 x 40 = 160
    with pytest.raises(guard.GuardViolation, match="head rows 160 are not a multiple of 256"):
        guard.attach(m, policy=pol, vocab_size=REAL, vocab_shard=(80, 120))


def test_vocab_shard_takes_a_group_and_refuses_other_shapes() -> None:
    m = ShardLM(1)
    with guard.attach(m, policy=TP_POLICY, vocab_size=REAL, vocab_shard=(WIDTH, ROWS, None)) as g:
        assert (g.rows, g.audit.tensor_parallel) == (ROWS, TP)
    with pytest.raises(AttachError, match=r"vocab_shard must be \(start, end\) or \(start, end, "
                                          r"tp_group\), got \(1, 2, 3, 4\)"):
        guard.attach(ShardLM(1), policy=TP_POLICY, vocab_size=REAL,
                     vocab_shard=(1, 2, 3, 4))  # type: ignore[arg-type]


def test_a_shard_alone_in_its_process_quotes_the_threshold_it_enforced() -> None:
    # Without torch.distributed the other shards are absent: the mass is over this shard's
    # columns, and so is its threshold, which the message quotes.
    pol = {**TP_POLICY, "checks": {**TP_POLICY["checks"],
                                   "padding_mass": {"action": "fail", "exact": True}}}
    m = ShardLM(1)
    with guard.attach(m, policy=pol, vocab_size=REAL, vocab_shard=(WIDTH, ROWS)) as g:
        m(ids())
        with pytest.raises(guard.GuardViolation) as e:
            g.step()
    expected = bound(guard.load_policy(pol), REAL - WIDTH, WIDTH)
    assert e.value.threshold == pytest.approx(expected)
    assert "on the 28 padding columns [100, 128) (over this shard's 64 columns, the others' " \
        "absent)" in str(e.value)
