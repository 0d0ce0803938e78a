"""A resumed run (issue 39, item 4): g.state_dict() saved with a checkpoint and
g.load_state_dict() on a new model and guard go on as if the run had never stopped: the loss
window (a spike right after the resume is reported), the step, the running totals."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import guard
from guard import StateError
from guard.sinks import MemorySink
from guard.step.resume import VERSION
from tests.conftest import batch, policy, tiny_gpt

GHOST = 120  # a padding id: the real vocab is 100
# warmup 5: two steps after a resume at step 6 a fresh window holds 1 loss, too few to judge.
SPIKY = policy(loss_spike={"action": "warn", "warmup": 5}, token_range={"action": "warn"})


def run(m: torch.nn.Module, g: guard.Guard, opt: torch.optim.Optimizer, steps: range, *,
        spike_at: int | None = None) -> None:
    """Optimizer steps `steps` (their numbers: the batch seeds); a ghost input id at step 3, the
    loss x30 at `spike_at`."""
    for i in steps:
        x, y = batch(seed=i)
        if i == 3:
            x[0, 0] = GHOST
        _, loss = m(x, y)
        if i == spike_at:
            loss = loss * 30
            g.step(loss)  # right after the forward: replaces the model's loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def attached(p: dict[str, Any] = SPIKY) -> tuple[torch.nn.Module, guard.Guard,
                                                 torch.optim.Optimizer, MemorySink]:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = guard.attach(m, policy=p, vocab_size=100, optimizer=opt)
    sink = MemorySink()
    g.add_sink(sink)
    return m, g, opt, sink


def saved_after_six_steps() -> tuple[bytes, dict[str, Any]]:
    """The guard's state after 6 steps, through torch.save (what a checkpoint holds), and the
    stats then."""
    m, g, opt, _ = attached()
    run(m, g, opt, range(1, 7))
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "guard": g.state_dict()}, buf)
    stats = g.stats
    g.detach()
    return buf.getvalue(), stats


def resumed(saved: bytes) -> tuple[torch.nn.Module, guard.Guard, torch.optim.Optimizer,
                                   MemorySink]:
    ckpt = torch.load(io.BytesIO(saved), weights_only=True)  # plain data: no pickle needed
    m, g, opt, sink = attached()
    m.load_state_dict(ckpt["model"])
    g.load_state_dict(ckpt["guard"])
    return m, g, opt, sink


def test_a_spike_two_steps_after_the_resume_is_reported() -> None:
    saved, before = saved_after_six_steps()
    assert before["step"] == 6 and before["violations"] == {"token_range": {"warn": 1}}
    m, g, opt, sink = resumed(saved)
    assert g.stats["step"] == 6
    run(m, g, opt, range(7, 9), spike_at=8)
    s = g.stats
    # Within what would be warm-up for a fresh window (1 loss < 5): reported all the same.
    assert s["violations"]["loss_spike"] == {"warn": 1}
    # The step goes on (7, 8) and so do the totals: the ghost input of step 3 still counts.
    assert [r.step for r in sink.reports] == [7, 8]
    assert s["out_of_range"]["input"] == before["out_of_range"]["input"] == 1
    assert s["violations"]["token_range"] == {"warn": 1}
    # On the wire: a new attach (the server replaces the rank's state at once) whose counters
    # go on from the checkpoint's, so Prometheus reads no counter reset.
    first = sink.reports[0]
    assert first.out_of_range.model_dump() == {"input": 1, "label": 0}
    assert first.violations["token_range"] == {"warn": 1}
    g.detach()


def test_without_the_state_the_same_spike_is_missed() -> None:
    """The premise: a fresh guard at the resume starts an empty window and counts from 0."""
    saved, _ = saved_after_six_steps()
    ckpt = torch.load(io.BytesIO(saved), weights_only=True)
    m, g, opt, sink = attached()
    m.load_state_dict(ckpt["model"])
    run(m, g, opt, range(7, 9), spike_at=8)
    assert "loss_spike" not in g.stats["violations"]
    assert [r.step for r in sink.reports] == [1, 2]
    g.detach()


def test_the_state_is_versioned_plain_data() -> None:
    m, g, opt, _ = attached()
    run(m, g, opt, range(1, 3))
    s, last = g.state_dict(), g.stats["loss"]
    g.detach()
    assert s["version"] == VERSION and s["step"] == 2 and s["rank"] == 0
    assert s["vocab"] == {"real": 100, "rows": 128}
    assert "loss_spike" in s["checks"] and "token_range" in s["checks"]
    w = s["loss_window"]
    assert w["size"] == 100 and w["seen"] == 2 and sum(w["accepted"]) == 2
    assert w["history"][1] == pytest.approx(last) and w["accepted"][:2] == [True, True]
    assert all(isinstance(x, float) for x in w["history"])
    assert s["totals"]["violations"] == {} and s["totals"]["skipped_steps"] == 0


def test_a_field_missing_keeps_the_fresh_value() -> None:
    """A state from an older guard lacks the fields added since: they stay as attach made them."""
    m, g, opt, _ = attached()
    g.load_state_dict({"version": 1, "step": 40})
    run(m, g, opt, range(1, 2))
    assert g.stats["step"] == 41 and g.stats["violations"] == {}
    g.detach()


@pytest.mark.parametrize(("change", "field"), [
    ({"vocab": {"real": 90, "rows": 128}}, "vocab.real"),
    ({"vocab": {"real": 100, "rows": 192}}, "vocab.rows"),
    ({"checks": ["token_range"]}, "checks"),
    ({"version": VERSION + 1}, "version"),
    ({"step": -1}, "step"),
    ({"totals": {"out_of_range": {"label": "3"}}}, "totals.out_of_range.label"),
    ({"totals": {"violations": {"no_such_check": {"warn": 1}}}},
     "totals.violations.no_such_check"),
])
def test_a_state_that_does_not_fit_is_one_line_naming_the_field(change: dict[str, Any],
                                                                 field: str) -> None:
    m, g, opt, _ = attached()
    run(m, g, opt, range(1, 2))
    state = {**g.state_dict(), **change}
    g.detach()
    _, fresh, _, _ = attached()
    with pytest.raises(StateError) as e:
        fresh.load_state_dict(state)
    assert e.value.field == field and "\n" not in str(e.value)
    assert str(e.value).startswith(f"guard state: {field}: ")
    assert fresh.stats["step"] == 0  # nothing changed
    fresh.detach()


def test_another_window_length_is_refused() -> None:
    m, g, opt, _ = attached()
    run(m, g, opt, range(1, 2))
    state = g.state_dict()
    g.detach()
    _, other, _, _ = attached(policy(loss_spike={"action": "warn", "window": 50},
                                     token_range={"action": "warn"}))
    with pytest.raises(StateError, match=r"^guard state: loss_window\.size: saved with a "
                                         r"window of 100 losses, this guard's is 50$"):
        other.load_state_dict(state)
    other.detach()


def test_a_state_is_loaded_before_the_first_step() -> None:
    m, g, opt, _ = attached()
    run(m, g, opt, range(1, 2))
    with pytest.raises(StateError, match=r"^guard state: step: this guard is at step 1"):
        g.load_state_dict(g.state_dict())
    g.detach()


def test_another_ranks_state_gives_the_step_and_window_not_the_totals() -> None:
    """The frameworks save rank 0's state: rank 1 resumes its step and loss window only."""
    saved, _ = saved_after_six_steps()
    state = torch.load(io.BytesIO(saved), weights_only=True)["guard"]
    m, g, opt, _ = attached()
    g.load_state_dict({**state, "rank": 1})
    run(m, g, opt, range(7, 9), spike_at=8)
    assert g.stats["step"] == 8 and g.stats["violations"] == {"loss_spike": {"warn": 1}}
    assert g.stats["out_of_range"]["input"] == 0
    g.detach()


def test_under_a_lagged_read_the_state_holds_every_step_taken() -> None:
    """A fused AdamW reads the flags one read late (guard/step/skip.py): the state taken after
    step 6 holds step 6's figures too, and the resumed run counts on from there."""
    pol = policy(token_range={"action": "warn"})

    def ghost_steps(m: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            x, y = batch()
            x[0, 0] = 110  # a ghost input id a step
            _, loss = m(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    with guard.attach(m, policy=pol, vocab_size=100, optimizer=opt) as g:
        ghost_steps(m, opt, 6)
        state = g.state_dict()
    assert state["totals"]["out_of_range"]["input"] == 6
    assert state["totals"]["violations"] == {"token_range": {"warn": 6}}
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    with guard.attach(m, policy=pol, vocab_size=100, optimizer=opt) as g:
        g.load_state_dict(state)
        ghost_steps(m, opt, 2)
    assert g.stats["step"] == 8 and g.stats["out_of_range"]["input"] == 8
