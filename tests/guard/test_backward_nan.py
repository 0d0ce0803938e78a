"""A NaN/Inf born in the backward, with a finite forward: stopped, skipped or counted before the
update writes it into the weights, the parameters named; under GradScaler the scaler's own."""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import guard
from guard import GuardViolation
from tests.conftest import batch, policy, tiny_gpt


class NaNBackward(torch.autograd.Function):
    """A custom op: identity forward, a NaN gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def custom_op(out: torch.Tensor) -> torch.Tensor:
    return NaNBackward.apply(out)  # type: ignore[no-any-return]


def sqrt_at_zero(out: torch.Tensor) -> torch.Tensor:
    # + sqrt(|0 * out|): adds 0; its gradient is 1 / (2 sqrt(0)) = inf, times 0: NaN.
    return out + torch.sqrt((out * 0).abs())


def bf16_overflow(out: torch.Tensor) -> torch.Tensor:
    # log of 1e-40 in bfloat16 (its smallest subnormal, 9.2e-41) is finite, -92; its gradient,
    # 1.1e40 times the upstream one, is past bfloat16's largest value (3.4e38): inf, and times
    # the 0 that made the input, NaN.
    tiny = out.to(torch.bfloat16) * 0 + 1e-40
    log = torch.log(tiny)
    return out + (log - log.detach()).to(out.dtype)


FAULTS = [pytest.param(custom_op, id="custom-backward"),
          pytest.param(sqrt_at_zero, id="sqrt-at-0"),
          pytest.param(bf16_overflow, id="bf16-overflow")]
FAULT_STEP, STEPS = 2, 4


@contextmanager
def fault_in(model: nn.Module, fault: Callable[[torch.Tensor], torch.Tensor],
             at: Callable[[], bool]) -> Iterator[None]:
    """`fault` on the output of the first block while `at()` says so."""
    def apply(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return fault(out) if at() else None

    handle = model.blocks[0].register_forward_hook(apply)  # type: ignore[index]
    try:
        yield
    finally:
        handle.remove()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: list[int],
          fault: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[float]:
    """The steps given (each its own batch), the fault at FAULT_STEP; the losses."""
    now = {"step": 0}
    losses = []
    with fault_in(model, fault or (lambda t: t), lambda: now["step"] == FAULT_STEP):
        for step in steps:
            now["step"] = step
            _, loss = model(*batch(seed=step))
            assert torch.isfinite(loss)  # the forward is finite: only the backward is not
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses


def state_of(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def same(a: Any, b: Any) -> bool:
    """Bitwise equal, for nested optimizer states and parameter lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("fault", FAULTS)
def test_fail_stops_before_the_update_and_names_the_parameter(
        fault: Callable[[torch.Tensor], torch.Tensor]) -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        now = {"step": 0}
        with fault_in(m, fault, lambda: now["step"] == FAULT_STEP):
            for step in range(1, STEPS + 1):
                now["step"] = step
                _, loss = m(*batch(seed=step))
                loss.backward()
                if step == FAULT_STEP:
                    weights = [p.detach().clone() for p in m.parameters()]
                    before = state_of(opt)
                    with pytest.raises(GuardViolation) as info:
                        opt.step()
                    break
                opt.step()
                opt.zero_grad()
    e = info.value
    assert (e.check, e.step, e.action) == ("nonfinite", FAULT_STEP, "fail")
    assert same(weights, [p.detach() for p in m.parameters()])  # bitwise unchanged
    assert same(before, state_of(opt))
    text = str(e)
    assert "parameters' gradients" in text and "born in the backward" in text
    # Upstream of the first block: its own weights and the embeddings (tied to the head).
    assert "blocks.0.attn.weight" in text and "wte.weight" in text
    assert "torch.autograd.detect_anomaly()" in text
    assert "Localisation" not in text  # no forward re-run: the forward was finite
    assert g.stats["nonfinite"]["grad"] > 0 and g.stats["nonfinite"]["loss"] == 0


@pytest.mark.parametrize("fault", FAULTS)
def test_skip_drops_that_update_and_the_run_goes_on_as_one_without_that_step(
        fault: Callable[[torch.Tensor], torch.Tensor]) -> None:
    m = tiny_gpt()
    ref = copy.deepcopy(m)
    skip = policy(nonfinite={"action": "skip"})
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with guard.attach(m, policy=skip, vocab_size=100, optimizer=opt) as g:
        train(m, opt, list(range(1, STEPS + 1)), fault)
    assert g.stats["skipped_steps"] == 1
    assert g.stats["violations"]["nonfinite"] == {"skip": 1}
    # The same run without that step, under the same guard (its mask shapes every loss).
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    with guard.attach(ref, policy=skip, vocab_size=100, optimizer=ref_opt):
        train(ref, ref_opt, [s for s in range(1, STEPS + 1) if s != FAULT_STEP])
    assert same([p.detach() for p in m.parameters()], [p.detach() for p in ref.parameters()])
    assert same(state_of(opt)["state"], state_of(ref_opt)["state"])


def test_warn_counts_it_and_the_update_goes_through(caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=policy(nonfinite={"action": "warn"}), vocab_size=100,
                         optimizer=opt) as g:
        now = {"step": 0}
        with fault_in(m, custom_op, lambda: now["step"] == 1):
            now["step"] = 1
            _, loss = m(*batch())
            loss.backward()
            opt.step()
    assert g.stats["violations"]["nonfinite"] == {"warn": 1}
    assert not torch.isfinite(m.blocks[0].attn.weight).all()  # written into the weights
    assert "born in the backward" in caplog.text and "continuing (action: warn)" in caplog.text


def test_the_gradient_norm_is_a_figure_with_its_largest_parameter() -> None:
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        _, loss = m(*batch())
        loss.backward()
        norms = {n: p.grad.norm() for n, p in m.named_parameters() if p.grad is not None}
        opt.step()
    total = torch.stack(list(norms.values())).norm()
    top = max(norms, key=lambda n: float(norms[n]))
    s = g.stats
    assert s["grad_norm"] == pytest.approx(float(total), rel=1e-5)
    assert s["grad_norm_top"] == top
    assert s["grad_norm_top_share"] == pytest.approx(float(norms[top] ** 2 / total ** 2),
                                                     rel=1e-4)
    assert s["nonfinite"]["grad"] == 0 and s["violations"] == {}
    assert g.figures()["guard/grad_norm"] == s["grad_norm"]


def test_a_gradscaler_skip_is_its_own_and_counted_not_a_violation() -> None:
    # init_scale 2**127: the scaled loss overflows float32 at the first two steps, the
    # scaler skips them (optimizer.step is never called) and halves its scale each time.
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    scales = []
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        for step in range(1, 6):
            _, loss = m(*batch(seed=step))
            scaler.scale(loss).backward()
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    skipped = sum(b > a for b, a in itertools.pairwise(scales))
    assert skipped == 2
    s = g.stats
    assert s["scaler_skipped_steps"] == skipped
    assert s["violations"] == {}  # the scaler's business
    assert s["step"] == 5  # every step ended, the skipped ones too
    assert s["nonfinite"]["grad"] == 0 and s["grad_norm"] is not None


def test_a_scaler_given_with_g_step_counts_its_skips_at_the_boundary() -> None:
    # Lightning's way: g.step() after the unscale, before the scaler decides.
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    with guard.attach(m, policy=policy(), vocab_size=100, scaler=scaler) as g:
        for step in range(1, 5):
            _, loss = m(*batch(seed=step))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            g.step()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert g.stats["scaler_skipped_steps"] == 2
    assert g.stats["violations"] == {}


def test_a_scaler_must_be_a_gradscaler() -> None:
    with pytest.raises(guard.AttachError, match=r"scaler= must be a torch\.amp\.GradScaler"):
        guard.attach(tiny_gpt(), policy=policy(), vocab_size=100, scaler=object())


def test_a_healthy_run_is_quiet_with_the_gradients_checked(
        caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="guard"), \
            guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        train(m, opt, list(range(1, STEPS + 1)))
    assert g.stats["violations"] == {}
    assert g.stats["scaler_skipped_steps"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
