"""The flags tensor: every per-step check accumulates into it on the device; the host reads
it once per read boundary, combined across ranks with one all-reduce (MAX), as a `Reading`."""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Literal

import torch
import torch.distributed as dist

from guard.policy import Policy
from guard.step.reading import Reading, Values

__all__ = ["Flags", "NonfiniteKind", "SeenKind", "TokenKind"]

NonfiniteKind = Literal["logits", "hidden", "loss"]
TokenKind = Literal["input", "label"]
# What the per-step checks need to see in a training step (the coverage check).
SeenKind = Literal["logits", "labels", "loss"]


class _Slot(IntEnum):
    """Positions in the flags vector, private to this module. Sums unless noted."""

    PM_SUM = 0  # padding mass summed over sampled positions
    PM_COUNT = 1  # sampled positions
    PM_MAX = 2  # max padding mass (max-combined)
    NF_HIDDEN = 3  # non-finite values in the lm_head input
    NF_LOGITS = 4  # non-finite values in the real-vocab logits
    NF_LOSS = 5  # non-finite losses
    OOR_INPUT = 6  # input ids outside [0, real)
    OOR_LABEL = 7  # labels outside [0, real), ignore index exempt
    LOSS = 8  # last loss (overwritten)
    LOSS_SEEN = 9  # 1 when a loss was recorded since the last read
    SPIKE = 10  # loss_spike: 1 when the loss crossed the spike rule (max-combined)
    SPIKE_RATIO = 11  # loss / reference at the worst step (max-combined)
    SEEN_LOGITS = 12  # 1 once the current step's logits were measured (reset each step)
    SEEN_LABELS = 13  # 1 once the current step's labels were checked (reset each step)
    SEEN_LOSS = 14  # 1 once the current step's loss was folded (reset each step)
    BLIND_LOGITS = 15  # steps of the window in which no logits were measured
    BLIND_LABELS = 16  # steps of the window in which no labels were checked
    BLIND_LOSS = 17  # steps of the window in which no loss was seen
    FUSED = 18  # forwards whose logits were measured from the final hidden states (no head call)
    NEGATIVE_LABELS = 19  # labels < 0 other than the ignore index (among OOR_LABEL)
    MAX_ID = 20  # the highest id >= real seen (max-combined); 0 when none
    ROWS_NONFINITE = 21  # non-finite values in the padding rows of the embedding / head
    ROWS_RATIO = 22  # largest padding-row norm / largest real-row norm (max-combined)


_NONFINITE: dict[str, _Slot] = {"logits": _Slot.NF_LOGITS, "hidden": _Slot.NF_HIDDEN,
                                "loss": _Slot.NF_LOSS}
_TOKENS: dict[str, _Slot] = {"input": _Slot.OOR_INPUT, "label": _Slot.OOR_LABEL}
_SEEN: dict[str, _Slot] = {"logits": _Slot.SEEN_LOGITS, "labels": _Slot.SEEN_LABELS,
                           "loss": _Slot.SEEN_LOSS}
_BLIND: dict[str, _Slot] = {"logits": _Slot.BLIND_LOGITS, "labels": _Slot.BLIND_LABELS,
                            "loss": _Slot.BLIND_LOSS}
# Which per-step checks need each kind of data (DESIGN.md, coverage).
NEEDS: dict[str, tuple[str, ...]] = {"logits": ("padding_mass", "nonfinite"),
                                     "labels": ("token_range",),
                                     "loss": ("nonfinite", "loss_spike")}
# Per per-step check, the slots whose threshold it has (the other slots: inf, never crossed).
_CHECK_SLOTS: dict[str, tuple[_Slot, ...]] = {
    "token_range": tuple(_TOKENS.values()),
    "padding_mass": (_Slot.PM_MAX,),
    "nonfinite": tuple(_NONFINITE.values()),
    "loss_spike": (_Slot.SPIKE,),
    "padding_rows": (_Slot.ROWS_NONFINITE, _Slot.ROWS_RATIO),
    "coverage": tuple(_BLIND.values()),
}
_MAX_SLOTS = frozenset({_Slot.PM_MAX, _Slot.SPIKE, _Slot.SPIKE_RATIO, _Slot.MAX_ID,
                        _Slot.ROWS_RATIO})

# (local, max-reduced over ranks, 1 + highest rank over its threshold or 0) per slot.
_Raw = tuple[list[float], list[float], list[float]]
_Entry = tuple[torch.Tensor, torch.cuda.Event | None]


def _dtype_for(device: torch.device) -> torch.dtype:
    # float64 keeps counts exact to 2**53; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def _thresholds(policy: Policy) -> list[float]:
    """Per slot, the value above which it is a violation: counts over 0, the padding mass
    over the policy's threshold; inf for slots that are values, not checks."""
    out = [float("inf")] * len(_Slot)
    for slots in _CHECK_SLOTS.values():
        for slot in slots:
            out[slot] = 0.0
    out[_Slot.PM_MAX] = policy.checks.padding_mass.threshold
    out[_Slot.ROWS_RATIO] = policy.checks.padding_rows.factor
    # A blind step is a coverage violation only where a check that needs the data is on.
    for kind, slot in _BLIND.items():
        if not (policy.enabled("coverage") and any(policy.enabled(c) for c in NEEDS[kind])):
            out[slot] = float("inf")
    return out


class Flags:
    """A small device vector plus the machinery to read it without stalling the device."""

    def __init__(self, device: torch.device, thresholds: Sequence[float], rank: int = 0) -> None:
        self.t = torch.zeros(len(_Slot), dtype=_dtype_for(device), device=device)
        self.thresholds = torch.tensor(thresholds, dtype=self.t.dtype, device=device)
        self.rank = rank
        self._pending: _Entry | None = None

    @classmethod
    def from_policy(cls, policy: Policy, device: torch.device, rank: int) -> Flags:
        return cls(device, _thresholds(policy), rank)

    @property
    def device(self) -> torch.device:
        return self.t.device

    def follow(self, device: torch.device) -> None:
        """Move to `device` when the model moved after attach (a copy, never a host read)."""
        if device != self.t.device:
            self.t = self.t.to(device=device, dtype=_dtype_for(device))
            self.thresholds = self.thresholds.to(device=device, dtype=self.t.dtype)

    # -- writers, inside hooks: device ops only -----------------------------------------------

    def add_padding_mass(self, mass: torch.Tensor) -> None:
        """Per-position padding masses (n,) of sampled positions."""
        self._add(_Slot.PM_SUM, mass.sum())
        self._max(_Slot.PM_MAX, mass.max())

    def add_positions(self, n: int) -> None:
        """Positions the padding mass was measured on (a host int: the sample's size)."""
        self.t[_Slot.PM_COUNT].add_(n)

    def add_nonfinite(self, kind: NonfiniteKind, n: torch.Tensor) -> None:
        self._add(_NONFINITE[kind], n)

    def nonfinite_at_least(self, kind: NonfiniteKind, n: torch.Tensor) -> None:
        """At least `n` non-finite values (a detection, not a count: max, not sum)."""
        self._max(_NONFINITE[kind], n)

    def add_out_of_range(self, kind: TokenKind, n: torch.Tensor, negative: torch.Tensor,
                         top: torch.Tensor) -> None:
        """`n` ids out of range, `negative` of them below 0, the highest of them `top`."""
        self._add(_TOKENS[kind], n)
        if kind == "label":
            self._add(_Slot.NEGATIVE_LABELS, negative)
        self._max(_Slot.MAX_ID, top)

    def add_rows(self, nonfinite: torch.Tensor, ratio: torch.Tensor) -> None:
        """The padding rows' non-finite values and their largest norm over the real rows'."""
        self._add(_Slot.ROWS_NONFINITE, nonfinite)
        self._max(_Slot.ROWS_RATIO, ratio)

    def saw(self, kind: SeenKind) -> None:
        """This step's `kind` reached the guard (a device write: fine under torch.compile)."""
        self.t[_SEEN[kind]].fill_(1.0)

    def add_fused(self) -> None:
        """A forward whose logits were measured from the final hidden states."""
        self.t[_Slot.FUSED].add_(1.0)

    def end_step(self) -> None:
        """At a step boundary: count what the step did not see, and start the next one."""
        seen = self.t[_Slot.SEEN_LOGITS : _Slot.SEEN_LOSS + 1]  # (3,), in _BLIND's order
        self.t[_Slot.BLIND_LOGITS : _Slot.BLIND_LOSS + 1].add_(seen == 0)
        seen.zero_()

    def set_loss(self, loss: torch.Tensor) -> None:
        self.t[_Slot.LOSS].copy_(self._accept(loss))
        self.t[_Slot.LOSS_SEEN].fill_(1.0)

    def add_spike(self, spike: torch.Tensor, ratio: torch.Tensor) -> None:
        self._max(_Slot.SPIKE, spike)
        self._max(_Slot.SPIKE_RATIO, ratio)

    def _accept(self, value: torch.Tensor) -> torch.Tensor:
        # Flags made on the CPU before model.cuda(): move them to the accelerator rather than
        # copying values back (a non-blocking copy to the host could be read before it lands).
        if self.t.device.type == "cpu" and value.device.type != "cpu":
            self.follow(value.device)
        return value.to(self.t.device, non_blocking=True)

    def _add(self, slot: _Slot, value: torch.Tensor) -> None:
        self.t[slot].add_(self._accept(value))

    def _max(self, slot: _Slot, value: torch.Tensor) -> None:
        value = self._accept(value)
        view = self.t[slot]
        torch.maximum(view, value.to(view.dtype), out=view)

    # -- the read, at a step boundary ----------------------------------------------------------

    def read(self, *, lagged: bool, reduce: bool = True) -> Reading | None:
        """Values as of now, or (lagged) as of the previous read so the device never stalls.

        `reduce=False` (detach: one rank may detach alone, after an exception) skips the
        collective; the values then count for this rank only.
        """
        entry = self._snapshot(reduce)
        if not lagged or entry[1] is None:
            older, self._pending = self._pending, None
            if older is None:
                return _reading(self._wait(entry))
            # A lagged read is still queued: both windows as one.
            (lo, gl, wh), (now_lo, now_gl, now_wh) = self._wait(older), self._wait(entry)
            who = [max(a, b) for a, b in zip(wh, now_wh, strict=True)]
            return _reading((_combine(lo, now_lo), _combine(gl, now_gl), who))
        previous, self._pending = self._pending, entry
        return None if previous is None else _reading(self._wait(previous))

    def flush(self) -> Reading | None:
        """Whatever a lagged read left queued (at detach)."""
        previous, self._pending = self._pending, None
        return None if previous is None else _reading(self._wait(previous))

    def _snapshot(self, reduce: bool) -> _Entry:
        """Enqueue: copy local + all-reduced values, zero the accumulator, start the D2H copy."""
        who = torch.where(self.t > self.thresholds, self.rank + 1.0, 0.0).to(self.t.dtype)
        both = torch.stack([self.t, self.t, who])  # (3, slots): local, global, who
        self.t.zero_()
        if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The one collective of the guard: every rank takes the decision on the same values
            # and learns the highest rank that crossed a threshold.
            dist.all_reduce(both[1:], op=dist.ReduceOp.MAX)
        if both.device.type != "cuda":
            return both, None
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return host, event

    @staticmethod
    def _wait(entry: _Entry) -> _Raw:
        host, event = entry
        if event is not None:
            event.synchronize()
        local, glob, who = host.tolist()  # step boundary: the only host read of the hot path
        return local, glob, who


# Host side from here: plain lists of floats, after the read.

def _combine(old: list[float], new: list[float]) -> list[float]:
    """Two consecutive windows as one: sums add, maxima max, the loss is the newer one seen."""
    out = [max(a, b) if slot in _MAX_SLOTS else a + b
           for slot, (a, b) in enumerate(zip(old, new, strict=True))]
    out[_Slot.LOSS] = new[_Slot.LOSS] if new[_Slot.LOSS_SEEN] else old[_Slot.LOSS]
    return out


def _values(v: list[float]) -> Values:
    count = v[_Slot.PM_COUNT]
    return Values(
        padding_mass=v[_Slot.PM_SUM] / count if count else None,
        padding_mass_max=v[_Slot.PM_MAX] if count else None,
        nonfinite={kind: int(v[slot]) for kind, slot in _NONFINITE.items()},
        out_of_range={kind: int(v[slot]) for kind, slot in _TOKENS.items()},
        loss=v[_Slot.LOSS] if v[_Slot.LOSS_SEEN] else None,
        spike_ratio=v[_Slot.SPIKE_RATIO],
        blind={kind: int(v[slot]) for kind, slot in _BLIND.items()},
        fused=int(v[_Slot.FUSED]),
        negative_labels=int(v[_Slot.NEGATIVE_LABELS]),
        max_id=int(v[_Slot.MAX_ID]),
        rows_nonfinite=int(v[_Slot.ROWS_NONFINITE]),
        rows_ratio=v[_Slot.ROWS_RATIO],
    )


def _reading(raw: _Raw) -> Reading:
    local, glob, who = raw
    over: dict[str, int | None] = {}
    for check, slots in _CHECK_SLOTS.items():
        top = max(who[s] for s in slots)  # 1 + rank, or 0
        over[check] = int(top) - 1 if top > 0 else None
    return Reading(_values(local), _values(glob), over)
