"""accelerate (issue 20): `model, opt, dl = accelerator.prepare(...)` then
`guard.attach(model, optimizer=opt)`. The guard hooks the torch optimizer inside accelerate's
AcceleratedOptimizer (a subclass of torch.optim.Optimizer that never runs its __init__), so
`fail` and `skip` act before the update; under `accelerator.accumulate` the step's loss is the
mean of its micro-batch losses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import guard
from guard import GuardViolation
from tests.conftest import policy
from tests.integrations.test_transformers import examples, gpt2, word_tokenizer


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> Iterator[None]:
    """accelerate keeps its state in process-wide singletons: each test starts from none."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def prepared(accumulate: int = 1, *, ghost: int | None = None) -> tuple[Any, ...]:
    tok = word_tokenizer()
    model = gpt2(len(tok))
    model.train()
    data = examples(tok, ghost=ghost)[:8]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model, opt, loader = acc.prepare(model, opt, loader)
    return acc, model, opt, loader, tok


def snapshot(model: torch.nn.Module, opt: Any) -> tuple[dict[str, torch.Tensor], Any]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    inner = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in enumerate(opt.optimizer.state.values())}
    return state, inner


def same(a: tuple[dict[str, torch.Tensor], Any], b: tuple[dict[str, torch.Tensor], Any]) -> bool:
    return all(torch.equal(v, b[0][k]) for k, v in a[0].items()) and all(
        torch.equal(v, b[1][i][k]) if isinstance(v, torch.Tensor) else v == b[1][i][k]
        for i, s in a[1].items() for k, v in s.items())


def test_the_prepared_optimizer_is_the_boundary_and_fail_holds_before_the_update() -> None:
    acc, model, opt, loader, tok = prepared()
    batches = list(loader)
    ghost = {k: v.clone() for k, v in batches[1].items()}
    ghost["labels"][0, 2] = 60  # a ghost label: in [real, rows)
    with guard.attach(model, policy=policy(), tokenizer=tok, optimizer=opt) as g:
        acc.backward(model(**batches[0]).loss)
        opt.step()
        opt.zero_grad()
        assert g.stats["step"] == 1
        before = snapshot(model, opt)
        acc.backward(model(**ghost).loss)
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 2"):
            opt.step()
        assert same(snapshot(model, opt), before)  # weights and AdamW state: untouched


def test_skip_drops_the_update_through_the_wrapper() -> None:
    acc, model, opt, loader, tok = prepared()
    batches = list(loader)
    skip = policy(nonfinite={"action": "skip"})
    with guard.attach(model, policy=skip, tokenizer=tok, optimizer=opt) as g:
        acc.backward(model(**batches[0]).loss)
        opt.step()
        opt.zero_grad()
        before = snapshot(model, opt)
        bad = model(**batches[1]).loss * float("nan")
        acc.backward(bad)
        g.step(bad)  # the loss this step backpropagates
        opt.step()  # skipped: the guard cleared the gradients in the step pre-hook
        opt.zero_grad()
    assert same(snapshot(model, opt), before)
    assert g.stats["skipped_steps"] == 1


def test_under_accumulate_the_steps_loss_is_the_mean_of_its_micro_batches() -> None:
    acc, model, opt, loader, tok = prepared(accumulate=2)
    losses: list[float] = []
    with guard.attach(model, policy=policy(), tokenizer=tok, optimizer=opt) as g:
        for batch in list(loader)[:2]:  # one optimizer step of two micro-batches
            with acc.accumulate(model):
                loss = model(**batch).loss
                losses.append(loss.item())
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
        assert g.stats["step"] == 1
    assert g.stats["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert g.stats["loss"] != pytest.approx(losses[-1], rel=1e-6)


def test_a_prepared_model_under_mixed_precision_takes_its_labels_by_position() -> None:
    """prepare() patches the model's forward in place for autocast (functools.wraps keeps its
    signature): nanoGPT called as model(x, y) is guarded with its labels seen."""
    from tests.conftest import batch
    from tests.integrations.nanogpt import REAL, nanogpt

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    raw = nanogpt(garbage=None)
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model, opt = acc.prepare(raw, opt)
    assert model is raw and "forward" in vars(model)  # the same module, its forward patched
    with guard.attach(model, policy=policy(), vocab_size=REAL, optimizer=opt) as g:
        _, loss = model(*batch(REAL))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        assert g.stats["step"] == 1 and g.stats["violations"] == {}  # labels and loss seen
        x, y = batch(REAL, seed=1)
        y[0, 1] = 105
        _, loss = model(x, y)
        acc.backward(loss)
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 2: 1 label"):
            opt.step()


def test_a_nan_born_in_the_backward_stops_before_the_update_through_the_wrapper() -> None:
    from tests.guard.test_backward_nan import custom_op

    acc, model, opt, loader, tok = prepared()
    model.transformer.h[0].register_forward_hook(
        lambda m, a, out: custom_op(out) if isinstance(out, torch.Tensor)
        else (custom_op(out[0]), *out[1:]))
    batches = list(loader)
    with guard.attach(model, policy=policy(), tokenizer=tok, optimizer=opt):
        acc.backward(model(**batches[0]).loss)
        before = snapshot(model, opt)
        with pytest.raises(GuardViolation, match="born in the backward") as e:
            opt.step()
    assert (e.value.check, e.value.step) == ("nonfinite", 1)
    assert same(snapshot(model, opt), before)
