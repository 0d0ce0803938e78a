"""What the device side asks of the stateful checks' states: their collection (guard/stateful/
states.py's `States`, which this room may not import), the one owner of their order. The id
hooks call `count` (device ops only); the step clock, through the probe, `end_step` at each
boundary and `check` before each read of the flags."""

from __future__ import annotations

from typing import Protocol

import torch

from guard_server.wire import IdKind

__all__ = ["Watched"]


class Watched(Protocol):
    """The stateful checks' states of one guard, as the probe and the id hooks use them."""

    @property
    def reads_at_attach(self) -> bool: ...

    def watches(self, kind: IdKind) -> bool: ...

    def count(self, kind: IdKind, ids: torch.Tensor) -> None: ...

    def end_step(self) -> None: ...

    def check(self, *, weights: bool = True) -> None: ...
