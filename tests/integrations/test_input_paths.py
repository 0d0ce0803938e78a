"""Every input path hooked (issue 19), on real transformers models: T5's encoder and decoder
embed through their own modules that share the embedding's weight (`shared` itself is never
called), and a forward given `inputs_embeds` shows the embedding no ids at all."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import guard
from guard import GuardViolation
from tests.conftest import findings, policy
from tests.integrations.test_transformers import examples, gpt2, word_tokenizer

REAL, ROWS = 100, 128


def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    m = T5ForConditionalGeneration(T5Config(vocab_size=ROWS, d_model=32, d_ff=64, num_layers=1,
                                            num_heads=2, d_kv=16, decoder_start_token_id=0))
    m.train()
    return m


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(2, REAL, (2, 8), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("where", ["input_ids", "decoder_input_ids"])
def test_ghost_ids_through_the_encoders_and_decoders_own_embeddings_are_caught(
        where: str) -> None:
    model = t5()
    assert guard.find_heads(model).embedding_name == "shared"  # what HF calls the embedding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = {"input_ids": _ids(0), "decoder_input_ids": _ids(1), "labels": _ids(2)}
    inputs[where][1, 3] = 110  # a ghost id: it has a row, the tokenizer cannot produce it
    with guard.attach(model, policy=policy(), vocab_size=REAL, optimizer=opt):
        model(**inputs).loss.backward()
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 1: 1 input id "
                           r"outside \[0, 100\).*the highest: input ids 110 at \[1, 3\]"):
            opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_every_module_sharing_the_embeddings_weight_is_watched_under_warn() -> None:
    model = t5()
    warn = policy(token_range={"action": "warn"})
    with guard.attach(model, policy=warn, vocab_size=REAL) as g:
        ids = _ids(0)
        ids[0, 0] = 120
        dec = _ids(1)
        dec[1, 1] = 121
        model(input_ids=ids, decoder_input_ids=dec, labels=_ids(2)).loss.backward()
        g.step()
    assert g.stats["out_of_range"]["input"] == 2  # one through each of the two modules


def test_a_training_step_whose_embedding_saw_no_ids_is_blind(
        caplog: pytest.LogCaptureFixture) -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok))
    model.train()
    data = examples(tok)[:2]
    ids = torch.stack([d["input_ids"] for d in data])
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(model, policy=policy(), tokenizer=tok) as g:
        for _ in range(3):
            # Embedded by F.embedding on the weight: no module the guard hooks sees the ids.
            embeds = torch.nn.functional.embedding(ids, model.get_input_embeddings().weight)
            model(inputs_embeds=embeds, labels=ids).loss.backward()
            g.step()
    assert g.stats["violations"] == {"coverage": {"warn": 3}}  # every blind step counted
    said = findings(caplog, "coverage")
    assert len(said) == 1  # logged once
    assert "token_range saw no input ids: no module that embeds with the embedding's weight " \
           "was called with ids in the training forward (inputs_embeds passed instead" in said[0]
