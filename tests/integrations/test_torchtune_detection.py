"""torchtune's tied llama3_2 with 24 padding rows of 5*randn garbage, batch 4 x 16,
`padding_mass: fail`: stopped at step 1, before any update with the garbage (issue 39). Its
embedding rows are nn.Embedding's unit scale, so each position's own token gives it a large
real logit and the garbage misses some positions: the strided sample alone stopped 6 of these
8 seeds at step 2 or later (embed_dim 128)."""

from __future__ import annotations

import pytest
import torch

import guard
from tests.conftest import policy

builders = pytest.importorskip("torchtune.models.llama3_2._component_builders")


@pytest.mark.parametrize("dim", [128])
@pytest.mark.parametrize("seed", range(8))
def test_tied_llama3_2_garbage_rows_stop_at_step_1(seed: int, dim: int) -> None:
    torch.manual_seed(seed)
    m = builders.llama3_2(vocab_size=1024, num_layers=1, num_heads=2, num_kv_heads=1,
                          embed_dim=dim, max_seq_len=64, intermediate_dim=2 * dim,
                          tie_word_embeddings=True)
    with torch.no_grad():
        m.tok_embeddings.weight[1000:] = torch.randn(24, dim) * 5
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = guard.attach(m, policy=policy(padding_mass={"action": "fail"}), vocab_size=1000,
                     optimizer=opt)
    stopped = None
    try:
        for step in (1, 2, 3):
            gen = torch.Generator().manual_seed(seed * 10 + step)
            x = torch.randint(0, 1000, (4, 16), generator=gen)
            y = torch.randint(0, 1000, (4, 16), generator=gen)
            opt.zero_grad()
            logits = m(x)
            loss: torch.Tensor = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            torch.autograd.backward(loss)
            try:
                opt.step()
            except guard.GuardViolation:
                stopped = step
                break
    finally:
        g.detach()
    assert stopped == 1
