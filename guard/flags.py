"""The flags tensor: every per-step check accumulates into it on the device; the host reads
it once per read boundary, combined across ranks with one all-reduce (MAX)."""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

__all__ = ["NSLOTS", "Flags", "HostFlags", "Slot"]


class Slot(IntEnum):
    """Positions in the flags vector. Sums unless noted."""

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


NSLOTS = len(Slot)

# (local values, values max-reduced over ranks, 1 + highest rank over its threshold or 0);
# the first two are equal on a single process.
HostFlags = tuple[list[float], list[float], list[float]]


def _dtype_for(device: torch.device) -> torch.dtype:
    # float64 keeps counts exact to 2**53; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


class Flags:
    """A small device vector plus the machinery to read it without stalling the device."""

    def __init__(self, device: torch.device, thresholds: list[float], rank: int = 0) -> None:
        self.t = torch.zeros(NSLOTS, dtype=_dtype_for(device), device=device)
        # Per slot, the value above which the slot is a violation (inf: never).
        self.thresholds = torch.tensor(thresholds, dtype=self.t.dtype, device=device)
        self.rank = rank
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    @property
    def device(self) -> torch.device:
        return self.t.device

    def follow(self, device: torch.device) -> None:
        """Move to `device` when the model moved after attach (a copy, never a host read)."""
        if device != self.t.device:
            self.t = self.t.to(device=device, dtype=_dtype_for(device))
            self.thresholds = self.thresholds.to(device=device, dtype=self.t.dtype)

    def _accept(self, value: torch.Tensor) -> torch.Tensor:
        # Flags made on the CPU before model.cuda(): move them to the accelerator rather than
        # copying values back (a non-blocking copy to the host could be read before it lands).
        if self.t.device.type == "cpu" and value.device.type != "cpu":
            self.follow(value.device)
        return value.to(self.t.device, non_blocking=True)

    def add(self, slot: Slot, value: torch.Tensor) -> None:
        self.t[slot].add_(self._accept(value))

    def add_const(self, slot: Slot, value: float) -> None:
        self.t[slot].add_(value)

    def max(self, slot: Slot, value: torch.Tensor) -> None:
        value = self._accept(value)
        view = self.t[slot]
        torch.maximum(view, value.to(view.dtype), out=view)

    def set(self, slot: Slot, value: torch.Tensor) -> None:
        self.t[slot].copy_(self._accept(value))

    def _snapshot(self, reduce: bool = True) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Enqueue: copy local + all-reduced values, zero the accumulator, start the D2H copy.

        `reduce=False` (detach: one rank may detach alone, after an exception) skips the
        collective; the values then count for this rank only.
        """
        who = torch.where(self.t > self.thresholds, float(self.rank + 1), 0.0).to(self.t.dtype)
        both = torch.stack([self.t, self.t, who])  # (3, NSLOTS): local, global, who
        self.t.zero_()
        if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The one collective of the guard: every rank takes the decision on the same values
            # and learns the highest rank that crossed a threshold.
            dist.all_reduce(both[1:], op=dist.ReduceOp.MAX)
        if both.device.type != "cuda":
            return both, None
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def _wait(entry: tuple[torch.Tensor, torch.cuda.Event | None]) -> HostFlags:
        host, event = entry
        if event is not None:
            event.synchronize()
        local, glob, who = host.tolist()  # step boundary: the only host read of the hot path
        return local, glob, who

    def read(self, *, lagged: bool, reduce: bool = True) -> HostFlags | None:
        """Values as of now, or (lagged) as of the previous read so the device never stalls."""
        entry = self._snapshot(reduce)
        if not lagged or entry[1] is None:
            older, self._pending = self._pending, None
            if older is not None:  # a lagged read is still queued: fold it in first
                lo, gl, wh = self._wait(older)
                now_lo, now_gl, now_wh = self._wait(entry)
                who = [max(a, b) for a, b in zip(wh, now_wh, strict=True)]
                return _combine(lo, now_lo), _combine(gl, now_gl), who
            return self._wait(entry)
        previous, self._pending = self._pending, entry
        return None if previous is None else self._wait(previous)

    def flush(self) -> HostFlags | None:
        """Whatever a lagged read left queued (at detach)."""
        previous, self._pending = self._pending, None
        return None if previous is None else self._wait(previous)


_MAX_SLOTS = frozenset({Slot.PM_MAX, Slot.SPIKE, Slot.SPIKE_RATIO})
_LAST_SLOTS = frozenset({Slot.LOSS})


def _combine(old: list[float], new: list[float]) -> list[float]:
    """Two consecutive snapshots as one window: sums add, maxima max, the loss is the newer."""
    out = []
    for slot, (a, b) in enumerate(zip(old, new, strict=True)):
        if slot in _MAX_SLOTS:
            out.append(max(a, b))
        elif slot in _LAST_SLOTS:
            out.append(b if new[Slot.LOSS_SEEN] else a)
        else:
            out.append(a + b)
    return out
