from __future__ import annotations

import pytest
import torch
from torch import nn

import guard
from guard import AttachError
from guard.vocab.discover import discover
from tests.conftest import QUIET, tiny_gpt


def hf_gpt2(real: int = 100, pad_to: int | None = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=real, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                     bos_token_id=0, eos_token_id=0)
    m = GPT2LMHeadModel(cfg)
    if pad_to:
        m.resize_token_embeddings(real, pad_to_multiple_of=pad_to, mean_resizing=False)
    return m


def test_nanogpt_tied() -> None:
    m = tiny_gpt()
    h = discover(m)
    assert (h.embedding_name, h.lm_head_name) == ("wte", "lm_head")
    assert h.tied and h.embedding_rows == h.head_rows == 128


def test_nanogpt_untied() -> None:
    h = discover(tiny_gpt(tie=False))
    assert not h.tied and h.lm_head_name == "lm_head"


def test_hf_gpt2_resized_to_multiple_of_64() -> None:
    m = hf_gpt2()
    h = discover(m)
    assert h.embedding is m.get_input_embeddings() and h.lm_head is m.get_output_embeddings()
    assert h.tied and h.head_rows == 128 == m.config.vocab_size
    a = guard.audit(m, vocab_size=100)
    assert a.ok and (a.real, a.rows, a.aligned) == (100, 128, 128)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(128, 8)
        self.proj_a = nn.Linear(8, 128)
        self.proj_b = nn.Linear(8, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_a(self.tok(x)) + self.proj_b(self.tok(x))


def test_ambiguous_head_names_candidates_and_explicit_override() -> None:
    m = TwoHeads()
    with pytest.raises(AttachError, match=r"several candidates: proj_a .*proj_b.*pass lm_head="):
        discover(m)
    h = discover(m, lm_head=m.proj_b)
    assert h.lm_head_name == "proj_b" and h.embedding_name == "tok"


def test_no_head_and_no_embedding() -> None:
    with pytest.raises(AttachError, match=r"cannot find the output head.*pass lm_head="):
        discover(nn.Sequential(nn.Embedding(10, 4), nn.ReLU()))
    with pytest.raises(AttachError, match=r"has no nn.Embedding.*pass embedding="):
        discover(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 10)), lm_head=nn.Linear(4, 10))
    with pytest.raises(AttachError, match=r"needs a torch.nn.Module"):
        guard.attach("model")  # type: ignore[arg-type]


def test_second_attach_is_refused_until_detach() -> None:
    m = tiny_gpt()
    g = guard.attach(m, policy=QUIET, vocab_size=100)
    with pytest.raises(AttachError, match=r"already attached.*detach"):
        guard.attach(m, policy=QUIET, vocab_size=100)
    g.detach()
    guard.attach(m, policy=QUIET, vocab_size=100).detach()


def test_real_vocab_sources_must_agree() -> None:
    m = tiny_gpt()

    class Tok:
        def __len__(self) -> int:
            return 90

    with pytest.raises(AttachError, match=r"ambiguous: vocab_size= 100, len\(tokenizer\) 90"):
        guard.attach(m, policy=QUIET, vocab_size=100, tokenizer=Tok())
    with pytest.raises(AttachError, match=r"policy vocab.real_size 80"):
        guard.attach(m, policy={**QUIET, "vocab": {"real_size": 80}}, vocab_size=100)
    with pytest.raises(AttachError, match="must support len"):
        guard.attach(m, policy=QUIET, tokenizer=object())
    with guard.attach(m, policy=QUIET, tokenizer=Tok()) as g:
        assert g.real == 90 and g.vocab == {"real": 90, "rows": 128, "aligned": 128}
    with guard.attach(m, policy=QUIET) as g:
        assert g.real == 128  # no source: no padding
