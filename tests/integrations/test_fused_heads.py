"""Forwards that compute the loss from the head's weight without calling the head: a
Liger-style fused linear-cross-entropy (chunked, written in plain torch: Liger itself needs a
GPU), a tied model's F.linear(h, wte.weight), and models the guard cannot measure."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import guard
from guard import GuardViolation
from tests.conftest import batch, findings, policy

REAL, ROWS, D = 100, 128, 32


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                               targets: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """What Liger's LigerFusedLinearCrossEntropyLoss computes, chunk by chunk so the whole
    (tokens, vocab) logits never exist at once; `weight` is (vocab, d)."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # (N, d), (N,)
    total = hidden.new_zeros(())
    for i in range(0, h.shape[0], chunk):
        logits = h[i : i + chunk] @ weight.T  # (chunk, vocab): only this chunk's
        total = total + F.cross_entropy(logits.float(), y[i : i + chunk], reduction="sum")
    return total / h.shape[0]


class FusedGPT(nn.Module):
    """Embedding -> MLP -> ln_f -> loss from lm_head.weight, lm_head never called in training."""

    def __init__(self, *, tied: bool = False, real_rows_to_kernel: bool = False,
                 final_norm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(ROWS, D)
        self.mlp = nn.Sequential(nn.Linear(D, D), nn.GELU())
        self.ln_f = nn.LayerNorm(D) if final_norm else nn.Identity()
        self.lm_head = nn.Linear(D, ROWS, bias=False)
        self.tied = tied
        if tied:
            self.lm_head.weight = self.wte.weight
        with torch.no_grad():  # garbage padding rows, as an uninitialised resize leaves them
            self.lm_head.weight[REAL:] = 8.0 * torch.randn(ROWS - REAL, D)
        self.real_rows_to_kernel = real_rows_to_kernel

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln_f(self.mlp(self.wte(idx)))  # (B, T, D)
        if targets is None:
            return self.lm_head(h)  # generation calls the head
        weight = self.wte.weight if self.tied else self.lm_head.weight
        if self.real_rows_to_kernel:
            weight = weight[:REAL]  # the recipe: the kernel sees the real rows only
        return fused_linear_cross_entropy(h, weight, targets)  # a plain 0-dim loss


def steps(model: nn.Module, g: guard.Guard, n: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(n):
        loss = model(*batch(seed=i))
        loss.backward()
        g.step()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_fail_stops_a_fused_forward_at_step_one(tied: bool) -> None:
    m = FusedGPT(tied=tied)
    with guard.attach(m, policy=policy(padding_mass={"action": "fail"}), vocab_size=REAL) as g, \
            pytest.raises(GuardViolation, match=r"padding_mass on rank 0 at step 1: "
                          r"the loss trained on (1|0\.9\d*) of the probability") as e:
        steps(m, g)
    assert e.value.step == 1


def test_a_fused_forward_is_measured_and_its_loss_seen() -> None:
    m = FusedGPT()
    pol = policy(padding_mass={"action": "warn"})
    with guard.attach(m, policy=pol, vocab_size=REAL) as g:
        losses = steps(m, g)
    s = g.stats
    assert s["padding_mass"] is not None and s["padding_mass"] > 0.9  # not None: seen
    assert s["loss"] == pytest.approx(losses[-1])  # the 0-dim tensor output is the loss
    assert "coverage" not in s["violations"]  # nothing blind: logits, labels and loss seen
    assert s["violations"] == {"padding_mass": {"warn": 3}}


def test_under_mask_the_guard_says_the_mask_cannot_reach_the_kernel(
        caplog: pytest.LogCaptureFixture) -> None:
    m = FusedGPT()
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=policy(), vocab_size=REAL) as g:
        steps(m, g, 1)
    assert "lm_head was not called: a fused kernel computed the loss from its weight" in \
        caplog.text
    assert "lm_head.weight[:100]" in caplog.text


def test_the_recipe_real_rows_to_the_kernel_trains_like_the_real_vocab() -> None:
    fused = FusedGPT(real_rows_to_kernel=True)
    plain = FusedGPT()
    with guard.attach(fused, policy=policy(), vocab_size=REAL) as g:
        fused_losses = steps(fused, g)
    with guard.attach(plain, policy=policy(), vocab_size=REAL) as g:
        opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        plain_losses = []
        for i in range(3):  # the same model through its head, masked by the guard
            x, y = batch(seed=i)
            logits = plain.lm_head(plain.ln_f(plain.mlp(plain.wte(x))))
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            g.step(loss)
            opt.step()
            opt.zero_grad()
            plain_losses.append(float(loss.detach()))
    assert fused_losses == pytest.approx(plain_losses, rel=1e-5)


def test_without_a_final_norm_coverage_says_the_logits_were_not_seen(
        caplog: pytest.LogCaptureFixture) -> None:
    m = FusedGPT(final_norm=False)
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=policy(padding_mass={"action": "warn"}),
                         vocab_size=REAL) as g:
        steps(m, g)
    assert g.stats["padding_mass"] is None
    assert g.stats["violations"]["coverage"] == {"warn": 3}  # every blind step counted
    blind = findings(caplog, "coverage")
    assert len(blind) == 1  # logged once
    assert "coverage on rank 0 at step 1: blind in 1 training step(s): padding_mass and " \
           "nonfinite saw no logits: lm_head was not called" in blind[0]


def test_coverage_fail_stops_at_the_first_blind_step() -> None:
    m = FusedGPT(final_norm=False)
    pol = policy(coverage={"action": "fail"})
    with guard.attach(m, policy=pol, vocab_size=REAL) as g, \
            pytest.raises(GuardViolation, match=r"coverage on rank 0 at step 1") as e:
        steps(m, g)
    assert (e.value.check, e.value.step) == ("coverage", 1)


def test_coverage_reaches_the_report_and_the_servers_run_state() -> None:
    from fastapi.testclient import TestClient

    from guard.sinks import MemorySink
    from guard_server import Settings, create_app

    m = FusedGPT(final_norm=False)
    sink = MemorySink()
    pol = {**policy(padding_mass={"action": "warn"}), "run_id": "blind-1"}
    with guard.attach(m, policy=pol, vocab_size=REAL) as g:
        g.add_sink(sink)
        steps(m, g)
    events = [e for r in sink.reports for e in r.events if e.check == "coverage"]
    assert len(events) == 1 and events[0].step == 1  # reported once, at the first blind step
    assert sink.reports[-1].violations["coverage"] == {"warn": 3}
    with TestClient(create_app(Settings())) as client:
        sent = client.post("/v1/reports", content=sink.batch().model_dump_json(),
                           headers={"content-type": "application/json"})
        assert sent.status_code == 202
        state = client.get("/v1/runs/blind-1").json()
        text = client.get("/metrics").text
    assert any(e["check"] == "coverage" for e in state["ranks"][0]["recent_events"])
    assert 'guard_violations_total{action="warn",check="coverage",rank="0",run_id="blind-1"} ' \
           '3.0' in text
