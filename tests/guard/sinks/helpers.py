"""What the sink tests share: a short guarded run, and a wait with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import guard
from guard.step.record import Record
from guard_server.wire import ReportBatch
from tests.conftest import batch, policy
from tests.guard.readings import values


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def serving(mass: str = "warn", **export: object) -> dict[str, object]:
    p = policy(padding_mass={"action": mass})
    p["export"] = {"serve": None, **export}
    p["run_id"] = "sink-test"
    return p


def train_steps(g: guard.Guard, model: torch.nn.Module, n: int) -> None:
    for i in range(n):
        _, loss = model(*batch(seed=i))
        loss.backward()
        g.step(loss)


def one_report(step: int = 1, *, final: bool = False, run_id: str = "r",
               rank: int = 0) -> ReportBatch:
    """A one-report batch as a guard sends it, from the library's own record."""
    record = Record(run_id, rank, {"real": 100, "rows": 128, "aligned": 128}, {})
    record.update(values(), step)
    return ReportBatch(run_id=run_id, rank=rank, reports=[record.report(final=final)])
