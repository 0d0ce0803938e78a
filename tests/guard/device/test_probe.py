"""The probe on small modules: what it measures, what it masks, and that off costs no hook."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from guard.device.checks import padding_mass, sample_rows
from guard.device.flags import Flags
from guard.device.loss import StepLoss
from guard.device.probe import Probe, ProbeConfig, find_loss, labels_position
from guard.policy import Policy
from guard.policy_file import coerce_policy
from guard.vocab.discover import Heads
from guard.vocab.sizes import audit_sizes
from tests.conftest import batch, policy, tiny_gpt


def probe_for(model: nn.Module, pol: Policy, real: int = 100,
              rows: int = 128) -> tuple[Probe, list[torch.utils.hooks.RemovableHandle]]:
    audit = audit_sizes(real=real, rows=rows, embedding_rows=rows, tied=True)
    flags = Flags.from_policy(pol, torch.device("cpu"), rank=0)
    probe = Probe(ProbeConfig.from_policy(pol, audit), flags,
                  StepLoss.from_policy(pol, flags))
    heads = Heads(model.wte, model.lm_head, "wte", "lm_head")  # type: ignore[arg-type]
    return probe, probe.install(model, heads)


def test_config_from_the_policy_and_a_vocab_shard() -> None:
    audit = audit_sizes(real=100, rows=128, embedding_rows=128, tied=True)
    pol = coerce_policy(policy(padding_mass={"action": "warn", "sample_tokens": 8}))
    c = ProbeConfig.from_policy(pol, audit)
    assert (c.real, c.rows, c.real_columns, c.mask, c.padding_mass, c.sample_tokens) == \
        (100, 128, 100, False, True, 8)
    shard = ProbeConfig.from_policy(coerce_policy(policy()), audit, (64, 128))
    assert (shard.rows, shard.real_columns, shard.mask) == (64, 36, True)  # ids [64, 100) real


def test_sampled_padding_mass_is_the_mean_over_sample_tokens_positions() -> None:
    m = tiny_gpt(garbage=0.3)
    pol = coerce_policy(policy(padding_mass={"action": "warn", "sample_tokens": 8}))
    probe, _ = probe_for(m, pol)
    x, y = batch()
    logits, _ = m(x, y)
    reading = probe.flags.read(lagged=False)
    flat = logits.detach().reshape(-1, 128)  # 64 positions, warn: not masked
    expected = padding_mass(sample_rows(flat, 8, 0), 100)  # (8,)
    assert reading is not None
    assert reading.local.padding_mass == pytest.approx(float(expected.mean()), rel=1e-5)
    assert reading.local.padding_mass_max == pytest.approx(float(expected.max()), rel=1e-5)


def test_mask_sets_the_padding_logits_to_minus_inf_in_every_position() -> None:
    m = tiny_gpt(garbage=0.3)
    probe_for(m, coerce_policy(policy()))
    logits, _ = m(*batch())
    assert torch.isneginf(logits[..., 100:]).all() and torch.isfinite(logits[..., :100]).all()


def test_ghost_ids_and_the_models_loss_reach_the_flags() -> None:
    m = tiny_gpt()
    probe, _ = probe_for(m, coerce_policy(policy()))
    x, y = batch()
    x[0, :3], y[1, 0], y[1, 1] = 110, 120, -100  # three ghost inputs, one ghost label
    _, loss = m(x, y)
    probe.loss.fold()
    reading = probe.flags.read(lagged=False)
    assert reading is not None and reading.local.out_of_range == {"input": 3, "label": 1}
    assert reading.local.loss == pytest.approx(float(loss.detach()))  # +inf: a masked ghost


def test_eval_forwards_are_not_measured() -> None:
    m = tiny_gpt(garbage=0.3)
    probe, _ = probe_for(m, coerce_policy(policy(padding_mass={"action": "warn"})))
    m.eval()
    m(*batch())
    reading = probe.flags.read(lagged=False)
    assert reading is not None and reading.local.padding_mass is None


def test_checks_that_are_off_get_no_hook() -> None:
    off = {c: {"action": "off"} for c in ("padding_mass", "nonfinite", "token_range")}
    m = tiny_gpt()
    _, handles = probe_for(m, coerce_policy(policy(**off)))
    assert len(handles) == 2  # the model's own pre- and post-hook: labels, loss
    assert not m.wte._forward_pre_hooks and not m.lm_head._forward_hooks


def test_find_loss_in_the_usual_outputs() -> None:
    loss = torch.tensor(1.5)
    assert find_loss((torch.ones(2, 3), loss)) is loss  # nanoGPT
    assert find_loss({"loss": loss, "logits": torch.ones(2)}) is loss
    assert find_loss(torch.ones(2, 3)) is None
    assert find_loss((torch.ones(2), torch.tensor(3))) is None  # an int is not a loss


def test_labels_position_from_the_signature() -> None:
    class M(nn.Module):
        def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> None: ...

    assert labels_position(M()) == 1 and labels_position(nn.Linear(2, 2)) is None
