"""Non-finite localisation: the first module whose output went NaN, in the message, the
violation, the report event and the server's run state."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import guard
from guard import GuardViolation
from guard.sinks import MemorySink
from guard.step.localise import Localiser, any_nonfinite, capture
from guard_server.wire import Event
from tests.conftest import batch, hook_count, no_host_reads, policy, tiny_gpt

NAN = float("nan")
# vocab_size=128 = tiny_gpt's rows: no padding columns, only nonfinite fires.
REAL = 128


def poison(m: nn.Module) -> None:
    """A NaN in one weight of the second block's MLP: everything after it goes NaN."""
    with torch.no_grad():
        m.blocks[1].mlp[0].weight[5, 3] = NAN


def events(sink: MemorySink) -> list[Event]:
    return [e for r in sink.reports for e in r.events]


def clean_server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's Settings read GUARD_SERVER_* and GUARD_TOKEN: a developer's must not count."""
    for name in list(os.environ):
        if name.upper().startswith("GUARD_SERVER_") or name.upper() == "GUARD_TOKEN":
            monkeypatch.delenv(name)


def test_any_nonfinite_counts_nan_and_plus_inf_not_masks() -> None:
    x = torch.zeros(3)
    assert not bool(any_nonfinite(x))
    assert any_nonfinite(torch.arange(3)) is None  # integers cannot be NaN
    assert any_nonfinite(("a", 1)) is None
    assert not bool(any_nonfinite(torch.tensor([0.0, -torch.inf])))  # masks are written -inf
    assert bool(any_nonfinite({"a": (x, [torch.tensor([torch.inf])])}))
    assert bool(any_nonfinite([x, torch.tensor([NAN])]))


def test_middle_layer_is_named_at_the_failing_step() -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = guard.attach(m, policy=policy(), vocab_size=REAL, optimizer=opt)
    base = hook_count(m)
    m(*batch())[1].backward()
    opt.step()
    poison(m)
    m(*batch(seed=1))[1].backward()
    with pytest.raises(GuardViolation) as e:
        opt.step()
    assert e.value.check == "nonfinite" and e.value.module == "blocks.1.mlp.0"
    assert ("the first non-finite output is from module 'blocks.1.mlp.0' (Linear), whose "
            "inputs were finite") in str(e.value)
    assert all(m.training for m in m.modules())  # the eval re-run restored the modes
    assert hook_count(m) == base  # no localiser hook left behind
    g.detach()


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.poisoned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.poisoned:
            h = torch.sqrt(h - 10.0)  # functional code between two submodules: NaN here
        return self.b(h)


class _LM(nn.Module):
    def __init__(self, v: int = 64, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.block = _Block(d)
        self.head = nn.Linear(d, v, bias=False)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.block(self.emb(idx)))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_nan_from_functional_code_names_the_module_whose_code_made_it() -> None:
    m = _LM()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = guard.attach(m, policy=policy(), vocab_size=64, optimizer=opt)
    m.block.poisoned = True
    m(*batch(real=64))[1].backward()
    with pytest.raises(GuardViolation) as e:
        opt.step()
    assert e.value.module == "block.b"
    assert ("from module 'block.b' (Linear), whose input was already non-finite: it arose in "
            "the code of 'block' before this call") in str(e.value)
    g.detach()


def test_warn_event_carries_the_module_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("guard_server")
    from fastapi.testclient import TestClient

    from guard_server import Settings, create_app

    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sink = MemorySink()
    pol = {**policy(nonfinite={"action": "warn"}), "run_id": "localise-1"}
    with guard.attach(m, policy=pol, vocab_size=REAL, optimizer=opt) as g:
        g.add_sink(sink)
        poison(m)
        for i in range(3):  # NaN every step: localised once, at the first read
            m(*batch(seed=i))[1].backward()
            opt.step()
            opt.zero_grad()
    nf = [e for e in events(sink) if e.check == "nonfinite"]
    assert [e.module for e in nf] == ["blocks.1.mlp.0", None, None]
    assert "Localisation:" in nf[0].message and "Localisation:" not in nf[1].message

    clean_server_env(monkeypatch)
    with TestClient(create_app(Settings())) as client:
        assert client.post("/v1/reports", content=sink.batch().model_dump_json(),
                           headers={"content-type": "application/json"}).status_code == 202
        state = client.get("/v1/runs/localise-1").json()
    stored = [e for e in state["ranks"][0]["recent_events"] if e["check"] == "nonfinite"]
    assert stored[0]["module"] == "blocks.1.mlp.0"


def test_without_optimizer_the_next_forward_localises() -> None:
    m = tiny_gpt()
    sink = MemorySink()
    with guard.attach(m, policy=policy(nonfinite={"action": "warn"}), vocab_size=REAL) as g:
        g.add_sink(sink)
        g.step()  # explicit boundaries: the forwards below run hooks only
        base = hook_count(m)
        poison(m)
        m(*batch())
        g.step()  # step 2: nonfinite, no re-run possible: flags armed for the next forward
        assert hook_count(m) > base
        with no_host_reads():
            m(*batch())
        g.step()  # step 3 reads the armed flags and removes them
        assert hook_count(m) == base
    found = [e for e in events(sink) if e.module]
    assert len(found) == 1 and found[0].module == "blocks.1.mlp.0"
    assert "localised with per-module flags armed after step 2" in found[0].message
    assert found[0].step == 3
    # The event is not a violation; the first, empty step saw nothing (coverage).
    assert g.stats["violations"] == {"nonfinite": {"warn": 2}, "coverage": {"warn": 1}}


def test_a_nan_that_does_not_recur_is_reported_as_not_localised() -> None:
    m = tiny_gpt()
    sink = MemorySink()
    with guard.attach(m, policy=policy(nonfinite={"action": "warn"}), vocab_size=REAL) as g:
        g.add_sink(sink)
        m(*batch())
        g.step(torch.tensor(NAN))  # a NaN loss once, from outside the model
        m(*batch())
        g.step()
    msgs = [e.message for e in events(sink)]
    assert any("did not recur in the next training forward; not localised" in s for s in msgs)
    assert all(e.module is None for e in events(sink))


def test_fail_without_optimizer_says_how_to_localise() -> None:
    m = tiny_gpt()
    g = guard.attach(m, policy=policy(), vocab_size=REAL)
    poison(m)
    m(*batch())
    with pytest.raises(GuardViolation, match=r"Pass optimizer= to guard\.attach to name the "
                       r"first non-finite module") as e:
        m(*batch())
    assert e.value.module is None
    g.detach()


def test_localise_off_never_reruns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(sys.modules["guard.step.episodes"], "rerun", lambda *a: calls.append(1))
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pol = policy(nonfinite={"action": "warn", "localise": False})

    def keeping() -> list[object]:  # the hooks that keep each forward's inputs for a re-run
        return [h for h in m._forward_pre_hooks.values()
                if getattr(h, "__qualname__", "").endswith("Episodes._keep")]

    with guard.attach(m, policy=policy(), vocab_size=REAL, optimizer=opt):
        assert len(keeping()) == 1  # localise on: one
    with guard.attach(m, policy=pol, vocab_size=REAL, optimizer=opt) as g:
        assert keeping() == []  # nothing held either
        poison(m)
        m(*batch())[1].backward()
        opt.step()
        assert g.stats["violations"] == {"nonfinite": {"warn": 1}} and calls == []


def test_rerun_repeats_the_forwards_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = capture((), {}, "cpu")
    assert inside.autocast and inside.autocast_dtype == torch.bfloat16
    assert not capture((), {}, "cpu").autocast


def test_localiser_records_training_forwards_only() -> None:
    m = tiny_gpt()
    loc = Localiser(m, training_only=True)
    loc.arm()
    m.eval()
    m(*batch())
    assert loc.calls == []
    m.train()
    poison(m)
    m(*batch())
    found = loc.first()
    loc.disarm()
    assert found is not None and found.module == "blocks.1.mlp.0" and found.inputs_finite
    assert hook_count(m) == 0
