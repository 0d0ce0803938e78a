"""The loop's gradient clip, tapped (guard/device/clip.py): a NaN born in one parameter's
gradient is named there, not in every parameter the clip spread it to; the clip's own
per-gradient norms are the check's (one read of the gradients a step); torch's functions are
back after detach; anything the tap does not take goes to torch unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad

import guard
from guard import GuardViolation
from tests.conftest import batch, policy, tiny_gpt

BORN = "blocks.1.mlp.0.weight"  # where the tests write the NaN


def nan_in(param: nn.Parameter) -> None:
    """A NaN written into one element of `param`'s gradient in the backward."""
    def poison(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        out.view(-1)[0] = float("nan")
        return out
    param.register_hook(poison)


@pytest.fixture
def foreach_norms(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of gradients each `torch._foreach_norm` call read, call by call."""
    calls: list[int] = []
    real = torch._foreach_norm

    def counted(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    yield calls


def one_step(m: nn.Module, opt: torch.optim.Optimizer,
             clip: Callable[[], object] | None) -> None:
    x, y = batch()
    _, loss = m(x, y)
    loss.backward()
    if clip is not None:
        clip()
    opt.step()
    opt.zero_grad()


def clip_norm(m: nn.Module, **kw: Any) -> Callable[[], object]:
    return lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, **kw)


def test_a_nan_born_in_one_gradient_is_named_there_under_a_clip() -> None:
    m = tiny_gpt()
    named = dict(m.named_parameters())
    nan_in(named[BORN])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt)
    with pytest.raises(GuardViolation) as e:
        one_step(m, opt, clip_norm(m))
    g.detach()
    # The clip multiplied every gradient by max_norm / NaN: all 28 are NaN by the update.
    assert all(p.grad is not None and p.grad.isnan().all() for p in m.parameters())
    assert (e.value.check, e.value.step) == ("nonfinite", 1)
    assert f"the gradient of {BORN} (1 of {len(named)} parameters)" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_the_clips_norms_are_the_checks_one_read_of_the_gradients(
        foreach_norms: list[int]) -> None:
    m = tiny_gpt()
    n = len(list(m.parameters()))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    totals: list[torch.Tensor] = []
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        one_step(m, opt, lambda: totals.append(torch.nn.utils.clip_grad_norm_(
            m.parameters(), 1e-3)))
        assert foreach_norms == [n]  # the clip's pass, and none of the guard's
        # The figure is the clip's own total (before it clipped, what the Trainer logs).
        assert g.stats["grad_norm"] == pytest.approx(totals[0].item(), rel=1e-6)
        assert totals[0].item() > 1e-3  # it did clip
        foreach_norms.clear()
        one_step(m, opt, None)  # no clip this step: the guard reads the gradients itself
        assert foreach_norms == [n]


def test_the_total_is_torchs_bitwise() -> None:
    m = tiny_gpt()
    _, loss = m(*batch())
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    grads[3] = grads[3].to(torch.bfloat16)  # two groups: torch's order of them is kept
    torchs = torch.nn.utils.get_total_norm
    want = torchs(grads)
    with guard.attach(m, policy=policy(), vocab_size=100):
        assert torch.nn.utils.get_total_norm is not torchs  # the tap's
        got = torch.nn.utils.get_total_norm(grads)
        for foreach in (False, None):
            assert torch.equal(torch.nn.utils.get_total_norm(grads, foreach=foreach), want)
    assert torch.equal(got, want)


def test_torchtitans_clip_get_total_norm_then_clip_grads_with_norm() -> None:
    m = tiny_gpt()
    named = dict(m.named_parameters())
    nan_in(named[BORN])
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)

    def titan() -> None:
        params = list(m.parameters())
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, total)

    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt), \
            pytest.raises(GuardViolation) as e:
        one_step(m, opt, titan)
    assert f"the gradient of {BORN} (1 of" in str(e.value)


def test_a_nan_written_after_the_clip_is_still_seen() -> None:
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    named = dict(m.named_parameters())

    def clip_then_break() -> None:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        grad = named["wpe.weight"].grad
        assert grad is not None
        grad[0, 0] = float("nan")  # a second in-place change: the clip's norm is stale

    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt), \
            pytest.raises(GuardViolation) as e:
        one_step(m, opt, clip_then_break)
    assert "the gradient of wpe.weight (1 of" in str(e.value)


@pytest.mark.parametrize("kw", [{"norm_type": float("inf")}, {"norm_type": 1.0},
                                {"error_if_nonfinite": True}], ids=str)
def test_what_the_tap_does_not_take_goes_to_torch(kw: dict[str, Any],
                                                  foreach_norms: list[int]) -> None:
    m = tiny_gpt()
    n = len(list(m.parameters()))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        one_step(m, opt, clip_norm(m, **kw))
        assert foreach_norms == [n, n]  # torch's clip, then the guard's own read
        assert g.stats["nonfinite"]["grad"] == 0


def test_a_nan_with_error_if_nonfinite_is_torchs_error() -> None:
    m = tiny_gpt()
    nan_in(dict(m.named_parameters())[BORN])
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt), \
            pytest.raises(RuntimeError, match="non-finite"):
        one_step(m, opt, clip_norm(m, error_if_nonfinite=True))


def test_torchs_functions_are_back_after_the_last_detach() -> None:
    before = (clip_grad._get_total_norm, torch.nn.utils.get_total_norm)
    a, b = tiny_gpt(), tiny_gpt(seed=1)
    ga = guard.attach(a, policy=policy(), vocab_size=100)
    wrapped = (clip_grad._get_total_norm, torch.nn.utils.get_total_norm)
    assert wrapped[0] is not before[0] and wrapped[1] is not before[1]
    gb = guard.attach(b, policy=policy(), vocab_size=100)
    assert (clip_grad._get_total_norm, torch.nn.utils.get_total_norm) == wrapped  # once
    ga.detach()
    assert (clip_grad._get_total_norm, torch.nn.utils.get_total_norm) == wrapped
    gb.detach()
    gb.detach()
    assert (clip_grad._get_total_norm, torch.nn.utils.get_total_norm) == before


def test_a_clip_of_other_parameters_leaves_the_guards_own_read() -> None:
    """A second model's clip while the guard watches the first: nothing of it is taken."""
    m, other = tiny_gpt(), tiny_gpt(seed=1)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt) as g:
        _, loss = other(*batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
        one_step(m, opt, None)
        assert g.stats["grad_norm"] is not None and g.stats["grad_norm"] > 0


def test_a_clip_after_the_boundary_takes_the_guards_norms(foreach_norms: list[int]) -> None:
    """Lightning's order: the boundary (g.step()), then the clip, then the update."""
    m = tiny_gpt()
    n = len(list(m.parameters()))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with guard.attach(m, policy=policy(), vocab_size=100, steps="manual") as g:
        _, loss = m(*batch())
        loss.backward()
        grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
        g.step()
        assert foreach_norms == [n]
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
        assert foreach_norms == [n]  # the clip read no gradient
        opt.step()
        foreach_norms.clear()
        assert torch.equal(total, torch.nn.utils.get_total_norm(grads))  # torch's, bitwise
        assert foreach_norms == [n]  # copies the guard never read: torch's own pass
