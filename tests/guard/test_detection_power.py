"""Detection power of `padding_mass: fail` (issue 39): garbage padding rows stop training at
step 1 at every batch shape, tied and untied. In a tied model each position's own input token
gives it a large real logit, so garbage rows win most positions but not all; the strided sample
alone missed them at small shapes. A table, so a later cost cut cannot trade this away."""

from __future__ import annotations

import pytest
import torch

import guard
from tests.conftest import batch, policy, tiny_gpt

# kind -> (std of the real rows, std of the garbage rows). The head's init std is 0.02; an
# nn.Embedding's default (torchtune's llama3_2, a trained model's scale) is 1, where each
# position's own token gives it a large real logit in a tied model.
KINDS = {"large": (0.02, 1.0), "uninitialised": (0.02, 2.0), "randn5": (0.02, 5.0),
         "randn3_on_unit": (1.0, 3.0), "randn5_on_unit": (1.0, 5.0)}
SHAPES = [(1, 16), (2, 16), (4, 32)]
SEEDS = range(10)


def stopped_at(stds: tuple[float, float], b: int, t: int, seed: int, *, tie: bool) -> int | None:
    m = tiny_gpt(garbage=stds[1], seed=seed, tie=tie)
    with torch.no_grad():
        m.lm_head.weight[:100].normal_(0.0, stds[0])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = guard.attach(m, policy=policy(padding_mass={"action": "fail"}), vocab_size=100,
                     optimizer=opt)
    try:
        for step in (1, 2, 3):
            x, y = batch(seed=seed * 10 + step, b=b, t=t)
            opt.zero_grad()
            _, loss = m(x, y)
            loss.backward()
            try:
                opt.step()
            except guard.GuardViolation:
                return step
        return None
    finally:
        g.detach()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_garbage_rows_stop_training_at_step_1_at_every_shape(kind: str, tie: bool) -> None:
    table = {(b, t, s): stopped_at(KINDS[kind], b, t, s, tie=tie)
             for b, t in SHAPES for s in SEEDS}
    missed = {cell: at for cell, at in table.items() if at != 1}
    assert not missed, f"{kind} ({'tied' if tie else 'untied'}): (b, t, seed) -> stop {missed}"
