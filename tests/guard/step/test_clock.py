"""The step clock with a one-parameter optimizer and a one-layer module: no model needed."""

from __future__ import annotations

import torch
from torch import nn

from guard.device.flags import Flags
from guard.device.loss import StepLoss
from guard.device.probe import Probe, ProbeConfig
from guard.policy_file import coerce_policy
from guard.step.clock import StepClock, Steps
from guard.step.reading import Reading
from guard.vocab.sizes import audit_sizes
from tests.conftest import policy


class Reads:
    """The clock's on_read: records each call, answers `skip`."""

    def __init__(self, skip: bool = False) -> None:
        self.calls: list[tuple[int, bool, bool, float | None]] = []
        self.skip = skip

    def __call__(self, reading: Reading, step: int, *, in_step: bool, closure: bool) -> bool:
        self.calls.append((step, in_step, closure, reading.local.loss))
        return self.skip


def clock(reads: Reads, *, optimizer: torch.optim.Optimizer | None = None,
          steps: Steps = "auto", read_every: int = 1) -> StepClock:
    pol = coerce_policy({**policy(), "cadence": {"read_every": read_every}})
    flags = Flags.from_policy(pol, torch.device("cpu"), rank=0)
    audit = audit_sizes(real=8, rows=8, embedding_rows=8, tied=True)
    probe = Probe(ProbeConfig.from_policy(pol, audit), flags, StepLoss.from_policy(pol, flags))
    return StepClock.from_policy(pol, probe, reads, optimizer=optimizer, steps=steps)


def sgd() -> tuple[torch.optim.SGD, nn.Parameter]:
    w = nn.Parameter(torch.ones(3))
    return torch.optim.SGD([w], lr=0.5), w


def test_the_optimizer_step_is_the_boundary_and_reads_before_the_update() -> None:
    reads = Reads()
    opt, w = sgd()
    c = clock(reads, optimizer=opt)
    handles = c.install(nn.Linear(2, 2), opt)
    for i in range(3):
        c.loss.record(torch.tensor(float(i)))
        w.grad = torch.ones(3)
        opt.step()
    assert c.boundary == "optimizer" and c.step == 3
    assert reads.calls == [(1, True, False, 0.0), (2, True, False, 1.0), (3, True, False, 2.0)]
    assert torch.equal(w.detach(), torch.full((3,), -0.5))  # three updates applied
    for h in handles:
        h.remove()


def test_skip_drops_the_update_and_the_optimizer_state_stays() -> None:
    opt, w = sgd()
    c = clock(Reads(skip=True), optimizer=opt)
    c.install(nn.Linear(2, 2), opt)
    w.grad = torch.ones(3)
    opt.step()
    assert torch.equal(w.detach(), torch.ones(3)) and w.grad is None


def test_a_closure_is_passed_on() -> None:
    reads = Reads()
    opt, w = sgd()
    c = clock(reads, optimizer=opt)
    c.install(nn.Linear(2, 2), opt)

    def closure() -> torch.Tensor:
        w.grad = torch.ones(3)
        return torch.tensor(1.0)

    opt.step(closure)
    assert reads.calls[0][:3] == (1, True, True)


def test_cadence_reads_every_nth_boundary() -> None:
    reads = Reads()
    c = clock(reads, steps="manual", read_every=3)
    for _ in range(7):
        c.mark()
    assert c.step == 7 and [call[0] for call in reads.calls] == [3, 6]
    assert [step for _, step in c.finish()] == [7]  # the unread step, at detach


def test_forward_boundary_runs_when_the_next_training_forward_starts() -> None:
    reads = Reads()
    c = clock(reads)
    layer = nn.Linear(2, 2)
    handles = c.install(layer, None)
    x = torch.ones(1, 2)
    layer(x)
    assert c.step == 0  # the first forward's boundary is still open
    layer(x)
    assert c.step == 1 and [call[0] for call in reads.calls] == [1]
    with torch.no_grad():
        layer(x)  # not a step: no graph is built
        layer(x)
    layer.eval()
    layer(x)  # nor is an eval forward
    assert c.step == 1  # the second training forward's boundary is still open
    assert [step for _, step in c.finish()] == [2]  # closed at detach
    for h in handles:
        h.remove()


def test_g_step_without_an_optimizer_turns_the_clock_manual() -> None:
    reads = Reads()
    c = clock(reads)
    layer = nn.Linear(2, 2)
    c.install(layer, None)
    layer(torch.ones(1, 2))
    c.mark()  # g.step(): a boundary now, and only g.step() from here on
    layer(torch.ones(1, 2))
    layer(torch.ones(1, 2))
    assert c.boundary == "manual" and c.step == 1
    assert list(c.finish()) == []  # nothing left unread


def test_manual_installs_no_hook() -> None:
    opt, _ = sgd()
    assert clock(Reads(), steps="manual").install(nn.Linear(2, 2), opt) == []
