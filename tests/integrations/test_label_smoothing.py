"""Label smoothing (issue 39 item 2): where the guard reaches the loss (the HF Trainer's label
smoother through guard_trainer) it trains on the smoothed loss over the real columns under
`mask`; in a loop of one's own, a loss smoothed over every column is +inf under the mask, and
the guard names that cause."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")
from transformers import GPT2LMHeadModel

import guard
from guard import AttachError, GuardViolation
from guard.integrations.transformers import GuardCallback, guard_trainer
from tests.conftest import hook_count, policy
from tests.integrations.test_transformers import examples, gpt2, trainer, word_tokenizer


def _step_one(model: GPT2LMHeadModel, out: Path, *, guarded: bool
              ) -> tuple[float, torch.Tensor, GuardCallback | None]:
    """One Trainer step with label_smoothing_factor=0.1: (the logged loss, the head's
    gradient, the callback)."""
    tok = word_tokenizer()
    grads: list[torch.Tensor] = []
    model.get_output_embeddings().weight.register_hook(
        lambda g: grads.append(g.detach().clone()) or None)
    t = trainer(model, tok, examples(tok), None, out, steps=1, label_smoothing_factor=0.1)
    cb = guard_trainer(t, policy=policy()) if guarded else None
    t.train()
    assert t.label_smoother is not None and type(t.label_smoother).__name__ == "LabelSmoother"
    (loss,) = [e["loss"] for e in t.state.log_history if "loss" in e]
    (grad,) = grads
    return loss, grad, cb


def test_hf_trainer_label_smoothing_trains_the_real_vocab_smoothed_loss(tmp_path: Path) -> None:
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real, garbage=1.0)  # hot padding rows: unmasked, they would take probability
    reference = copy.deepcopy(model)
    reference.resize_token_embeddings(real)  # the same weights without the padding rows
    want, want_grad, _ = _step_one(reference, tmp_path / "ref", guarded=False)
    loss, grad, cb = _step_one(model, tmp_path / "run", guarded=True)
    assert loss == pytest.approx(want, abs=1e-4)  # the Trainer's smoothed loss over real ids
    assert grad.shape[0] == 64 and grad[real:].abs().max() == 0  # no gradient to the padding
    assert torch.allclose(grad[:real], want_grad, atol=1e-5)
    assert cb is not None and cb.guard is not None
    s = cb.guard.stats
    assert s["loss"] == pytest.approx(loss, rel=1e-4)  # the loss the Trainer backpropagated
    assert s["violations"] == {}  # the labels reached token_range: coverage saw them
    cb.release()
    assert hook_count(model) == 0


def test_label_smoothing_given_as_callbacks_is_refused_naming_guard_trainer(
        tmp_path: Path) -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok))
    cb = GuardCallback(policy=policy())
    t = trainer(model, tok, examples(tok), cb, tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(AttachError, match=r"label_smoothing_factor=0\.1 smooths over all 64 .*"
                       r"callbacks=\[\.\.\.\].*guard_trainer\(trainer, \.\.\.\)"):
        t.train()
    assert t.state.global_step == 0 and hook_count(model) == 0


def test_own_loop_smoothed_over_every_column_names_the_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    """At attach the guard says how (slice to the real columns); the +inf loss of a loss
    smoothed over every column is named as that, not left a NaN mystery."""
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = examples(tok)[:4]
    ids = torch.stack([b["input_ids"] for b in batch])
    with caplog.at_level(logging.INFO, logger="guard"):
        g = guard.attach(model, policy=policy(nonfinite={"action": "fail"}), tokenizer=tok,
                         optimizer=opt)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"logits[..., :{real}]" in said and "label smoothing" in said
    with g:
        logits = model(ids).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), label_smoothing=0.1)
        assert loss.item() == float("inf")
        g.step(loss)
        loss.backward()
        with pytest.raises(GuardViolation, match=(
                r"[Tt]he loss is inf: a loss over every column with the padding columns masked "
                rf"to -inf \(label smoothing\?\): compute it over logits\[\.\.\., :{real}\]")):
            opt.step()
