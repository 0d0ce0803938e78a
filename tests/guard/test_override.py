"""guard/override.py: one handle for the attributes the guard swaps on objects it does not own
(HF's loss function, DeepSpeed's step, get_output_embeddings, torch's clip functions)."""

from __future__ import annotations

import types
from typing import Any

import pytest
from torch import nn

from guard.device import hooks
from guard.device.hooks import wrap_loss, wrap_step
from guard.override import override


class Owner:
    def step(self) -> str:
        return "class"

    @property
    def kept(self) -> int:
        return 1


def test_a_class_attribute_seen_through_the_instance_shows_again() -> None:
    o = Owner()
    h = override(o, "step", lambda: "ours")
    assert o.step() == "ours" and "step" in vars(o)
    h.remove()
    assert o.step() == "class" and "step" not in vars(o)  # deleted, not set to the class's


def test_an_instance_attribute_is_put_back_as_it_was() -> None:
    o = Owner()
    own = o.step = lambda: "own"  # type: ignore[method-assign]
    h = override(o, "step", lambda: "ours")
    h.remove()
    assert vars(o)["step"] is own


def test_a_plain_attribute_and_an_absent_one() -> None:
    o = types.SimpleNamespace(x=1)
    hx, hy = override(o, "x", 2), override(o, "y", 3)
    assert (o.x, o.y) == (2, 3)
    hx.remove()
    hy.remove()
    assert vars(o) == {"x": 1}


def test_remove_is_idempotent_and_leaves_a_later_value() -> None:
    o = Owner()
    h = override(o, "step", lambda: "ours")
    h.remove()
    theirs = o.step = lambda: "theirs"  # type: ignore[method-assign]
    h.remove()  # a second remove does nothing
    assert vars(o)["step"] is theirs
    h2 = override(o, "step", lambda: "ours")
    later = o.step = lambda: "later"  # type: ignore[method-assign]
    h2.remove()  # replaced since: not the guard's to take away
    assert vars(o)["step"] is later


def test_stacked_overrides_removed_last_first_leave_nothing() -> None:
    o = Owner()
    a = override(o, "step", lambda: "a")
    b = override(o, "step", lambda: "b")
    b.remove()
    assert o.step() == "a"
    a.remove()
    assert "step" not in vars(o)


def test_a_property_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Owner\.kept is a property"):
        override(Owner(), "kept", 2)


class HFLike(nn.Module):
    """A settable `loss_function` as HF's PreTrainedModel has it."""

    @property
    def loss_function(self) -> Any:
        return getattr(self, "_loss_function", lambda logits: ("mapped", logits))

    @loss_function.setter
    def loss_function(self, value: Any) -> None:
        self._loss_function = value


def test_the_loss_wrap_and_the_step_wrap_go_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The hot-path scan compares what registers in this process with guard/'s code: these
    # lambdas stay out of its record.
    monkeypatch.setattr(hooks, "_REGISTERED", dict(hooks.registered()))
    m = HFLike()
    h = wrap_loss(m, lambda logits: logits + 1)
    assert m.loss_function(1) == ("mapped", 2)
    h.remove()
    assert "_loss_function" not in vars(m) and m.loss_function(1) == ("mapped", 1)
    given = lambda logits: ("given", logits)  # noqa: E731
    m.loss_function = given
    h = wrap_loss(m, lambda logits: logits * 10)
    assert m.loss_function(1) == ("given", 10)
    h.remove()
    assert vars(m)["_loss_function"] is given

    o = Owner()
    h = wrap_step(o, lambda step: ("pre", step()))
    assert o.step() == ("pre", "class")
    with pytest.raises(TypeError, match="already wrapped"):
        wrap_step(o, lambda step: step())
    h.remove()
    assert o.step() == "class" and "step" not in vars(o)
