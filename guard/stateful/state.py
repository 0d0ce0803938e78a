"""What a stateful check is made of: a state object made at attach, which owns what the check
found there, the device state its hooks write, its reads before each flags read, its repair,
what it adds to its message and what it says at attach. The guard calls them through their
collection (guard/stateful/states.py), which fixes their order on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from guard.checks.spec import Spec, Stats
from guard.device.flags import Flags
from guard.device.hooks import Handle
from guard.device.reading import Reading
from guard.policy import Policy
from guard.vocab.discover import Heads
from guard.vocab.resolve import Sizes
from guard.vocab.stage import Stage
from guard_server.wire import CheckName, IdKind, WeightName

__all__ = ["Attaching", "CheckState", "Finding"]


@dataclass(frozen=True)
class Attaching:
    """What a check may read at attach to make its state."""

    policy: Policy
    flags: Flags  # the one device vector its slots live in
    heads: Heads
    sizes: Sizes
    model: nn.Module  # the module the guard hooks
    rank: int
    tokenizer: Any = None  # as given to attach (names ids in messages)
    optimizer: torch.optim.Optimizer | None = None  # the torch optimizer whose step is hooked
    scaled: bool = False  # a GradScaler skips the updates whose gradients are not finite
    # The module whose forward hooks see each call of `model`: a wrapper that calls the
    # model's forward method past its hooks (guard/wrappers.py); None: the model itself.
    caller: nn.Module | None = None
    stage: Stage | None = None  # the pipeline stage the model is (None: a whole model)


@dataclass(frozen=True)
class Finding:
    """Rows one check found at attach in one weight (`Guard.findings`)."""

    check: CheckName
    weight: str  # the parameter's name in the model: "wte.weight (tied: lm_head.weight)"
    roles: tuple[WeightName, ...]  # what it is: the embedding, the head, both when tied
    ids: tuple[int, ...]  # its rows found, as ids of the whole vocab
    reasons: tuple[str, ...]  # per id, why (the check's own words: "near_zero", ...)


class CheckState:
    """The state of one stateful check in one guard. Each method runs at the same point on
    every rank (a collective may be among them), called by `States`. The defaults do nothing,
    so a check defines only the verbs it has."""

    spec: ClassVar[Spec[Any]]
    # `check` runs at the read of detach too, local: one rank may detach alone, so a check
    # that reads the weights or calls a collective does not.
    at_detach: ClassVar[bool] = True

    @property
    def check_name(self) -> CheckName:
        return self.spec.check

    @property
    def reads_at_attach(self) -> bool:
        """Something is checked before step 1 (the attach read)."""
        return False

    def watches(self, kind: IdKind) -> bool:
        """Its hooks count this kind of id (guard/device/ids.py calls `count`)."""
        return False

    def count(self, kind: IdKind, ids: torch.Tensor) -> None:
        """A training forward's ids of `kind`, into the flags: device ops only."""

    def install(self) -> list[Handle]:
        """What it puts on besides the probe's hooks, at attach once nothing can refuse it;
        removed with them."""
        return []

    def end_step(self) -> None:
        """At each step boundary (before the update where the boundary is the optimizer's
        step or g.step()): its reductions into the flags, device ops only."""

    def check(self) -> None:
        """Before each read of the flags: its reductions into them (device ops only)."""

    def stats(self, reading: Reading) -> Stats:
        """Its figures in `g.stats` and the report that only the host knows (names)."""
        return {}

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        """At a read where its check fired: what the host adds to the message. `reduce`: the
        reading was combined over ranks (a collective may follow; not at detach)."""
        return ""

    def repair(self) -> None:
        """Its `repair` action, at a read where its check fired (and `Guard.repair()`)."""

    def unread(self) -> str | None:
        """The weights whose rows it cannot read between steps, and why (a coverage violation
        at attach; None: it reads them all)."""
        return None

    def attach_note(self, rank: int) -> str | None:
        """What it found at attach, said once (None: nothing to say)."""
        return None

    def after_attach(self, model: nn.Module) -> None:
        """Once the attach read passed: what it changes besides the weights (the model's
        generation config), last, so that a refused attach leaves the model as it was."""

    def findings(self) -> tuple[Finding, ...]:
        """The rows it found at attach."""
        return ()
