"""The logits the loss sees (issue 19), on real transformers models that change the lm_head's
output before their loss: Gemma-2's softcap tanh(x / 30) * 30, Cohere's logit_scale (x *
0.0625), Granite's logits_scaling (x / 4). The padding mass the guard reports is that of the
logits the loss uses, and under `mask` the padding columns are -inf there (a -inf set at the
head would come out of the softcap as -30)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    PreTrainedModel,
)

import guard
import guard.device.site
from guard import padding_mass
from tests.conftest import no_host_reads, policy

REAL, ROWS = 100, 128
_SIZE = dict(vocab_size=ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
MODELS: dict[str, Any] = {
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**_SIZE)),  # softcap 30
    "cohere": lambda: CohereForCausalLM(CohereConfig(**_SIZE)),  # logit_scale 0.0625
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**_SIZE, logits_scaling=4.0)),
}


def model_of(name: str) -> PreTrainedModel:
    """A tiny model whose padding rows [REAL, ROWS) of the head hold garbage (std 0.5, 25x the
    init's)."""
    torch.manual_seed(0)
    m = MODELS[name]()
    with torch.no_grad():
        w = m.get_output_embeddings().weight
        w[REAL:] = torch.randn(ROWS - REAL, w.shape[1]) * 0.5
    m.train()
    return m


def _ids() -> torch.Tensor:
    return torch.randint(3, REAL, (2, 12), generator=torch.Generator().manual_seed(1))


def _loss_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """The logits the model's loss uses, from an unguarded forward (no dropout in these)."""
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_mass_reported_is_the_mass_in_the_logits_the_loss_uses(name: str) -> None:
    model = model_of(name)
    ids = _ids()
    expected = padding_mass(_loss_logits(model, ids), REAL)  # (2, 12)
    if name != "gemma2":  # a softcap of 30 barely moves logits this small; a scale does
        with torch.no_grad():
            head = model.lm_head(model.model(input_ids=ids).last_hidden_state).float()
        # The head's mass is not the loss's: 0.84 against 0.22 here.
        assert padding_mass(head, REAL).mean() > 2 * expected.mean()
    exact = policy(padding_mass={"action": "warn", "exact": True})
    with guard.attach(model, policy=exact, vocab_size=REAL) as g:
        model(input_ids=ids, labels=ids).loss.backward()
        g.step()
    assert g.stats["padding_mass"] == pytest.approx(expected.mean().item(), rel=1e-4)
    assert g.stats["padding_mass_max"] == pytest.approx(expected.max().item(), rel=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_mask_is_minus_inf_in_the_logits_the_loss_uses(name: str) -> None:
    model = model_of(name)
    ids = _ids()
    real_only = _loss_logits(model, ids)[..., :REAL]
    shifted, targets = real_only[:, :-1].reshape(-1, REAL), ids[:, 1:].reshape(-1)
    reference = torch.nn.functional.cross_entropy(shifted, targets)
    with guard.attach(model, policy=policy(), vocab_size=REAL) as g:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        g.step()
    assert torch.isneginf(out.logits[..., REAL:]).all()  # not -30 from tanh(-inf) * 30
    assert out.loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert g.stats["violations"] == {}  # the mask did its job
    assert model.get_output_embeddings().weight.grad[REAL:].abs().max() == 0  # type: ignore[union-attr]


def test_a_loss_computed_outside_the_model_sees_the_mask_too() -> None:
    model = model_of("gemma2")
    ids = _ids()
    with guard.attach(model, policy=policy(), vocab_size=REAL) as g:
        logits = model(input_ids=ids).logits  # no labels: the loss is the user's
        assert torch.isneginf(logits[..., REAL:]).all()
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, ROWS),
                                          ids[:, 1:].reshape(-1)).backward()
        g.step()
        model.eval()
        with torch.no_grad():  # generation scores: the padding ids can never be picked
            assert torch.isneginf(model(input_ids=ids).logits[..., REAL:]).all()
    assert g.stats["padding_mass"] is not None and g.stats["padding_mass"] > 0.01


def test_a_transform_the_guard_does_not_know_is_found_at_the_first_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without the config attribute known, the first training forward shows the loss function
    logits that are not the head's: masked there at once, measured there from step 2."""
    monkeypatch.setattr(guard.device.site, "_TRANSFORMS", {})
    model = model_of("gemma2")
    ids = _ids()
    expected = padding_mass(_loss_logits(model, ids), REAL).mean().item()
    exact = policy(padding_mass={"exact": True})
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(model, policy=exact, vocab_size=REAL) as g:
        for _ in range(2):
            out = model(input_ids=ids, labels=ids)
            assert torch.isneginf(out.logits[..., REAL:]).all()
            out.loss.backward()
            g.step()
            model.zero_grad()  # no optimizer: the weights stay, so the mass does
        second = g.stats["padding_mass"]
    said = [r.getMessage() for r in caplog.records if "changes its logits" in r.getMessage()]
    assert len(said) == 1 and "from the next step the padding mass is measured" in said[0]
    assert second == pytest.approx(expected, rel=1e-4)


def test_compiled_the_mask_reaches_the_loss_and_the_output_without_a_graph_break() -> None:
    """Under torch.compile the mask is functional (a new tensor): the loss function gets the
    masked logits and the model returns them, in one graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = model_of("gemma2")
    ids = _ids()
    real_only = _loss_logits(model, ids)[..., :REAL]
    reference = torch.nn.functional.cross_entropy(real_only[:, :-1].reshape(-1, REAL),
                                                  ids[:, 1:].reshape(-1))
    with guard.attach(model, policy=policy(), vocab_size=REAL) as g:
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(3):
            out = compiled(input_ids=ids, labels=ids)
            out.loss.backward()
            g.step()
            model.zero_grad()
            assert torch.isneginf(out.logits[..., REAL:]).all()
            assert out.loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1  # no recompile per step
    torch._dynamo.reset()


def test_the_loss_site_reads_nothing_to_the_host() -> None:
    model = model_of("gemma2")
    ids = _ids()
    with guard.attach(model, policy=policy(), vocab_size=REAL) as g:
        with no_host_reads():
            out = model(input_ids=ids, labels=ids)  # measured and masked at the loss function
            out.loss.backward()
        g.step()
    assert g.stats["padding_mass"] is not None
