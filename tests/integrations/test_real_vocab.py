"""The real vocab, found or asked for (issue 19), on real transformers objects: a model resized
with pad_to_multiple_of=64 and attached without a tokenizer is a blind attach said once at
WARNING; the checkpoint's tokenizer files or an unpadded size in the config are found; a
tokenizer of another model is a vocab warning; the policy can make a blind attach an error."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from transformers import GPT2LMHeadModel

import guard
from guard import AttachError, GuardViolation
from guard.checkpoint_audit import audit_checkpoint
from tests.conftest import policy
from tests.integrations.test_transformers import examples, gpt2, word_tokenizer


def _step(model: GPT2LMHeadModel, ids: torch.Tensor, labels: torch.Tensor,
          opt: torch.optim.Optimizer) -> None:
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad()


def _batch(tok: object, *, ghost: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    data = examples(tok, ghost=ghost)[:2]  # type: ignore[arg-type]
    return torch.stack([d["input_ids"] for d in data]), torch.stack([d["labels"] for d in data])


def test_without_a_tokenizer_the_attach_is_blind_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok))  # resized with pad_to_multiple_of=64: config.vocab_size is 64 now
    model.train()
    assert model.config.vocab_size == 64
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids, labels = _batch(tok, ghost=60)  # a ghost label: the guard cannot know it is one
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(model, policy=policy(), optimizer=opt) as g:
        for _ in range(3):
            _step(model, ids, labels, opt)
    blind = [r for r in caplog.records if "real vocab size was not found" in r.getMessage()]
    assert len(blind) == 1 and blind[0].levelno == logging.WARNING  # once, not per step
    text = blind[0].getMessage()
    assert "every one of the 64 rows is taken as real" in text
    assert "Give it: guard.attach(model, tokenizer=tok), guard.attach(model, " \
           "vocab_size=len(tok)), or vocab.real_size in the policy" in text
    assert (g.real, g.rows) == (64, 64)
    # Counted as a blind attach (GuardBlind), once.
    assert g.stats["violations"] == {"coverage": {"warn": 1}}


def test_the_tokenizer_files_of_the_checkpoint_give_the_real_vocab(tmp_path: Path) -> None:
    tok = word_tokenizer()
    gpt2(len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model = GPT2LMHeadModel.from_pretrained(tmp_path)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids, labels = _batch(tok, ghost=60)
    with guard.attach(model, policy=policy(), optimizer=opt) as g:
        assert (g.real, g.rows) == (len(tok), 64)
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 1: 2 label ids "
                           rf"outside \[0, {len(tok)}\).*beyond the real vocab {len(tok)} "
                           r"\(tokenizer.json"):
            _step(model, ids, labels, opt)
    assert "coverage" not in g.stats["violations"]


def test_a_config_that_keeps_the_unpadded_size_gives_it() -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok))
    model.config.unpadded_vocab_size = len(tok)
    with guard.attach(model, policy=policy()) as g:
        assert (g.real, g.rows) == (len(tok), 64)
    assert guard.audit(model).real == len(tok)


def test_the_policy_can_make_a_blind_attach_an_error() -> None:
    model = gpt2(len(word_tokenizer()))
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with pytest.raises(AttachError, match=r"the real vocab size was not found \(its config keeps "
                       r"no unpadded size; no local checkpoint directory.*\) and the policy sets "
                       r"vocab.require_real_size: true; give it: guard.attach\(model, "
                       r"tokenizer=tok\)"):
        guard.attach(model, policy={**policy(), "vocab": {"require_real_size": True}})
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for m in model.modules()) == hooks
    with guard.attach(model, policy={**policy(), "vocab": {"require_real_size": True}},
                      tokenizer=word_tokenizer()):
        pass


def test_a_tokenizer_of_another_model_is_a_vocab_warning(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """A tokenizer far smaller than the rows: 128 rows, a tokenizer of ~30 ids (98 padding
    rows: over one alignment block and 1/32 of the rows). Warned at attach whatever
    vocab's action, and `guard.audit` says the same; a tokenizer that fits says nothing."""
    tok = word_tokenizer()
    model = gpt2(100)  # 128 rows
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(model, policy=policy(), tokenizer=tok) as g:
        pass
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vocab on")]
    assert len(said) == 1 and f"the real vocab {len(tok)} (len(tokenizer))" in said[0]
    assert f"{128 - len(tok)} padding rows ({len(tok)} real ids in 128 rows)" in said[0]
    assert g.stats["violations"] == {"vocab": {"warn": 1}}
    audit = guard.audit(model, tokenizer=tok)
    assert audit.ok and "warning: " in str(audit) and "likely another model's" in str(audit)
    fits = gpt2(len(tok))
    assert guard.audit(fits, tokenizer=tok).vocab_warnings == ()
    # `guard audit DIR` of the saved checkpoint says the same (a warning: exit 0).
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    saved = audit_checkpoint(tmp_path)
    assert saved.ok and saved.audit.vocab_warnings == audit.vocab_warnings
    assert "warning: " in str(saved) and saved.to_dict()["audit"]["vocab_warnings"]  # type: ignore[index]
