"""Lightning Fabric (issue 33): `model, opt = fabric.setup(model, opt)`, `fabric.backward(loss)`,
nanoGPT's own model called as its train.py calls it, `model(x, y)`. The guard attached before
`setup` (to the model and the torch optimizer) and after it (to the `_FabricModule` and the
`_FabricOptimizer` that `setup` returned) is the same guard: it hooks the model inside, reads
the labels' position from the model's own forward, and stops before the update."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.fabric")
from lightning.fabric import Fabric

import guard
from guard import AttachError, GuardViolation
from guard.sinks import MemorySink
from tests.conftest import batch, policy
from tests.integrations.nanogpt import REAL, nanogpt


@dataclass
class Run:
    model: torch.nn.Module  # the module given to fabric.setup
    wrapped: Any  # what setup returned, and what the loop calls
    optimizer: Any
    fabric: Fabric
    g: guard.Guard

    def step(self, x: torch.Tensor, y: torch.Tensor, *, keyword: bool) -> torch.Tensor:
        _, loss = self.wrapped(x, targets=y) if keyword else self.wrapped(x, y)
        self.fabric.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss


def run(when: str, pol: dict[str, Any], garbage: float | None = 3.0) -> Run:
    """nanoGPT and AdamW set up by a CPU Fabric, the guard attached `when` ("before" or
    "after") setup."""
    model = nanogpt(garbage=garbage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fabric = Fabric(accelerator="cpu", devices=1)
    if when == "before":
        g = guard.attach(model, policy=pol, vocab_size=REAL, optimizer=opt)
        wrapped, fopt = fabric.setup(model, opt)
    else:
        wrapped, fopt = fabric.setup(model, opt)
        g = guard.attach(wrapped, policy=pol, vocab_size=REAL, optimizer=fopt)
    return Run(model, wrapped, fopt, fabric, g)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(v, before[k], rtol=0, atol=0, equal_nan=True)
               for k, v in model.state_dict().items())


WHEN = pytest.mark.parametrize("when", ["before", "after"])
CALL = pytest.mark.parametrize("keyword", [False, True], ids=["model(x, y)", "targets=y"])


@WHEN
@CALL
def test_mask_guards_fabric_quietly_and_it_is_one_guard(
        when: str, keyword: bool, caplog: pytest.LogCaptureFixture) -> None:
    r = run(when, policy())
    with caplog.at_level(logging.WARNING, logger="guard"), r.g:
        assert r.g.model is r.model  # inside the _FabricModule, whichever was given
        for seed in range(3):
            loss = r.step(*batch(REAL, seed=seed), keyword=keyword)
            assert torch.isfinite(loss)
        s = r.g.stats
        with pytest.raises(AttachError, match="already attached"):
            guard.attach(r.model if when == "after" else r.wrapped, policy=policy())
    assert s["step"] == 3 and s["violations"] == {}  # no coverage warning: labels were seen
    assert s["padding_mass"] > 0.05  # the garbage rows' mass, measured before the mask
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@WHEN
@CALL
def test_a_ghost_label_stops_as_token_range_before_the_update(when: str, keyword: bool) -> None:
    r = run(when, policy())
    sink = MemorySink()
    r.g.add_sink(sink)
    with r.g:
        r.step(*batch(REAL, seed=0), keyword=keyword)
        x, y = batch(REAL, seed=1)
        y[0, 3] = 120  # in [real, rows): an id the tokenizer cannot produce
        before = weights(r.model)
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 2: 1 label id "
                           r"outside \[0, 100\).*ghost ids.*labels 120 at \[0, 3\]") as e:
            r.step(x, y, keyword=keyword)
        assert unchanged(r.model, before)
    # The +inf loss it causes under the mask is named as the labels' doing, not the weights',
    # and no module is blamed for it.
    assert e.value.check == "token_range" and "also at this step: nonfinite" in str(e.value)
    (nf,) = [ev for rep in sink.reports for ev in rep.events if ev.check == "nonfinite"]
    assert "The loss is +inf because 1 label is a ghost id in [100, 128)" in nf.message
    assert "learning rate" not in nf.message and "Localisation" not in nf.message


@WHEN
@CALL
def test_a_nan_stops_as_nonfinite_before_the_update(when: str, keyword: bool) -> None:
    r = run(when, policy(nonfinite={"localise": False}))
    with r.g:
        r.step(*batch(REAL, seed=0), keyword=keyword)
        with torch.no_grad():
            r.model.transformer.h[1].mlp.c_proj.weight[0, 0] = float("nan")
        before = weights(r.model)
        with pytest.raises(GuardViolation, match=r"nonfinite on rank 0 at step 2: NaN/Inf "
                           r"values: \d+ positions in the lm_head input") as e:
            r.step(*batch(REAL, seed=1), keyword=keyword)
        assert unchanged(r.model, before)
    assert e.value.check == "nonfinite" and "ghost" not in str(e.value)


def test_labels_the_guard_cannot_see_are_said_with_what_it_looked_for(
        caplog: pytest.LogCaptureFixture) -> None:
    """A model whose forward takes its labels positionally but does not name them: coverage
    says what it looked for, where, and the ways to give them."""

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(128, 16)
            self.lm_head = torch.nn.Linear(16, 128, bias=False)

        def forward(self, idx: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            logits = self.lm_head(self.wte(idx))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), rest[0].flatten())

    m = Hidden()
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=policy(), vocab_size=REAL) as g:
        m.train()
        x, y = batch(REAL)
        m(x, y).backward()
        g.step()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert ("token_range saw no labels: the guard looked for labels= or targets= as a keyword "
            "(this forward has no positional labels / targets parameter) in the calls of "
            "Hidden.forward(idx, *rest), the module it hooks, and none came. Give them:") in text
