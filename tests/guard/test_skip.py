"""skip: the optimizer step is dropped, weights and optimizer state untouched, and counted."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import guard
from guard import AttachError
from guard.sinks import MemorySink
from guard.step.skip import takes_found_inf
from tests.conftest import batch, policy, tiny_gpt
from tests.guard.step.test_localise import clean_server_env

# vocab_size=128 = the rows of tiny_gpt: no padding columns, so only the checks under test fire.

Opt = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Opt] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
}


def snapshot(m: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    return copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())


def assert_same(a: Any, b: Any) -> None:
    """Nested dicts / lists of tensors and numbers, compared exactly."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def nan_gradients(m: nn.Module, seed: int) -> None:
    """One forward / backward whose lm_head input and loss are NaN, weights left clean."""
    keep = m.ln_f.weight[3].item()
    with torch.no_grad():
        m.ln_f.weight[3] = float("nan")
    m(*batch(seed=seed))[1].backward()
    with torch.no_grad():
        m.ln_f.weight[3] = keep


def healthy_step(m: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    m(*batch(seed=seed))[1].backward()
    opt.step()
    opt.zero_grad()


def test_skip_needs_the_optimizer() -> None:
    for check in ("nonfinite", "loss_spike"):
        with pytest.raises(AttachError, match=r"needs the optimizer: guard.attach\(model, "
                           r"optimizer=opt"):
            guard.attach(tiny_gpt(), policy=policy(**{check: {"action": "skip"}}),
                         vocab_size=128)


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_nonfinite_skip_leaves_weights_and_optimizer_state_unchanged(make_opt: Opt) -> None:
    m = tiny_gpt(tie=False)
    opt = make_opt(list(m.parameters()))
    with guard.attach(m, policy=policy(nonfinite={"action": "skip"}), vocab_size=128,
                      optimizer=opt) as g:
        for i in range(2):
            healthy_step(m, opt, i)  # moments / momentum buffers exist before the skip
        weights, state = snapshot(m, opt)
        nan_gradients(m, 2)
        opt.step()
        opt.zero_grad()
        assert_same(m.state_dict(), weights)
        assert_same(opt.state_dict(), state)
        # A fused optimizer dropped it on the device: the host learns at the next read.
        assert g.stats["skipped_steps"] == (0 if takes_found_inf(opt) else 1)
        healthy_step(m, opt, 3)  # the next clean step is applied again
        assert g.stats["violations"] == {"nonfinite": {"skip": 1}}
        assert not torch.equal(m.state_dict()["lm_head.weight"], weights["lm_head.weight"])
        assert all(torch.isfinite(p).all() for p in m.parameters())
        # The stats are those of the last read: step 3 where it lags one read behind.
        assert g.stats["skipped_steps"] == 1
        assert g.stats["step"] == (3 if takes_found_inf(opt) else 4)


def test_loss_spike_skip_drops_the_spiking_step(monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sink = MemorySink()
    with guard.attach(m, policy=policy(loss_spike={"action": "skip"}), vocab_size=128,
                      optimizer=opt) as g:
        g.add_sink(sink)
        for i in range(10):
            healthy_step(m, opt, i)
        weights, state = snapshot(m, opt)
        with torch.no_grad():
            m.ln_f.weight.mul_(300.0)
        m(*batch(seed=10))[1].backward()  # loss 4.8 -> 92
        with torch.no_grad():
            m.ln_f.weight.div_(300.0)
        opt.step()
        opt.zero_grad()
        assert_same(opt.state_dict(), state)
        for k, v in m.state_dict().items():  # x300 / 300 is exact up to rounding
            assert torch.allclose(v, weights[k], rtol=1e-6, atol=0)
        assert g.stats["skipped_steps"] == 1
    last = sink.reports[-1]
    assert last.skipped_steps == 1 and last.violations["loss_spike"] == {"skip": 1}
    assert [e.action for r in sink.reports for e in r.events] == ["skip"]
    clean_server_env(monkeypatch)
    assert scrape(sink, "guard_skipped_steps_total") == 1.0


def scrape(sink: MemorySink, metric: str) -> float | None:
    """The value of `metric` on the guard server's /metrics after it ingests the sink."""
    pytest.importorskip("guard_server")
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from guard_server import Settings, create_app

    with TestClient(create_app(Settings())) as client:
        assert client.post("/v1/reports", content=sink.batch().model_dump_json(),
                           headers={"content-type": "application/json"}).status_code == 202
        text = client.get("/metrics").text
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == metric), None)


def test_grad_scaler_step_and_update_with_the_guard_skipping() -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with guard.attach(m, policy=policy(loss_spike={"action": "skip"}), vocab_size=128,
                      optimizer=opt) as g:
        for i in range(10):
            scaler.scale(m(*batch(seed=i))[1]).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        weights, state = snapshot(m, opt)
        with torch.no_grad():
            m.ln_f.weight.mul_(300.0)
        scaler.scale(m(*batch(seed=10))[1]).backward()  # finite grads: the scaler steps ...
        with torch.no_grad():
            m.ln_f.weight.div_(300.0)
        scaler.step(opt)  # ... and the guard's pre-hook drops it
        scaler.update()
        opt.zero_grad()
        assert_same(opt.state_dict(), state)
        for k, v in m.state_dict().items():
            assert torch.allclose(v, weights[k], rtol=1e-6, atol=0)
        assert g.stats["skipped_steps"] == 1
        scaler.scale(m(*batch(seed=11))[1]).backward()
        scaler.step(opt)
        scaler.update()
        assert g.stats["skipped_steps"] == 1 and g.stats["step"] == 12


def test_closure_optimizers_cannot_be_skipped(caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard.attach(m, policy=policy(nonfinite={"action": "skip"}), vocab_size=128,
                      optimizer=opt) as g:
        nan_gradients(m, 0)
        opt.step(lambda: None)
        assert g.stats["skipped_steps"] == 0
        assert g.stats["violations"] == {"nonfinite": {"skip": 1}}
    assert "optimizer.step(closure) recomputes the gradients" in caplog.text


def test_fail_wins_over_skip_at_the_same_step() -> None:
    m = tiny_gpt(garbage=0.5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pol = policy(nonfinite={"action": "skip"}, padding_mass={"action": "fail"})
    g = guard.attach(m, policy=pol, vocab_size=100, optimizer=opt)
    nan_gradients(m, 0)
    with pytest.raises(guard.GuardViolation, match="padding_mass"):
        opt.step()
    assert g.stats["skipped_steps"] == 0
    g.detach()
