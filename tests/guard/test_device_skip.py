"""fail / skip with an optimizer that takes found_inf (fused AdamW, SGD): the bad update is dropped
on the device and `fail` raises at the next read, with no host read of a step's flags before
its update. Each run is held bitwise against a run without the bad step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

import guard
from guard import AttachError, GuardViolation
from guard.device.flags import Flags
from guard.policy_file import load_policy
from guard.step.skip import device_skip
from tests.conftest import batch, policy, tiny_gpt
from tests.guard.test_skip import assert_same, snapshot

Opt = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
FUSED: dict[str, Opt] = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1,
                                            fused=True),
}
GHOST = 110  # a label in [real 100, rows 128)


class HostReads:
    """Every host read of the flags (Flags._wait, the guard's one read point): `sync` when it
    reads the snapshot taken at this very read (the values of the step about to be updated),
    `lagged` when it reads one taken at an earlier read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self._latest: object = None
        snapshot, wait = Flags._snapshot, Flags._wait

        def snap(flags: Flags, reduce: bool) -> Any:
            entry = snapshot(flags, reduce)
            self._latest = entry[0]
            return entry

        def read(entry: Any) -> Any:
            self.events.append("sync" if entry[0] is self._latest else "lagged")
            return wait(entry)

        monkeypatch.setattr(Flags, "_snapshot", snap)
        monkeypatch.setattr(Flags, "_wait", staticmethod(read))


@contextmanager
def bad(m: nn.Module, kind: str) -> Iterator[None]:
    """The next forward's ln_f output made non-finite (NaN) or 300x (a loss spike); the weights
    are never touched, so a run without the step is bitwise comparable."""
    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if kind == "nan":
            out = out.clone()
            out[..., 3] = float("nan")
            return out
        return out * 300.0

    handle = m.ln_f.register_forward_hook(hook) if kind in ("nan", "spike") else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def step(m: nn.Module, opt: torch.optim.Optimizer, seed: int, ghost: bool = False) -> None:
    x, y = batch(seed=seed)
    if ghost:
        y[0, 0] = GHOST
    m(x, y)[1].backward()
    opt.step()
    opt.zero_grad()


# Per case: the policy's checks, and how the bad step is made. A ghost label under skip: the
# mask makes its loss +inf, so nonfinite drops the step.
CASES: dict[tuple[str, str], dict[str, Any]] = {
    ("nan", "fail"): {"nonfinite": {"action": "fail"}},
    ("nan", "skip"): {"nonfinite": {"action": "skip"}},
    ("ghost", "fail"): {"token_range": {"action": "fail"}},
    ("ghost", "skip"): {"token_range": {"action": "warn"}, "nonfinite": {"action": "skip"}},
    ("spike", "fail"): {"loss_spike": {"action": "fail", "warmup": 2}},
    ("spike", "skip"): {"loss_spike": {"action": "skip", "warmup": 2}},
}


def run(make_opt: Opt, checks: dict[str, Any], seeds: list[int], bad_at: int | None = None,
        kind: str = "", reads: HostReads | None = None,
        **cadence: Any) -> tuple[nn.Module, torch.optim.Optimizer, list[str], Any]:
    """Steps on `seeds`, the one at index `bad_at` made bad; returns the model, optimizer, the
    host reads from the bad step on and the GuardViolation raised (None)."""
    m = tiny_gpt(tie=False)
    opt = make_opt(list(m.parameters()))
    pol = {**policy(padding_mass={"action": "mask"}, **checks), "cadence": cadence}
    raised, mark = None, 0
    with guard.attach(m, policy=pol, vocab_size=100, optimizer=opt):
        try:
            for i, seed in enumerate(seeds):
                if i == bad_at:
                    mark = len(reads.events) if reads is not None else 0
                    with bad(m, kind):
                        step(m, opt, seed, ghost=kind == "ghost")
                else:
                    step(m, opt, seed)
        except GuardViolation as e:
            raised = e
        after = reads.events[mark:] if reads is not None else []  # up to detach's reads
    return m, opt, after, raised


@pytest.mark.parametrize("make_opt", FUSED.values(), ids=FUSED.keys())
@pytest.mark.parametrize(("kind", "action"), CASES.keys())
def test_the_bad_update_is_dropped_on_the_device(make_opt: Opt, kind: str, action: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    checks = CASES[(kind, action)]
    reads = HostReads(monkeypatch)
    m, opt, after, raised = run(make_opt, checks, [0, 1, 2, 3], bad_at=2, kind=kind,
                                reads=reads)
    if action == "fail":
        # Raised at the next step's read, naming the bad step (3); neither update applied.
        assert raised is not None and (raised.check, raised.step) == (
            {"nan": "nonfinite", "ghost": "token_range", "spike": "loss_spike"}[kind], 3)
        ref_m, ref_opt, _, _ = run(make_opt, checks, [0, 1])
    else:
        assert raised is None
        ref_m, ref_opt, _, _ = run(make_opt, checks, [0, 1, 3])  # the same run, no bad step
    assert_same(snapshot(m, opt), snapshot(ref_m, ref_opt))
    # No host read of a step's own flags from the bad step to the raise: only the snapshot of
    # the read before (taken while the device ran on).
    assert after and set(after) == {"lagged"}, after


@pytest.mark.parametrize("make_opt", FUSED.values(), ids=FUSED.keys())
def test_the_default_policy_reads_no_step_before_its_update(
        make_opt: Opt, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = HostReads(monkeypatch)
    run(make_opt, {}, [0, 1, 2, 3, 4], reads=reads)
    # One read a step from step 2, each of the read before; then detach reads what is left.
    assert reads.events == ["lagged"] * 4 + ["sync", "sync"], reads.events


def test_a_fail_drops_every_update_until_it_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """read_every 2: the NaN at step 4 (a read) drops step 4 and, sticky, step 5; the raise
    comes at step 6's read, naming step 4."""
    make = FUSED["adamw-fused"]
    reads = HostReads(monkeypatch)
    checks = CASES[("nan", "fail")]
    m, opt, after, raised = run(make, checks, [0, 1, 2, 3, 4, 5], bad_at=3, kind="nan",
                                reads=reads, read_every=2)
    assert raised is not None and raised.step == 4
    ref_m, ref_opt, _, _ = run(make, checks, [0, 1, 2], read_every=2)
    assert_same(snapshot(m, opt), snapshot(ref_m, ref_opt))
    assert set(after) == {"lagged"}


def test_before_update_reads_before_the_update_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = HostReads(monkeypatch)
    _, _, after, raised = run(FUSED["adamw-fused"], CASES[("nan", "fail")], [0, 1, 2, 3],
                              bad_at=2, kind="nan", reads=reads, fail_read="before_update")
    assert raised is not None and raised.step == 3
    assert after == ["sync"]  # the raise at the bad step itself, before its update


def test_lagged_needs_an_optimizer_that_takes_found_inf() -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    with pytest.raises(AttachError, match=r"cadence.fail_read: lagged .* AdamW takes no "
                       r"found_inf: use an optimizer with fused=True"):
        guard.attach(m, policy={**policy(), "cadence": {"fail_read": "lagged"}},
                     vocab_size=100, optimizer=opt)


def test_an_optimizer_without_found_inf_is_said_at_attach_where_a_read_is_a_sync(
        caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    with caplog.at_level(logging.INFO, logger="guard"), \
            guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt):
        pass
    # On the CPU the copy to the host is the read itself: no sync to avoid, nothing said.
    assert not [r for r in caplog.records if "sync per step" in r.message]
    # Flags on an accelerator (a meta tensor stands in for one: only its device is asked).
    on_gpu = cast(Flags, SimpleNamespace(t=torch.empty(0, device="meta")))
    with caplog.at_level(logging.INFO, logger="guard"):
        assert device_skip(load_policy(policy()), opt, on_gpu, hooked=True) is None
    said = [r.message for r in caplog.records if "sync per step" in r.message]
    assert said == ["nonfinite, token_range (AdamW) read before each update: this "
                    "optimizer needs a sync per step for fail/skip: use fused=True "
                    "(torch.optim.AdamW, Adam, SGD) to drop a bad update on the device instead"]


def scaled_run(seeds: list[int], *, spike_at: int | None = None, inf_at: int | None = None,
               ) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """Fused AdamW under a GradScaler: a loss spike the guard skips, or an inf gradient the
    scaler skips (nonfinite only warns, so the guard's found_inf is 0 there)."""
    m = tiny_gpt(tie=False)
    opt = FUSED["adamw-fused"](list(m.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    pol = policy(padding_mass={"action": "mask"}, nonfinite={"action": "warn"},
                 loss_spike={"action": "skip", "warmup": 2})
    with guard.attach(m, policy=pol, vocab_size=100, optimizer=opt):
        for i, seed in enumerate(seeds):
            with bad(m, "spike" if i == spike_at else ""):
                scaler.scale(m(*batch(seed=seed))[1]).backward()
            if i == inf_at:
                next(iter(m.parameters())).grad[0, 0] = float("inf")  # type: ignore[index]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return m, opt, scaler


def test_a_gradscalers_skip_and_the_guards_compose() -> None:
    # The guard's skip: dropped, and the scaler's scale is not backed off for it.
    m, opt, scaler = scaled_run([0, 1, 2, 3], spike_at=2)
    ref_m, ref_opt, ref_scaler = scaled_run([0, 1, 3])
    assert_same(snapshot(m, opt), snapshot(ref_m, ref_opt))
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**8
    # The scaler's skip (an inf gradient, the guard's found_inf 0): dropped too, not overwritten.
    m, opt, scaler = scaled_run([0, 1, 2], inf_at=2)
    ref_m, ref_opt, _ = scaled_run([0, 1])
    assert_same(snapshot(m, opt), snapshot(ref_m, ref_opt))
    assert scaler.get_scale() == 2.0**7 and not hasattr(opt, "found_inf")


@pytest.mark.parametrize("make_opt", FUSED.values(), ids=FUSED.keys())
def test_a_dropped_first_step_leaves_the_next_one_as_a_first_step(make_opt: Opt) -> None:
    """Fused SGD's first step makes its momentum buffers with empty_like and fills them in the
    kernel: dropped, they would hold whatever memory held (the guard makes them zeros first)."""
    checks = CASES[("nan", "skip")]
    m, _, _, _ = run(make_opt, checks, [0, 1], bad_at=0, kind="nan")
    ref_m, _, _, _ = run(make_opt, checks, [1])
    assert_same(m.state_dict(), ref_m.state_dict())
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_sgd_with_momentum_and_dampening_reads_before_the_update() -> None:
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.1, fused=True)
    with pytest.raises(AttachError, match="SGD takes no found_inf"):
        guard.attach(m, policy={**policy(), "cadence": {"fail_read": "lagged"}},
                     vocab_size=100, optimizer=opt)
