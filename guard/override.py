"""One way to swap an attribute of an object the guard does not own and put it back: the HF
model's loss function, DeepSpeed's optimizer `step`, a model's `get_output_embeddings` while a
fused head runs, torch's clip functions, a pipeline stage's shape inference. Runs at attach
and detach (and around a fused forward); no torch."""

from __future__ import annotations

from typing import Any

__all__ = ["Override", "override"]

_NONE = object()  # the instance held no attribute of that name: the class's showed through


class Override:
    """What `override` returns: `remove()` puts back exactly what was there; idempotent."""

    def __init__(self, obj: object, name: str, before: Any, value: Any) -> None:
        self._undo: tuple[object, str, Any, Any] | None = (obj, name, before, value)

    def remove(self) -> None:
        """The instance's own attribute as it was, or none again where it had none (the
        class's shows through again). Left as it is where something replaced the guard's
        value since: that one is not the guard's to take away."""
        if self._undo is None:
            return
        obj, name, before, value = self._undo
        self._undo = None
        own = vars(obj)
        if own.get(name, _NONE) is not value:
            return
        if before is _NONE:
            del own[name]
        else:
            own[name] = before


def override(obj: object, name: str, value: Any) -> Override:
    """`obj.name` is `value` until the handle's `remove()`: set in the instance's own
    attributes (over the class's, if any), whatever `obj`'s `__setattr__` would do. A name the
    class defines as a data descriptor (a property) cannot be overridden so: a TypeError
    (override the attribute the property keeps, as HF's `loss_function` keeps
    `_loss_function`)."""
    held = getattr(type(obj), name, None)
    if held is not None and hasattr(type(held), "__set__"):
        raise TypeError(f"{type(obj).__name__}.{name} is a property; override what it keeps")
    own = vars(obj)  # a TypeError for an object without a __dict__
    before = own.get(name, _NONE)
    own[name] = value
    return Override(obj, name, before, value)
