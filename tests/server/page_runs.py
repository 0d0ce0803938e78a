"""Real runs for the pages: guards on nanoGPT's own model.py that push their reports to a server
through its ingest route (`export.push`), as a trainer does; shared by the browser test and
bench/page.py (which takes the README's screenshot)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import guard
from tests.conftest import batch
from tests.integrations.nanogpt import REAL, nanogpt

__all__ = ["RUN_ID", "train_and_push"]

RUN_ID = "nanogpt-tiny"


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train_and_push(url: str, token: str | None, *, steps: int = 20, ranks: int = 3,
                   halt_at: int = 12) -> None:
    """`ranks` guarded trainings (RANK 0, 1, ...) of `steps` steps each under the default
    policy (the mask, padding rows repaired), pushing every read to `url`; the last rank
    meets a ghost label at step `halt_at` and stops there (token_range, action fail)."""
    for rank in range(ranks):
        model = nanogpt(garbage=3.0, seed=rank)  # padding rows with garbage: a mass to draw
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        policy = {"run_id": RUN_ID, "export": {"serve": None, "push": url}}
        env = {"RANK": str(rank), **({"GUARD_TOKEN": token} if token else {})}
        with _environment(**env), guard.attach(model, policy=policy, vocab_size=REAL,
                                               optimizer=opt):
            for step in range(1, steps + 1):
                x, y = batch(REAL, seed=step % 8)  # eight batches, seen again: loss falls
                if rank == ranks - 1 and step == halt_at:
                    y[0, 5] = 117  # an id in [real, rows): a ghost label
                _, loss = model(x, y)
                loss.backward()
                try:
                    opt.step()
                except guard.GuardViolation:
                    break
                opt.zero_grad()
