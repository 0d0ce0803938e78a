"""What a per-step check is made of: its device slots, its thresholds from the policy, the data
it needs, its figures on the host and on the wire, and the message of a violation.

Pure Python: no tensor, no hook. The flags tensor lays its slots out from the specs
(guard/device/flags.py), the verdict iterates them (guard/step/verdict.py) and the record takes
their figures (guard/step/record.py). Besides its spec, a check is its policy model, its name
on the wire and the device code that writes its slots; a check that keeps state from attach
on is one object besides (guard/stateful/). docs/architecture.md lists the files each kind
touches, and tests/test_architecture.py counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from guard.policy import Policy
from guard_server.wire import CheckName

__all__ = ["Context", "Figures", "Found", "Gauges", "Name", "Raw", "Reduce", "SeenKind", "Setup",
           "Slot", "Spec", "Stats", "Total", "Watching", "fmt", "listed"]

# A spec's name: a check's (the policy's key and the wire's), or a figure the checks share.
Name = CheckName | Literal["loss", "grads"]

# How a slot accumulates within a read window, and combines over ranks (all-reduce MAX) and
# over two windows read at once (a lagged read still queued).
Reduce = Literal["sum", "max", "last"]
# What a training step must show the guard for the per-step checks to see anything (coverage).
SeenKind = Literal["logits", "inputs", "labels", "loss"]
# Per kind of data, the enabled checks that need it; empty where coverage is off.
Watching = Mapping[SeenKind, tuple[CheckName, ...]]
# A check's figures in `g.stats` and on the wire, named as there: a gauge (a float, None when
# the window measured nothing; text, a name), a count (`Total`) or counts per kind, added up
# since attach.
Stats = Mapping[str, float | str | Mapping[Any, int] | None]

F = TypeVar("F")
K = TypeVar("K", bound=str)


class Total(int):
    """A count of the window that adds up since attach in `g.stats` and on the wire (a gauge,
    a plain float, replaces the last read's)."""


class Gauges(dict[str, int]):
    """Figures per kind that are a state, not a count (the untrained rows left per weight): in
    `g.stats` and on the wire they replace the last read's, where counts add up."""


@dataclass(frozen=True, eq=False)  # identity: a slot is one position in the flags vector
class Slot:
    """One number of the flags vector, as a check writes it inside a hook."""

    name: str
    reduce: Reduce = "sum"
    # "last": the slot that is non-zero when the window wrote this one, so that two windows
    # read as one keep the newer value only where the newer window has one.
    written: Slot | None = None
    # A per-step mark (set while the step sees its data, zeroed at each step boundary): this
    # slot counts the steps that ended with it still zero.
    without: Slot | None = None


@dataclass(frozen=True)
class Setup:
    """What a check's thresholds may depend on besides the policy (fixed at attach)."""

    watching: Watching  # per kind of data, the enabled checks that need it
    real: int = 1  # real columns of this process's head output
    columns: int = 1  # its output columns: real, then padding


class Raw(Protocol):
    """One read window's value per slot (host floats)."""

    def __getitem__(self, slot: Slot, /) -> float: ...


class Figures(Protocol):
    """Every spec's figures of one read window, typed per spec: `values[SPEC].mean`."""

    def __getitem__(self, spec: Spec[F], /) -> F: ...


@dataclass(frozen=True)
class Context:
    """What a message needs besides the check's own figures."""

    glob: Figures  # every spec's figures, max-combined over ranks
    policy: Policy
    next: str  # what happens next, from the action
    real: int  # the real vocab, clipped to the rows
    rows: int  # rows of the whole vocab
    head: str  # the head's name in the model
    crossed: frozenset[Slot]  # the slots past their threshold on some rank
    watching: Watching
    real_from: str = ""  # where the real vocab came from: "len(tokenizer)", "vocab_size=", ...
    # What the check's state adds on the host (guard/stateful/): the ids and their tokens, the
    # weights it read; "" where the check keeps none.
    detail: str = ""
    # (real, columns) of the softmax the padding mass was measured over, where it is not the
    # whole vocab's (a vocab-parallel shard alone in its process): its threshold's.
    mass: tuple[int, int] | None = None


@dataclass(frozen=True)
class Found:
    """A violation's value, the threshold it passed and its text (after 'check on rank r at
    step s: ')."""

    value: float
    threshold: float
    text: str
    count: int = 1  # training steps it stands for (coverage counts each blind step)
    once: str | None = None  # a key: only the first violation with it is logged and reported
    kind: str = ""  # what it saw (a tensor, a kind of id): a new kind is logged at once


def _no_thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return {}


def _no_stats(figures: object) -> Stats:
    return {}


@dataclass(frozen=True)
class Spec(Generic[F]):
    """A per-step check (or, without `describe`, a figure the checks share: the loss)."""

    name: Name  # the check's name in the policy and on the wire
    slots: tuple[Slot, ...]
    figures: Callable[[Raw], F]  # its figures of one window, from its slots
    # The slots that make it fire, and the value above which they do.
    thresholds: Callable[[Policy, Setup], Mapping[Slot, float]] = _no_thresholds
    needs: tuple[SeenKind, ...] = ()  # what a training step must show it (coverage)
    stats: Callable[[F], Stats] = _no_stats  # its figures in g.stats and on the wire
    describe: Callable[[F, Context], Found | None] | None = None

    @property
    def is_check(self) -> bool:
        return self.describe is not None

    @property
    def check(self) -> CheckName:
        """Its name as a check: the key the policy and the wire know it by."""
        name = self.name
        if name == "loss" or name == "grads":
            raise TypeError(f"the {name} spec is a figure the checks share, not a check")
        return name


def fmt(x: float) -> str:
    """A figure in a message: three significant digits, more for large or odd values."""
    return f"{x:.3g}" if x == x and abs(x) < 1e4 else f"{x:.4g}"


def listed(counts: Mapping[K, int], each: str, sep: str) -> tuple[str, float]:
    """The non-zero counts as text (`each` formats one, with {n}, {k} and {s}: "" for one,
    "s" for more, so "{n} {k} id{s}" says "1 label id", "2 label ids") and their total."""
    parts = [(k, n) for k, n in counts.items() if n > 0]
    return (sep.join(each.format(n=n, k=k, s="" if n == 1 else "s") for k, n in parts),
            float(sum(n for _, n in parts)))
