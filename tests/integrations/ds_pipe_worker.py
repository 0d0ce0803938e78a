"""One rank of the DeepSpeed pipeline test (tests/integrations/test_ds_pipeline.py); not a test.

usage: python -m torch.distributed.run --nproc-per-node 2 ... ds_pipe_worker.py OUT_DIR

DeepSpeed's pipeline engine on the CPU (DS_ACCELERATOR=cpu, gloo): a `PipelineModule` of 2
stages, the token embedding a `TiedLayerSpec` on the first stage and, under the same key, the
head on the last (the embedding's weight through `forward_fn`, as DeepSpeed's GPT examples
tie them), trained by `engine.train_batch` (2 micro-batches). Every rank attaches to its
`PipelineModule`; OUT_DIR/rank<N>.json holds each case's result.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

import guard
from tests.integrations.dist_worker import finish, recorded, violation
from tests.integrations.pp_models import REAL, ROWS, B, D, batch
from tests.integrations.tp_worker import DEFAULT, logged, with_checks

STEPS, MICRO = 3, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


def head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """The tied head: the embedding's weight as the output projection."""
    return F.linear(h, embedding.weight)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(*, garbage: bool = False) -> PipelineModule:
    """The same weights on every rank (the seed); the padding rows the real rows' mean, or
    garbage (norm 1e4: an uninitialised resize)."""
    torch.manual_seed(0)
    layers = [TiedLayerSpec("embed", nn.Embedding, ROWS, D), LayerSpec(Block),
              LayerSpec(Block), LayerSpec(nn.LayerNorm, D),
              TiedLayerSpec("embed", nn.Embedding, ROWS, D, forward_fn=head)]
    pipe = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn,
                          partition_method="uniform")
    # Written after DeepSpeed's start-up sync of the tied copies, so alike on both stages:
    # from one seed (each stage built a different part of the model from the first).
    torch.manual_seed(1)
    with torch.no_grad():
        w = pipe.tied_modules["embed"].weight
        w.normal_(0.0, 0.5)
        w[REAL:] = w[:REAL].mean(dim=0)
        if garbage:
            rows = torch.randn(ROWS - REAL, D)
            w[REAL:] = rows / rows.norm(dim=-1, keepdim=True) * 1e4
    return pipe


class Run:
    """This rank's stage, its engine and its guard."""

    def __init__(self, policy: dict[str, Any], *, garbage: bool = False) -> None:
        self.pipe = build(garbage=garbage)
        self.opt = torch.optim.SGD(self.pipe.parameters(), lr=0.1)
        config = {"train_batch_size": B, "train_micro_batch_size_per_gpu": B // MICRO,
                  "gradient_accumulation_steps": MICRO, "steps_per_print": 10**9}
        self.engine, *_ = deepspeed.initialize(model=self.pipe, optimizer=self.opt,
                                               config=config)
        self.guard = guard.attach(self.pipe, policy=policy, vocab_size=REAL,
                                  optimizer=self.opt)
        if self.guard.stage is not None and self.guard.stage.head:
            self.pipe.loss_fn = self.guard.loss_fn(loss_fn)

    def step(self, n: int) -> float:
        x, y = batch(n)
        micro: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(
            [(x[i::MICRO].contiguous(), y[i::MICRO].contiguous()) for i in range(MICRO)])
        return float(self.engine.train_batch(data_iter=micro))

    @property
    def tied(self) -> torch.Tensor:
        w: torch.Tensor = self.pipe.tied_modules["embed"].weight
        return w


def healthy() -> dict[str, Any]:
    with logged() as lines:
        run = Run(DEFAULT)
        with run.guard as g:
            losses = [run.step(n) for n in range(1, STEPS + 1)]
    stage = run.guard.stage
    return {"violations": g.stats["violations"], "logged": lines, "losses": losses,
            "stage": None if stage is None else stage.name, "tied": bool(stage and stage.tied)}


def stopped(run: Run, first: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Steps until the guard stops one: the step, the violation, and whether this rank's
    weights were left bitwise as they were before that step. `first(n)` runs before step n."""
    out: dict[str, Any] = {"raised_at": None}
    with run.guard:
        for n in range(1, STEPS + 1):
            first(n)
            before = [p.detach().clone() for p in run.pipe.parameters()]
            try:
                run.step(n)
            except guard.GuardViolation as e:
                out.update(raised_at=n, violation=violation(e), unchanged=all(
                    torch.equal(a, p.detach())
                    for a, p in zip(before, run.pipe.parameters(), strict=True)))
                break
    return out


def garbage() -> dict[str, Any]:
    """Garbage padding rows in the tied weight, left alone, no mask: the head's logits, which
    DeepSpeed computes in its forward_fn, stop both stages at step 1."""
    pol = with_checks(padding_rows={"action": "off"}, padding_mass={"action": "fail"})
    return stopped(Run(pol, garbage=True))


def drift() -> dict[str, Any]:
    """Rows 5 and 700 of the last stage's copy written between steps 1 and 2: every stage
    stops at step 2's read, before its update."""
    run = Run(with_checks(vocab={"tie_every": 1}))

    def write(n: int) -> None:
        if n == 2 and dist.get_rank() == 1:
            with torch.no_grad():
                run.tied[[5, 700], 3] += 1e-3

    return stopped(run, write)


def main(out: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    result = {name: recorded(lambda _, case=case: case(), None)
              for name, case in {"healthy": healthy, "garbage": garbage,
                                          "drift": drift}.items()}
    finish(out, dist.get_rank(), result)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
