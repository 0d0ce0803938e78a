"""The step clock with a device side and a reader made by hand, a one-parameter optimizer and
a one-layer module: no model, no probe needed."""

from __future__ import annotations

import torch
from torch import nn

from guard.checks import loss
from guard.device.reading import Reading
from guard.policy_file import load_policy
from guard.step.clock import StepClock, Steps
from guard.step.reader import When
from tests.conftest import policy
from tests.guard.readings import reading


class Device:
    """The clock's device side: each read returns the loss given since the last one."""

    device = torch.device("cpu")

    def __init__(self, reads_at_attach: bool = False) -> None:
        self.reads_at_attach = reads_at_attach
        self.ended: list[int] = []
        self.loss: float | None = None

    def end_step(self, step: int) -> None:
        self.ended.append(step)

    def fold(self) -> None: ...

    def read(self, *, lagged: bool, reduce: bool = True,
             weights: bool = True) -> Reading | None:
        value, self.loss = self.loss, None
        return reading({} if value is None else {loss.VALUE: value, loss.SEEN: 1})

    def flush(self) -> Reading | None:
        return None

    def watch_skips(self) -> None: ...

    def skipped_update(self) -> None:
        self.ended.append(-1)  # a step the loop skipped (not under these tests)


class Reads:
    """The clock's reader: records each call, answers `skip`."""

    def __init__(self, skip: bool = False) -> None:
        self.calls: list[tuple[int, When, bool, bool, float | None]] = []
        self.skip = skip

    def read(self, reading: Reading, step: int, *, when: When, now: int = 0,
             in_step: bool = False, closure: bool = False, dropped: bool = False) -> bool:
        self.calls.append((step, when, in_step, closure, reading.local[loss.SPEC].value))
        return self.skip


def clock(reads: Reads, *, optimizer: torch.optim.Optimizer | None = None,
          steps: Steps = "auto", read_every: int = 1,
          device: Device | None = None) -> StepClock:
    pol = load_policy({**policy(), "cadence": {"read_every": read_every}})
    return StepClock.from_policy(pol, device or Device(), reads, optimizer=optimizer,
                                 steps=steps)


def sgd() -> tuple[torch.optim.SGD, nn.Parameter]:
    w = nn.Parameter(torch.ones(3))
    return torch.optim.SGD([w], lr=0.5), w


def holding(w: nn.Parameter) -> nn.Module:
    """A module whose parameter the optimizer steps: where DeepSpeed is loaded (by another
    test), an optimizer stepping tensors the model does not hold is read as a wrapper's copies,
    one update per forward (guard/step/zero.py)."""
    m = nn.Module()
    m.register_parameter("w", w)
    return m


def test_the_optimizer_step_is_the_boundary_and_reads_before_the_update() -> None:
    reads, device = Reads(), Device()
    opt, w = sgd()
    c = clock(reads, optimizer=opt, device=device)
    handles = c.install(holding(w), opt)
    for i in range(3):
        device.loss = float(i)
        w.grad = torch.ones(3)
        opt.step()
    assert c.boundary == "optimizer" and c.step == 3 and device.ended == [1, 2, 3]
    assert reads.calls == [(1, "step", True, False, 0.0), (2, "step", True, False, 1.0),
                           (3, "step", True, False, 2.0)]
    assert torch.equal(w.detach(), torch.full((3,), -0.5))  # three updates applied
    for h in handles:
        h.remove()


def test_skip_drops_the_update_and_the_optimizer_state_stays() -> None:
    opt, w = sgd()
    c = clock(Reads(skip=True), optimizer=opt)
    c.install(holding(w), opt)
    w.grad = torch.ones(3)
    opt.step()
    assert torch.equal(w.detach(), torch.ones(3)) and w.grad is None


def test_a_closure_is_passed_on() -> None:
    reads = Reads()
    opt, w = sgd()
    c = clock(reads, optimizer=opt)
    c.install(holding(w), opt)

    def closure() -> torch.Tensor:
        w.grad = torch.ones(3)
        return torch.tensor(1.0)

    opt.step(closure)
    assert reads.calls[0][:4] == (1, "step", True, True)


def test_cadence_reads_every_nth_boundary() -> None:
    reads = Reads()
    c = clock(reads, steps="manual", read_every=3)
    for _ in range(7):
        c.mark()
    assert c.step == 7 and [call[0] for call in reads.calls] == [3, 6]
    c.finish()
    assert reads.calls[-1][:2] == (7, "detach")  # the unread step, at detach


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
    c.finish()
    assert reads.calls[-1][:2] == (2, "detach")  # closed at detach
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
    c.finish()
    assert len(reads.calls) == 1  # nothing left unread


def test_manual_installs_no_hook() -> None:
    opt, _ = sgd()
    assert clock(Reads(), steps="manual").install(nn.Linear(2, 2), opt) == []


def test_the_read_at_attach_is_step_0_and_only_where_the_device_checks_weights() -> None:
    reads = Reads()
    clock(reads).start()
    assert reads.calls == []
    clock(reads, device=Device(reads_at_attach=True)).start()
    assert reads.calls == [(0, "attach", False, False, None)]
