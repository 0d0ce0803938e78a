"""An attach that fails changes nothing (issue 20): every refusal leaves the weights, the
generation_config and the hooks as they were, on a real HF model whose padding rows hold
garbage (so a repair, had it run, would show) under the default `padding_rows: repair`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
from transformers import GPT2LMHeadModel

import guard
from guard import AttachError, GuardViolation, PolicyError
from guard.integrations.transformers import GuardCallback
from tests.conftest import hook_count
from tests.integrations.test_transformers import examples, gpt2, trainer, word_tokenizer

REPAIR: dict[str, Any] = {"export": {"serve": None}}  # the default policy: padding_rows repair
# What the guard may set on the model's instance while attached (the HF loss function it
# wraps, the fused head's real rows).
_OURS = {"_loss_function", "get_output_embeddings"}


def state(model: GPT2LMHeadModel) -> tuple[dict[str, torch.Tensor], list[int], int, set[str]]:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            list(model.generation_config.suppress_tokens or []), hook_count(model),
            set(model.__dict__) & _OURS)


def unchanged(model: GPT2LMHeadModel, before: tuple[Any, ...]) -> None:
    weights, suppress, hooks, attributes = before
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert list(model.generation_config.suppress_tokens or []) == suppress
    assert hook_count(model) == hooks
    assert set(model.__dict__) & _OURS == attributes  # no wrapper left behind


class Unreachable:  # a wrapper with nothing hookable inside
    optimizer = None

    def step(self) -> None:
        pass


def _policy(**extra: Any) -> dict[str, Any]:
    return {**REPAIR, **extra}


REFUSALS: dict[str, tuple[Callable[[GPT2LMHeadModel, Any], Any], type[Exception], str]] = {
    "unreachable optimizer": (
        lambda m, tok: guard.attach(m, policy=REPAIR, tokenizer=tok, optimizer=Unreachable()),
        AttachError, "cannot reach a torch.optim.Optimizer through Unreachable"),
    "skip without optimizer": (
        lambda m, tok: guard.attach(m, policy=_policy(checks={"nonfinite": {"action": "skip"}}),
                                    tokenizer=tok),
        AttachError, "skip drops the optimizer step"),
    "vocab: tokenizer larger than the rows": (
        lambda m, tok: guard.attach(m, policy=REPAIR, tokenizer=word_tokenizer(extra=40)),
        GuardViolation, "vocab on rank 0 at attach"),
    "alignment": (
        lambda m, tok: guard.attach(m, policy=_policy(vocab={"pad_multiple": 128}),
                                    tokenizer=tok),
        GuardViolation, "alignment on rank 0 at attach"),
    "padding_rows: fail": (
        lambda m, tok: guard.attach(m, policy=_policy(checks={"padding_rows": {"action":
                                                                               "fail"}}),
                                    tokenizer=tok),
        GuardViolation, "padding_rows on rank 0 at step 0"),
    "no real vocab, coverage: fail": (
        lambda m, tok: guard.attach(m, policy=_policy(checks={"coverage": {"action": "fail"}})),
        GuardViolation, "the real vocab size was not found"),
    "no real vocab, required": (
        lambda m, tok: guard.attach(m, policy=_policy(vocab={"require_real_size": True})),
        AttachError, "vocab.require_real_size: true"),
    "ambiguous real vocab": (
        lambda m, tok: guard.attach(m, policy=REPAIR, tokenizer=tok, vocab_size=len(tok) + 1),
        AttachError, "the real vocab size is ambiguous"),
    "unknown policy key": (
        lambda m, tok: guard.attach(m, policy=_policy(cheks={}), tokenizer=tok),
        PolicyError, "cheks"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_a_refused_attach_changes_nothing(refusal: str) -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok), garbage=50.0)
    before = state(model)
    attach, error, match = REFUSALS[refusal]
    with pytest.raises(error, match=match):
        attach(model, tok)
    unchanged(model, before)
    # ... and an attach that is not refused does change it: the repair shows.
    with guard.attach(model, policy=REPAIR, tokenizer=tok):
        pass
    assert not torch.equal(model.state_dict()["lm_head.weight"], before[0]["lm_head.weight"])


def test_an_attach_refused_while_another_guard_holds_the_model_changes_nothing() -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok), garbage=50.0)
    with guard.attach(model, policy=REPAIR, tokenizer=tok):
        before = state(model)
        with pytest.raises(AttachError, match="already attached"):
            guard.attach(model, policy=REPAIR, tokenizer=tok)
        unchanged(model, before)


def test_label_smoothing_is_refused_before_the_callback_attaches(tmp_path: Path) -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok), garbage=50.0)
    before = state(model)
    cb = GuardCallback(policy=REPAIR)
    t = trainer(model, tok, examples(tok), cb, tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(AttachError, match=r"label_smoothing_factor=0\.1 smooths over all 64"):
        t.train()
    unchanged(model, before)
