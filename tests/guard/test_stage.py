"""A pipeline stage attached in one process (guard/vocab/stage.py): the first stage (the
embedding only) and the last (the head only) attach, each checks what it holds, and neither is
blind for what the other holds. A bare module is taken for a stage only under torch.distributed
(a one-rank gloo group here); in one process it is a model missing a part. The torchrun tests
of real pipelining are issue 38's next."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import guard

REAL, ROWS, D = 1000, 1024, 16
POLICY = {"export": {"serve": None}}


@pytest.fixture(autouse=True)
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A pipeline runs under torch.distributed: one gloo rank stands for it here."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(ROWS, D)
        self.block = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(self.tok(x)))


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, ROWS, bias=False)
        with torch.no_grad():
            self.lm_head.weight[REAL:] = self.lm_head.weight[:REAL].mean(dim=0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.tanh(self.block(h))))


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _step(first: First, last: Last, g: guard.Guard, x: torch.Tensor, y: torch.Tensor,
          opts: list[torch.optim.Optimizer]) -> None:
    h = first(x)
    loss = g.loss_fn(_loss)(last(h), y)
    loss.backward()
    for o in opts:
        o.step()
        o.zero_grad()


def test_first_and_last_stage_attach_and_are_quiet_when_healthy() -> None:
    torch.manual_seed(0)
    first, last = First(), Last()
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, last))
    with guard.attach(first, policy=POLICY, vocab_size=REAL, optimizer=o1) as g1, \
            guard.attach(last, policy=POLICY, vocab_size=REAL, optimizer=o2) as g2:
        assert g1.stage is not None and (g1.stage.embedding, g1.stage.head) == (True, False)
        assert g2.stage is not None and (g2.stage.embedding, g2.stage.head) == (False, True)
        for _ in range(3):
            x, y = torch.randint(0, REAL, (2, 8)), torch.randint(0, REAL, (2, 8))
            _step(first, last, g2, x, y, [o1, o2])
    assert g1.stats["violations"] == {} and g2.stats["violations"] == {}
    assert g2.stats["loss"] is not None


def test_a_ghost_label_through_loss_fn_stops_the_last_stage() -> None:
    torch.manual_seed(0)
    first, last = First(), Last()
    o2 = torch.optim.SGD(last.parameters(), lr=0.1)
    with guard.attach(last, policy=POLICY, vocab_size=REAL, optimizer=o2) as g2:
        x, y = torch.randint(0, REAL, (2, 8)), torch.randint(0, REAL, (2, 8))
        y[0, 0] = REAL + 3
        before = last.lm_head.weight.detach().clone()
        with pytest.raises(guard.GuardViolation) as e:
            _step(first, last, g2, x, y, [o2])
    assert e.value.check == "token_range"
    assert torch.equal(before, last.lm_head.weight)


def test_a_ghost_input_stops_the_first_stage() -> None:
    first = First()
    o1 = torch.optim.SGD(first.parameters(), lr=0.1)
    with guard.attach(first, policy=POLICY, vocab_size=REAL, optimizer=o1):
        x = torch.randint(0, REAL, (2, 8))
        x[1, 1] = REAL + 5
        first(x).sum().backward()
        with pytest.raises(guard.GuardViolation) as e:
            o1.step()
    assert e.value.check == "token_range"


def test_in_one_process_a_module_without_a_head_is_a_model_missing_it() -> None:
    dist.destroy_process_group()  # no pipeline without torch.distributed
    try:
        with pytest.raises(guard.AttachError, match=r"cannot find the output head.*pass "
                           r"lm_head=.*one stage of a pipeline, attach it on every rank under "
                           r"torch\.distributed"):
            guard.attach(First(), policy=POLICY, vocab_size=REAL)
    finally:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


class LastPastTheHead(Last):
    """A last stage whose logits come from the head's weight without calling the head, as
    DeepSpeed calls a `TiedLayerSpec` head through its `forward_fn`: the head's hooks never
    run."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(torch.tanh(self.block(h))), self.lm_head.weight)


def test_logits_of_a_head_called_past_its_hooks_are_masked_at_the_loss_fn() -> None:
    torch.manual_seed(0)
    first, last = First(), LastPastTheHead()
    with torch.no_grad():
        last.lm_head.weight[REAL:] = torch.randn(ROWS - REAL, D) * 100  # garbage, kept out
    x, y = torch.randint(0, REAL, (2, 8)), torch.randint(0, REAL, (2, 8))
    with torch.no_grad():
        real = _loss(last(first(x))[..., :REAL], y)
    o2 = torch.optim.SGD(last.parameters(), lr=0.0)
    pol = {**POLICY, "checks": {"padding_rows": {"action": "off"}}}
    with guard.attach(last, policy=pol, vocab_size=REAL, optimizer=o2) as g2:
        loss = g2.loss_fn(_loss)(last(first(x).detach()), y)
        loss.backward()
        o2.step()
    assert float(loss.detach()) == pytest.approx(float(real), rel=1e-5)  # the real columns' loss
    assert g2.stats["violations"] == {}  # the logits seen: not blind
    assert last.lm_head.weight.grad is not None
    assert float(last.lm_head.weight.grad[REAL:].abs().sum()) == 0.0


def test_garbage_logits_of_a_head_called_past_its_hooks_stop_at_the_loss_fn() -> None:
    torch.manual_seed(0)
    first, last = First(), LastPastTheHead()
    with torch.no_grad():
        last.lm_head.weight[REAL:] = torch.randn(ROWS - REAL, D) * 100
    o2 = torch.optim.SGD(last.parameters(), lr=0.1)
    pol = {**POLICY, "checks": {"padding_rows": {"action": "off"},
                                "padding_mass": {"action": "fail"}}}
    with guard.attach(last, policy=pol, vocab_size=REAL, optimizer=o2) as g2:
        x, y = torch.randint(0, REAL, (2, 8)), torch.randint(0, REAL, (2, 8))
        before = last.lm_head.weight.detach().clone()
        with pytest.raises(guard.GuardViolation) as e:
            _step(first, last, g2, x, y, [o2])
    assert (e.value.check, e.value.step) == ("padding_mass", 1)
    assert torch.equal(before, last.lm_head.weight)
