"""A tiny training process for tests/dashboards/test_live_silent.py: one rank per spec, each a
tiny GPT under its own guard, trained in turn until a stop file appears; then each detaches (its
last report says finished), STOP_FILE.detached appears and the process exits 0. Killed before
that, it leaves as a crashed or OOM-killed trainer does, without a word.

    python -m tests.dashboards.silent_trainer STOP_FILE RUN_ID:push:URL RUN_ID:serve:HOST:PORT
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

import guard
from tests.conftest import batch, policy, tiny_gpt


def main(stop: Path, specs: list[str]) -> int:
    logging.basicConfig(level=logging.INFO)  # the guard's lines, for a failing test's message
    ranks = []
    for spec in specs:
        run_id, how, where = spec.split(":", 2)
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pol = policy() | {"run_id": run_id}
        pol["export"] = {"serve": where if how == "serve" else None,
                         "push": where if how == "push" else None}
        ranks.append((model, opt, guard.attach(model, policy=pol, vocab_size=100, optimizer=opt)))
    step = 0
    while not stop.exists():
        for model, opt, _ in ranks:
            _, loss = model(*batch(seed=step))
            loss.backward()
            opt.step()
            opt.zero_grad()
        step += 1
        time.sleep(0.1)
    for _, _, g in ranks:
        g.detach()  # the final report; a scraped endpoint waits for one more scrape
    # Said before the interpreter's exit, which takes long on a loaded machine (torch's
    # teardown): the endpoints stopped at detach.
    stop.with_name(stop.name + ".detached").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
