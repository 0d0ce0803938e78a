"""torchtune (issue 20): its Llama 3.2, Qwen2 and Gemma builders tie the output through
`TiedLinear`, which is not an nn.Module: it calls a weightless `Linear` module with the
embedding's weight. Discovery finds the tied weight; measure, mask, repair and fail work, with
the builders' own models at tiny sizes, and with the chunked output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtune")  # with torchao 0.14.1: its NF4 tensors, not its C++ kernels
from torchtune.models.llama3_2 import llama3_2
from torchtune.models.qwen2 import qwen2
from torchtune.modules.loss import CEWithChunkedOutputLoss

import guard
from guard import GuardViolation
from tests.conftest import policy

REAL, ROWS = 100, 128
SIZE: dict[str, Any] = dict(vocab_size=ROWS, num_layers=1, num_heads=2, num_kv_heads=1,
                            embed_dim=32, max_seq_len=64, intermediate_dim=64)
BUILDERS: dict[str, Callable[[], Any]] = {
    "llama3_2": lambda: llama3_2(**SIZE),  # tied by default
    "qwen2": lambda: qwen2(**SIZE, tie_word_embeddings=True),
}


def build(name: str, *, garbage: float | None = None) -> Any:
    """A builder's model; `garbage`: padding rows of that std (torchtune's rows are N(0, 1),
    so 50 makes row norms 10x the real ones' and more: an uninitialised resize)."""
    torch.manual_seed(0)
    m = BUILDERS[name]()
    if garbage is not None:
        with torch.no_grad():
            w = m.tok_embeddings.weight
            w[REAL:] = torch.randn(ROWS - REAL, w.shape[1]) * garbage
    m.train()
    return m


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, REAL, (2, 16), generator=g), torch.randint(0, REAL, (2, 16),
                                                                        generator=g)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_tied_output_is_found_masked_and_measured(name: str) -> None:
    model = build(name)
    heads = guard.find_heads(model)
    assert (heads.embedding_name, heads.lm_head_name, heads.tied) == ("tok_embeddings",
                                                                      "output", True)
    x, y = tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard.attach(model, policy=policy(), vocab_size=REAL, optimizer=opt) as g:
        logits = model(x)  # torchtune's recipes compute the loss outside the model
        assert torch.isneginf(logits[..., REAL:]).all()
        loss = F.cross_entropy(logits.reshape(-1, ROWS), y.reshape(-1))
        loss.backward()
        g.step(loss)
        assert model.tok_embeddings.weight.grad[REAL:].abs().max() == 0
        opt.step()
    assert g.stats["padding_mass"] is not None  # measured (a figure: tiny on this init)
    assert g.stats["loss"] == pytest.approx(loss.item())


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_garbage_in_the_tied_rows_is_repaired_or_stops_the_step(name: str) -> None:
    model = build(name, garbage=50.0)
    w = model.tok_embeddings.weight
    with guard.attach(model, policy=policy(padding_rows={"action": "repair"}), vocab_size=REAL):
        assert torch.allclose(w[REAL:], w[:REAL].mean(dim=0).expand(ROWS - REAL, -1))

    model = build(name, garbage=50.0)
    before = model.tok_embeddings.weight.clone()
    x, y = tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = policy(padding_mass={"action": "fail"})
    with guard.attach(model, policy=stop, vocab_size=REAL, optimizer=opt):
        loss = F.cross_entropy(model(x).reshape(-1, ROWS), y.reshape(-1))
        loss.backward()
        with pytest.raises(GuardViolation, match=r"padding_mass on rank 0 at step 1"):
            opt.step()
    assert torch.equal(model.tok_embeddings.weight, before)


def test_the_chunked_output_is_masked_chunk_by_chunk() -> None:
    """set_num_output_chunks: the head runs once per chunk; the chunked loss is the real-vocab
    loss, and no chunk is taken for a transform of the logits."""
    model = build("llama3_2", garbage=10.0)
    model.set_num_output_chunks(4)
    x, y = tokens()
    with torch.no_grad():
        full = torch.cat(model(x), dim=1)[..., :REAL]  # unguarded: the real columns only
    expected = F.cross_entropy(full.reshape(-1, REAL), y.reshape(-1))
    with guard.attach(model, policy=policy(), vocab_size=REAL) as g:
        chunks = model(x)
        assert len(chunks) == 4 and all(torch.isneginf(c[..., REAL:]).all() for c in chunks)
        loss = CEWithChunkedOutputLoss(num_output_chunks=4)(chunks, y)
        loss.backward()
        g.step(loss)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert g.stats["padding_mass"] is not None
    assert "padding_mass" not in g.stats["violations"]
