"""The flags tensor: every per-step check accumulates into it on the device, into the slots
its spec lays out (guard/checks/); the host reads it once per read boundary, combined across
ranks with one all-reduce (MAX), as a `Reading`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from guard.checks import Slot, watching
from guard.checks.spec import Setup
from guard.device.compile import compiling
from guard.device.reading import LAYOUT, Layout, Reading
from guard.policy import Policy

__all__ = ["Flags"]

# (local, max-reduced over ranks, 1 + highest rank over its threshold or 0) per slot.
_Raw = tuple[list[float], list[float], list[float]]
_Entry = tuple[torch.Tensor, torch.cuda.Event | None]


def _dtype_for(device: torch.device) -> torch.dtype:
    # float64 keeps counts exact to 2**53; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def thresholds(policy: Policy, real: int = 1, columns: int = 1,
               layout: Layout = LAYOUT) -> dict[Slot, float]:
    """The slots of the enabled checks that make them fire, and the value above which, for a
    head with `real` real columns of `columns`."""
    setup = Setup(watching(policy), real, columns)
    out: dict[Slot, float] = {}
    for spec in layout.specs:
        if spec.is_check and policy.enabled(spec.check):
            out.update(spec.thresholds(policy, setup))
    return out


class Flags:
    """A small device vector plus the machinery to read it without stalling the device."""

    def __init__(self, device: torch.device, over: Mapping[Slot, float] | None = None,
                 rank: int = 0, layout: Layout = LAYOUT) -> None:
        self.layout = layout
        self.t = torch.zeros(len(layout), dtype=_dtype_for(device), device=device)
        self._views: tuple[torch.Tensor, ...] | None = None  # t's slots (`_slot`)
        # Per slot, the value above which it is a violation; inf: a figure, never crossed.
        limits = [float("inf")] * len(layout)
        for slot, value in (over or {}).items():
            limits[layout.index[slot]] = value
        self.thresholds = torch.tensor(limits, dtype=self.t.dtype, device=device)
        # The per-step marks and the slots counting the steps that ended without them.
        pairs = [(layout.index[s.without], i) for i, s in enumerate(layout.slots) if s.without]
        self._marks = torch.tensor([m for m, _ in pairs], dtype=torch.int64, device=device)
        self._blind = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=device)
        self.rank = rank
        self._pending: _Entry | None = None
        # Called at each read with the all-reduced (slots,) "crossed on a rank" vector, on the
        # device (guard/step/skip.py's DeviceSkip: found_inf for the optimizer).
        self.on_snapshot: Callable[[torch.Tensor], None] | None = None

    @classmethod
    def from_policy(cls, policy: Policy, device: torch.device, rank: int, *, real: int = 1,
                    columns: int = 1) -> Flags:
        """`real` and `columns`: of this process's head output (some thresholds depend on
        them)."""
        return cls(device, thresholds(policy, real, columns), rank)

    @property
    def device(self) -> torch.device:
        return self.t.device

    def follow(self, device: torch.device) -> None:
        """Move to `device` when the model moved after attach (a copy, never a host read)."""
        if device != self.t.device:
            self.t = self.t.to(device=device, dtype=_dtype_for(device))
            self._views = None
            self.thresholds = self.thresholds.to(device=device, dtype=self.t.dtype)
            self._marks, self._blind = self._marks.to(device), self._blind.to(device)

    # -- writers, inside hooks: device ops only -----------------------------------------------

    def _slot(self, slot: Slot) -> torch.Tensor:
        """The 0-dim view of `slot` in t, made once for every slot (one unbind) while t stays
        the same tensor: a put or a mark is then one op, not two. In a step, between the
        model's large ops, a small op costs several microseconds of host time, and the puts
        were a fifth of the guard's ops a step (docs/benchmarks.md, "Fewer ops a step").
        Traced, a fresh view: cached views would be graph inputs aliasing t."""
        if compiling():
            return self.t[self.layout.index[slot]]
        if self._views is None:
            # Made outside inference mode: a view made inside it can't be written outside.
            with torch.inference_mode(False):
                self._views = self.t.unbind(0)
        return self._views[self.layout.index[slot]]

    def put(self, slot: Slot, value: torch.Tensor | float) -> None:
        """Accumulate `value` into `slot` as the slot reduces: add, max, or overwrite."""
        view = self._slot(slot)
        if not isinstance(value, torch.Tensor):  # a host number: the sample's size, a mark
            if slot.reduce == "sum":
                view.add_(value)
            elif slot.reduce == "max":
                view.clamp_(min=value)
            else:
                view.fill_(value)
            return
        value = self._accept(value)
        if slot.reduce == "sum":
            view.add_(value)
        elif slot.reduce == "max":
            torch.maximum(view, value, out=view)  # promoted to the flags' dtype
        else:
            view.copy_(value)

    def overwrite(self, slots: tuple[Slot, ...], values: torch.Tensor) -> None:
        """Set consecutive slots of the layout (one spec's, in its order) to `values`, (k,):
        one device write where k puts would be 3k small ops (the gradients' figures)."""
        first = self.layout.index[slots[0]]
        if [self.layout.index[s] for s in slots] != list(range(first, first + len(slots))):
            raise ValueError(f"slots {[s.name for s in slots]} are not consecutive")
        self.t[first : first + len(slots)].copy_(self._accept(values))

    def at_least(self, slot: Slot, value: torch.Tensor) -> None:
        """At least `value` in `slot`: a detection, not a count (max, whatever the slot)."""
        view = self._slot(slot)
        torch.maximum(view, self._accept(value), out=view)

    def mark(self, slot: Slot) -> None:
        """This step's data reached the guard (a device write: fine under torch.compile)."""
        self._slot(slot).fill_(1.0)

    def end_step(self) -> None:
        """At a step boundary: count the marks the step did not set, and start the next one."""
        if self._marks.numel():
            missed = (self.t.index_select(0, self._marks) == 0).to(self.t.dtype)
            self.t.index_add_(0, self._blind, missed)
            self.t.index_fill_(0, self._marks, 0.0)

    def _accept(self, value: torch.Tensor) -> torch.Tensor:
        # Flags made on the CPU before model.cuda(): move them to the accelerator rather than
        # copying values back (a non-blocking copy to the host could be read before it lands).
        if value.device == self.t.device:  # the usual case: no copy, no call
            return value
        if self.t.device.type == "cpu" and value.device.type != "cpu":
            self.follow(value.device)
        return value.to(self.t.device, non_blocking=True)

    # -- the read, at a step boundary ----------------------------------------------------------

    def read(self, *, lagged: bool, reduce: bool = True) -> Reading | None:
        """Values as of now, or (lagged) as of the previous read so the device never stalls
        (on the CPU too, where a DeviceSkip reads one read late on every device alike).

        `reduce=False` (detach: one rank may detach alone, after an exception) skips the
        collective; the values then count for this rank only.
        """
        entry = self._snapshot(reduce)
        if not lagged:
            older, self._pending = self._pending, None
            if older is None:
                return self.layout.reading(*self._wait(entry))
            # A lagged read is still queued: both windows as one.
            (lo, gl, wh), (now_lo, now_gl, now_wh) = self._wait(older), self._wait(entry)
            who = [max(a, b) for a, b in zip(wh, now_wh, strict=True)]
            combine = self.layout.combine
            return self.layout.reading(combine(lo, now_lo), combine(gl, now_gl), who)
        previous, self._pending = self._pending, entry
        return None if previous is None else self.layout.reading(*self._wait(previous))

    def flush(self) -> Reading | None:
        """Whatever a lagged read left queued (at detach)."""
        previous, self._pending = self._pending, None
        return None if previous is None else self.layout.reading(*self._wait(previous))

    def _snapshot(self, reduce: bool) -> _Entry:
        """Enqueue: copy local + all-reduced values, zero the accumulator, start the D2H copy."""
        who = torch.where(self.t > self.thresholds, self.rank + 1.0, 0.0).to(self.t.dtype)
        both = torch.stack([self.t, self.t, who])  # (3, slots): local, global, who
        self.t.zero_()
        if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The one collective of the guard: every rank takes the decision on the same values
            # and learns the highest rank that crossed a threshold.
            dist.all_reduce(both[1:], op=dist.ReduceOp.MAX)
        if self.on_snapshot is not None:
            self.on_snapshot(both[2])
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

